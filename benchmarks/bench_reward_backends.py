"""train-reward on its two backends: Megatron-Core BLOOM vs transformers BLOOM under DeepSpeed ZeRO.

    python benchmarks/bench_reward_backends.py [--reps 3] [--seeds 0 1] [--zero-stage 3]

Each run is ``torchrun --nproc-per-node 2 -m megatron_rlhf train-reward`` (gloo, CPU) on the same
tiny random BLOOM (hidden 256, 4 layers, 8 heads, vocab 1024) and the same random preference pairs
(prompt + response up to 96 tokens), AM loss, global batch 8 pairs, micro batch 2, 6 steps:
Megatron at DP=2 against DeepSpeed ZeRO-``--zero-stage`` at DP=2. The sides alternate run by run
(interleaved), ``--reps`` runs per side and seed. pairs/s counts the steps after the first
(start-up, imports and the first step's allocations excluded); peak RSS is the larger of the two
ranks' peak resident memory (imports included: ~0.5 GB of it is megatron-core and torch).

Measured on the 2-core CPU VM of this project (torch 2.13.0+cpu, deepspeed 0.19.8, megatron-core
0.16.1) while other jobs ran (load average 13.4 on 2 CPUs: absolute figures are inflated and the
spread is wide), ``python benchmarks/bench_reward_backends.py`` (3 reps × seeds 0 and 1, ZeRO-3):

    backend                pairs/s min   median      max  peak RSS MB min   median      max
    megatron                      3.77     5.26     9.91              583      587      594
    deepspeed ZeRO-3              3.69     5.70     8.55              806      823      851
    ratio of medians deepspeed/megatron: pairs/s 1.08, peak RSS 1.40

At this size the throughputs are indistinguishable within the noise (the ranges overlap almost
entirely); the DeepSpeed processes hold ~0.24 GB more, mostly the deepspeed and transformers
modules they import beside megatron-core (which the shared trainer code imports on both
sides). Memory partitioning only pays at sizes where the model state dominates: see below.

Choosing at 7B1: ``python benchmarks/bench_reward_backends.py --only-7b1`` prints the memory per
GPU of one AM training step on BLOOMZ-7B1 over 8 GPUs; the Megatron rows come from the planner
(megatron_rlhf/planning/memory.py), the ZeRO rows apply ZeRO's partitioning to the same parameter
count (bf16 weights 2 B/param, /8 at stage 3; bf16 grads 2 B/param, /8 from stage 2; fp32
master + Adam moments 12 B/param /8, in host memory with offload) and the planner's TP=1
activations (one 2,048-token pair, two sequences, full recompute):

    BLOOMZ-7B1 AM (7.07e9 params), 8 GPUs; GB per GPU
    layout                             weights   grads   optim  activ.   total
    Megatron TP=2 DP=4 dist. optim         7.1    14.1    10.6     4.1    35.9
    Megatron TP=1 DP=8 dist. optim        14.1    28.3    10.6     8.2    61.2
    DeepSpeed ZeRO-1 DP=8                 14.1    14.1    10.6     8.2    47.1
    DeepSpeed ZeRO-2 DP=8                 14.1     1.8    10.6     8.2    34.7
    DeepSpeed ZeRO-3 DP=8                  1.8     1.8    10.6     8.2    22.4
    DeepSpeed ZeRO-3 DP=8 + offload        1.8     1.8     0.0     8.2    11.8

(ZeRO-3 also holds the layers it has gathered in flight, ~0.5 GB: one 0.24e9-parameter layer
in bf16 and the one prefetched; offload needs 12 B/param = 85 GB of host memory per node.)
Megatron keeps an fp32 gradient buffer (``grad_reduce_in_fp32``), hence its larger grads.

So every layout fits 80 GB at 7B1; what decides is communication and the pipeline downstream.
Per optimizer step ZeRO-3 moves ~3× the parameter bytes per GPU (two all-gathers and a
reduce-scatter, 3 × 14.1 GB ≈ 42 GB, overlapped with compute by prefetch) against ~2× for
ZeRO-1/2 and DDP (all-reduce, 28 GB), while Megatron TP=2 adds 4 activation all-reduces per
layer per microbatch inside the TP pair (NVLink) and halves the gradient all-reduce. With the
paper's 180 pairs per step (45 microbatches per DP rank at DP=4, or 23 at DP=8), the per-step
parameter traffic is amortised over many microbatches in both cases. ZeRO needs no TP/PP
checkpoint conversion and works on any Hugging Face BLOOM; the Megatron path is the one that
scales the same code to the 176B policy (TP=8 × PP=10) and reuses the AM at any TP/PP.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ARCH = dict(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8)
GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 6


def make_inputs(root: Path, seed: int) -> Path:
    """A tiny random HF BLOOM (no score head) and 64 random pairs; returns the config path."""
    import torch

    from megatron_rlhf.data import Example, write_preference_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    save_random_hf_bloom(root / "hf", tiny_architecture(**ARCH), seed=seed)
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        return torch.randint(4, ARCH["vocab_size"], (length,), generator=generator).tolist()

    examples = [
        Example(tokens(32), (tokens(48 + i % 16), tokens(40 + i % 24)), None) for i in range(64)
    ]
    write_preference_dataset(
        root / "pairs", examples, vocab_size=ARCH["vocab_size"], pad_id=3, append_eos=False
    )
    config = {
        "loss": "am",
        "model": {"load": str(root / "hf")},
        "data": {"train": str(root / "pairs")},
        "optim": {"lr": 1e-4},
        "train": {
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": MICRO_BATCH,
            "steps": STEPS,
            "eval_interval": 0,
            "save_interval": 0,
            "log_interval": 1,
            "seed": seed,
        },
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def one_run(config: str, output: str, backend: str, stage: int, report: str) -> None:
    """Inside torchrun: train, timing every optimizer step; rank 0 writes the figures."""
    import torch.distributed as dist

    from megatron_rlhf.config import load_config
    from megatron_rlhf.reward import train as train_module
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.deepspeed_engine import DeepSpeedTrainEngine

    seconds = []
    engine_class = DeepSpeedTrainEngine if backend == "deepspeed" else TrainEngine
    original = engine_class.step

    def timed_step(self, microbatches, loss_fn, forward_only=False):
        start = time.perf_counter()
        metrics = original(self, microbatches, loss_fn, forward_only)
        seconds.append(time.perf_counter() - start)
        return metrics

    engine_class.step = timed_step
    overrides = [f"train.output_dir={output}", f"backend={backend}"]
    overrides.append(f"deepspeed.zero_stage={stage}")
    train_module.train(load_config(train_module.RewardTrainConfig, config, overrides))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak_mb)
    if dist.get_rank() == 0:
        rate = GLOBAL_BATCH * (len(seconds) - 1) / sum(seconds[1:])
        Path(report).write_text(json.dumps({"pairs_per_s": rate, "peak_mb": max(gathered)}))
    from megatron_rlhf.distributed import destroy

    destroy()


def launch(config: Path, work: Path, backend: str, stage: int) -> dict:
    report = work / f"report_{backend}_{time.monotonic_ns()}.json"
    output = work / f"run_{report.stem}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", __file__, "--one", str(config), str(output)]
    cmd += [backend, str(stage), str(report)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-5000:])
    return json.loads(report.read_text())


def choice_at_7b1(gpus: int = 8) -> list[str]:
    """Per-GPU memory of one AM training step on BLOOMZ-7B1 for each layout of ``gpus`` GPUs.

    Megatron rows come from the planner (megatron_rlhf/planning/memory.py: bf16 weights /TP,
    fp32 grad buffer /TP, fp32 master + Adam /(TP·DP), activations of one 2,048-token pair
    with full recompute). ZeRO rows use the same parameter count and activations (the same
    layers, TP=1) with ZeRO's partitioning: bf16 weights (/N at stage 3), bf16 grads (/N from
    stage 2), fp32 master + Adam 12 B/param /N (host memory with offload).
    """
    from megatron_rlhf.distributed.layouts import Layout
    from megatron_rlhf.planning.memory import Workload, train_memory
    from megatron_rlhf.planning.shapes import model_params, model_shape

    shape = model_shape("bloom-7b1")
    params = model_params(shape, "scalar", 2)
    work = Workload(micro_batch=2, seq_len=2048, num_microbatches=1, recompute=True)
    rows = [f"BLOOMZ-7B1 AM ({params / 1e9:.2f}e9 params), {gpus} GPUs, one 2,048-token pair "
            "per microbatch, full recompute; GB per GPU"]  # fmt: skip
    rows.append(f"{'layout':<34}{'weights':>8}{'grads':>8}{'optim':>8}{'activ.':>8}{'total':>8}")
    single = None
    for tp in (2, 1):
        memory = train_memory(shape, Layout(tp=tp, pp=1, dp=gpus // tp), "scalar", work)
        single = memory if tp == 1 else single
        parts = (memory.weights, memory.grads, memory.optimizer, memory.activations)
        rows.append(_row(f"Megatron TP={tp} DP={gpus // tp} dist. optim", parts))
    for stage, offload in ((1, False), (2, False), (3, False), (3, True)):
        weights = 2 * params / (gpus if stage == 3 else 1)
        grads = 2 * params / (gpus if stage >= 2 else 1)
        optim = 0.0 if offload else 12 * params / gpus
        name = f"DeepSpeed ZeRO-{stage} DP={gpus}" + (" + offload" if offload else "")
        rows.append(_row(name, (weights, grads, optim, single.activations)))
    return rows


def _row(name: str, parts: tuple) -> str:
    cells = "".join(f"{value / 1e9:>8.1f}" for value in (*parts, sum(parts)))
    return f"{name:<34}{cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--only-7b1", action="store_true", help="print the 7B1 table and exit")
    args = parser.parse_args(argv)
    if args.only_7b1:
        print("\n".join(choice_at_7b1()))
        return 0
    if args.one:
        config, output, backend, stage, report = args.one
        one_run(config, output, backend, int(stage), report)
        return 0
    results = {"megatron": [], "deepspeed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            config = make_inputs(Path(tmp) / f"seed{seed}", seed)
            for rep in range(args.reps):
                sides = ("megatron", "deepspeed") if rep % 2 == 0 else ("deepspeed", "megatron")
                for backend in sides:
                    results[backend].append(launch(config, Path(tmp), backend, args.zero_stage))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.reps} reps × seeds {args.seeds}; ZeRO-{args.zero_stage} vs Megatron DDP, 2 ranks")  # fmt: skip
    print(f"{'backend':<22}{'pairs/s min':>12}{'median':>9}{'max':>9}{'peak RSS MB min':>17}"
          f"{'median':>9}{'max':>9}")  # fmt: skip
    medians = {}
    for backend, runs in results.items():
        rates = sorted(r["pairs_per_s"] for r in runs)
        peaks = sorted(r["peak_mb"] for r in runs)
        medians[backend] = (statistics.median(rates), statistics.median(peaks))
        name = backend if backend == "megatron" else f"deepspeed ZeRO-{args.zero_stage}"
        print(f"{name:<22}{rates[0]:>12.2f}{medians[backend][0]:>9.2f}{rates[-1]:>9.2f}"
              f"{peaks[0]:>17.0f}{medians[backend][1]:>9.0f}{peaks[-1]:>9.0f}")  # fmt: skip
    speed = medians["deepspeed"][0] / medians["megatron"][0]
    memory = medians["deepspeed"][1] / medians["megatron"][1]
    print(f"ratio of medians deepspeed/megatron: pairs/s {speed:.2f}, peak RSS {memory:.2f}")
    print("\n".join(choice_at_7b1()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
