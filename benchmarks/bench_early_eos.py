"""Rollouts whose rows end early: ended rows leave the decode batch, or stay in it (issue 21,
item 3).

    python benchmarks/bench_early_eos.py [--reps 3 --seeds 0 1 --threads 2 --sizes tiny real]

One process, ``--threads`` torch threads. The same rollout (B=16 left-padded prompts of 32 down
to 2 tokens, temperature-1 sampling with per-row seeds) twice per repetition, interleaved:
``drop_ended_rows=True`` (the default: a row that emits EOS leaves the batch, its KV cache is
compacted away) and ``drop_ended_rows=False`` (every step computes every row until the last one
ends, the engine's behaviour before). Tokens, masks and log-probs of the two are compared.

Lengths follow a known distribution instead of a trained model's: the random BLOOM's final
LayerNorm is scaled down (every logit near 0, tokens near uniform) and its bias points along the
EOS token's embedding, which gets a logit ``alpha`` above the rest, so each step ends a row with
probability ``p`` (geometric lengths). ``p`` is set so that ``--early-fraction`` (default 40 %,
the issue's 30-50 %) of the rows end before ``--new-tokens``; the table prints the drawn lengths.
Sizes: ``tiny`` 4 layers x 128, vocab 1,024; ``real`` BLOOM-560m's width and vocabulary (hidden
1,024, 16 heads, vocab 250,880) with 4 layers, where the LM head is most of a decode step.

tokens/s = generated tokens (EOS included, padding not) / wall seconds; min / median / max over
reps x seeds, ratio of medians; a claim holds only if every seed shows it.

Measured: see the README's benchmark section (the machine and its load are printed by the run).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    "real": dict(vocab_size=250_880, hidden_size=1024, num_layers=4, num_heads=16),
}
PAD, EOS, BATCH = 3, 2, 16


def prompts(seed: int, vocab: int):
    """16 left-padded prompts of 32 down to 2 tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((BATCH, 32), PAD, dtype=torch.long)
    mask = torch.zeros((BATCH, 32), dtype=torch.long)
    for row in range(BATCH):
        real = 32 - 2 * row
        ids[row, 32 - real :] = torch.randint(4, vocab, (real,), generator=generator)
        mask[row, 32 - real :] = 1
    return ids, mask


def eos_model(directory: Path, size: str, seed: int, stop_probability: float) -> None:
    """A random BLOOM whose every step emits EOS with about ``stop_probability``."""
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    arch = BloomArchitecture(**SIZES[size])
    model = random_hf_bloom(arch, seed=seed)
    vocab = arch.vocab_size
    alpha = math.log(stop_probability * (vocab - 1) / (1 - stop_probability))
    with torch.no_grad():
        ln_f = model.transformer.ln_f
        ln_f.weight.mul_(1e-3)  # every logit near 0: tokens near uniform
        direction = torch.randn(arch.hidden_size, generator=torch.Generator().manual_seed(seed))
        direction /= direction.norm()
        ln_f.bias.copy_(direction)
        embeddings = model.transformer.word_embeddings.weight
        embeddings[EOS] = alpha * direction  # logit(EOS) ~ alpha, the rest ~ 0
    model.save_pretrained(directory, safe_serialization=True)


def stop_probability(early_fraction: float, new_tokens: int) -> float:
    """Per-step EOS probability that ends ``early_fraction`` of rows within ``new_tokens``."""
    return 1 - (1 - early_fraction) ** (1 / new_tokens)


def run_size(size: str, args) -> dict:
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate

    times = {True: [], False: []}
    lengths, per_seed = [], {}
    p = stop_probability(args.early_fraction, args.new_tokens)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            eos_model(Path(tmp), size, seed, p)
            model = load_bloom(tmp, init_weights=False).eval()
        ids, mask = prompts(seed, SIZES[size]["vocab_size"])
        row_seeds = tuple(seed * 1000 + row for row in range(BATCH))
        seed_times = {True: [], False: []}
        outputs = {}
        for _ in range(args.reps):
            for drop in (True, False):
                sampling = SamplingConfig(
                    max_new_tokens=args.new_tokens, row_seeds=row_seeds, eos_id=EOS,
                    pad_id=PAD, drop_ended_rows=drop,
                )  # fmt: skip
                start = time.perf_counter()
                outputs[drop] = generate(model, ids, mask, sampling)
                seed_times[drop].append(time.perf_counter() - start)
        a, b = outputs[True], outputs[False]
        assert torch.equal(a.response_ids, b.response_ids), "tokens differ"
        assert torch.equal(a.response_mask, b.response_mask), "masks differ"
        logprob_diff = float((a.response_logprobs - b.response_logprobs).abs().max())
        row_lengths = a.response_mask.sum(dim=1).tolist()
        lengths += row_lengths
        tokens = sum(row_lengths)
        for drop in (True, False):
            times[drop] += [tokens / s for s in seed_times[drop]]
        ratio = statistics.median(seed_times[False]) / statistics.median(seed_times[True])
        per_seed[seed] = {"ratio": ratio, "logprob_diff": logprob_diff, "lengths": row_lengths}
        del model
    return {"rates": times, "lengths": lengths, "per_seed": per_seed, "p": p}


def stats(rates: list[float]) -> str:
    return f"{min(rates):7.1f} / {statistics.median(rates):7.1f} / {max(rates):7.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "real"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--early-fraction", type=float, default=0.4)
    args = parser.parse_args()
    if args.reps < 3 or len(args.seeds) < 2:
        parser.error("measure with >= 3 reps and >= 2 seeds")
    torch.set_num_threads(args.threads)
    from megatron_rlhf.distributed import ParallelConfig, destroy, initialize

    initialize(ParallelConfig())
    print(f"machine: {os.cpu_count()} CPUs, {args.threads} threads, load {os.getloadavg()}")
    print(f"B={BATCH}, {args.new_tokens} new tokens, {args.reps} reps x seeds {args.seeds}")
    print("| size | rows ended early | mean length | drop ended rows tok/s (min/med/max) "
          "| keep them tok/s | ratio of medians | per seed | max logprob diff |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    try:
        for size in args.sizes:
            result = run_size(size, args)
            rates, lengths = result["rates"], result["lengths"]
            early = sum(n < args.new_tokens for n in lengths) / len(lengths)
            ratio = statistics.median(rates[True]) / statistics.median(rates[False])
            seeds = ", ".join(f"{r['ratio']:.2f}x" for r in result["per_seed"].values())
            diff = max(r["logprob_diff"] for r in result["per_seed"].values())
            print(
                f"| {size} | {100 * early:.0f} % | {statistics.mean(lengths):.1f} | "
                f"{stats(rates[True])} | {stats(rates[False])} | {ratio:.2f}x | {seeds} | "
                f"{diff:.1e} |"
            )
    finally:
        destroy()
    print(f"load at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
