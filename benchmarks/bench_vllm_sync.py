"""The actor -> vLLM weight sync, shard to shard against the full stream, in one process.

    python benchmarks/bench_vllm_sync.py [--size 560m|560m4|tiny] [--reps 3]

One rank (actor TP 1, vLLM TP 1), fp32, a random BLOOM built with transformers
(``models/bloom/tiny.py``): ``560m`` = BLOOM-560m (hidden 1,024, 16 heads, 24 layers, vocab
250,880), ``560m4`` the same with 4 layers, ``tiny`` the test model (2 x 64, vocab 512). Each
repetition nudges every actor weight, then times ``VLLMRolloutEngine.refresh()`` (the
shard-to-shard sync) and the full stream (``hf_tensor_stream`` into vLLM's ``reload_weights``)
one after the other; prints every repetition (the first pays first-touch allocations), the
bytes a rank and the process's peak RSS. The bytes a rank at TP 2 are checked by the vLLM
tests (``tests/dist_vllm_worker.py``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2),
    "560m4": dict(vocab_size=250_880, hidden_size=1024, num_layers=4, num_heads=16),
    "560m": dict(vocab_size=250_880, hidden_size=1024, num_layers=24, num_heads=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="560m")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.generation.rollout_engines import VLLMRolloutEngine
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.planning.shapes import model_params

    arch = BloomArchitecture(**SIZES[args.size])
    initialize()
    with tempfile.TemporaryDirectory(prefix="bench_vllm_sync_") as root:
        save_random_hf_bloom(Path(root) / "hf", arch, seed=1)
        model = load_bloom(Path(root) / "hf")
        engine = VLLMRolloutEngine(model, model.pg_collection, max_model_len=64, max_rows=8, seed=0)
        shard, full = [], []
        for _ in range(args.reps):
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1.0001)
            shard.append(engine.refresh())
            with torch.no_grad():
                full.append(engine.generator.load_weights(hf_tensor_stream(model)))
        engine.close()
    full_bytes = model_params(arch) * 4
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{args.size}: shard-to-shard {[round(s, 3) for s in shard]} s (median "
        f"{statistics.median(shard):.3f}), {engine.sync_bytes_per_rank:,} B a rank, "
        f"{engine.sync_remote_bytes_per_rank:,} B of them from other ranks"
    )
    print(
        f"{args.size}: full stream {[round(s, 3) for s in full]} s (median "
        f"{statistics.median(full):.3f}), {full_bytes:,} B a rank; peak RSS {rss:.2f} GB"
    )


if __name__ == "__main__":
    main()
