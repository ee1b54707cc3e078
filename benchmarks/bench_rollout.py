"""Rollout speed: tokens/s of one greedy rollout (issue 11, items 6 and 7).

    python benchmarks/bench_rollout.py [--reps 3 --seeds 0 1 --threads 2 --skip-pp]

Part 1, one process with ``--threads`` torch threads: our engine (TP1, Megatron-Core static KV
cache) against transformers' ``generate(use_cache=True)`` on the same random BLOOM and the same
left-padded batch (B=8, prompts of 32 down to 4 tokens), greedy, EOS disabled so every row
generates every token, at two sizes (tiny: 4 layers x 128, vocab 1024; base: 12 x 768,
12 heads, vocab 50,000, 124M params) and 32 and 128 new tokens. The two sides alternate inside
every repetition; each seed is a fresh model and prompt batch. Tokens are compared.

Part 2, ``torchrun --nproc-per-node 2`` over gloo (one thread per rank): the base model at
PP=2, B=16, 64 new tokens: the whole batch stage after stage (``pipeline_micro_batches=1``,
one stage always idle), pipelined (2 micro-batches circling the ring), and resharded to
PP=1 x DP=2 by Megatron-Core's refit (``ReshardedEngine``: ``swap_model_weights`` before the
rollout, each replica generates half of the batch, the rows are gathered back); the refit is
timed on its own and included in the resharded row. Tokens of all three are compared.

tokens/s = new tokens of the whole batch / wall seconds; min / median / max over reps x seeds.

Part 1, measured (``--skip-pp --threads 1 --reps 3 --seeds 0 1``; 2-core VM shared with a
2-process study run, load 5-13; min / median / max tok/s, ratio of medians):

    tiny 4x128, 32 new     ours 1844 / 2023 / 2209   transformers 1608 / 1723 / 1845   1.17x
    tiny 4x128, 128 new    ours 1410 / 2086 / 2169   transformers 1539 / 1772 / 1786   1.18x
    base 12x768, 32 new    ours   28 /   34 /   44   transformers   30 /   32 /   38   1.07x
    base 12x768, 128 new   ours   20 /   26 /   40   transformers   24 /   29 /   39   0.90x

Greedy tokens equal in every run. An earlier run at load 20-45 gave 1.12x / 1.16x (tiny) and
0.84x / 1.09x (base): the tiny model's lead holds in both, the 124M rows are level within noise.
Before the lean inference forward the tiny rows were 0.57-0.69x.

Part 2, measured (``--skip-single --reps 3 --seeds 0 1``, idle machine, load 0.5-3.1; tokens of
the three equal; refit 0.75 / 0.82 / 0.88 s):

    PP=2, whole batch stage after stage           73 / 88 / 102 tok/s   1.00x
    PP=2, pipelined (2 micro-batches)              61 / 70 /  76 tok/s   0.80x
    resharded to PP=1 x DP=2 (refit included)      86 / 91 /  97 tok/s   1.04x

On 2 CPU cores over gloo the pipelined ring is slower: half-size micro-batches cost more per
token than the idle stage, and each token makes twice the sends.

Part 3, ``--vllm`` (issue 23): ours vs vLLM (``generation/vllm_engine.py``, weights synced in
memory) vs transformers, sampled at temperature 1 with per-row seeds (PPO's rollout), B x new
tokens, without and with early EOS (``bench_packing.eos_model``: ~40 % of rows end early),
each engine's own tokens counted; greedy tokens of ours and vLLM compared (B=8, the shortest
length). Commands (idle 2-core VM, 2 threads, 3 reps x 2 seeds):

    python benchmarks/bench_rollout.py --vllm --vllm-sizes tiny --new-tokens 32 128 --batches 8 64
    python benchmarks/bench_rollout.py --vllm --vllm-sizes 560m --new-tokens 32 --batches 8 64 --hf-max-batch 8
    python benchmarks/bench_rollout.py --vllm --vllm-sizes 560m --new-tokens 128 --batches 8 --hf-max-batch 0

Measured (tok/s min / median / max; vLLM / ours, ratio of medians, per seed in brackets):

    560m 4x1024, B=8,  32 new, no EOS   ours  41 /  47 /  54   vLLM 118 / 128 / 137   2.70x (2.75, 2.96)   transformers 27 / 31 / 31
    560m 4x1024, B=8,  32 new, EOS      ours  29 /  36 /  45   vLLM 104 / 114 / 129   3.12x (3.32, 3.04)   transformers 20 / 21 / 23
    560m 4x1024, B=64, 32 new, no EOS   ours 104 / 113 / 136   vLLM 198 / 210 / 216   1.86x (1.92, 1.61)
    560m 4x1024, B=64, 32 new, EOS      ours  88 / 100 / 117   vLLM 176 / 193 / 209   1.93x (2.04, 1.82)
    560m 4x1024, B=8, 128 new, no EOS   ours  38 /  43 /  53   vLLM 121 / 124 / 130   2.91x (3.01, 2.85)
    560m 4x1024, B=8, 128 new, EOS      ours  31 /  39 /  44   vLLM  83 / 108 / 110   2.78x (2.76, 2.52)
    tiny 4x128: 0.91x to 1.30x over B 8/64, 32/128 new, with and without EOS (README table)

Greedy rows equal: 16/16 at both sizes. The tiny model is overhead-bound: there the engines tie.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "tiny 4x128": dict(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    "base 12x768": dict(vocab_size=50_000, hidden_size=768, num_layers=12, num_heads=12),
}
PAD, EOS_ID = 3, 2


def left_padded(batch: int, length: int, vocab: int, seed: int):
    """``batch`` random prompts from ``length`` tokens down to ``length - 4 * (batch - 1)``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, length), PAD, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for row in range(batch):
        real = max(1, length - 4 * row)
        ids[row, length - real :] = torch.randint(4, vocab, (real,), generator=generator)
        mask[row, length - real :] = 1
    return ids, mask


def summary(seconds: list[float], tokens: int) -> dict:
    rates = [tokens / s for s in seconds]
    return {"min": min(rates), "median": statistics.median(rates), "max": max(rates)}


def save_model(directory: Path, size: str, seed: int):
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    model = random_hf_bloom(BloomArchitecture(**SIZES[size]), seed=seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def ours_and_hf(ours, hf, ids, mask, new_tokens: int) -> dict:
    """The two greedy rollouts of one batch, each returning its new tokens (B, N)."""
    from megatron_rlhf.generation import SamplingConfig, generate

    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True, eos_id=-1, pad_id=PAD)

    def transformers_generate():
        sequences = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=PAD,
        )
        return sequences[:, ids.shape[1] :]

    return {
        "ours": lambda: generate(ours, ids, mask, sampling).response_ids,
        "hf": transformers_generate,
    }


def part1(args, root: Path) -> list[dict]:
    """Ours vs transformers, interleaved, per size and length."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import initialize

    torch.set_num_threads(args.threads)
    initialize()
    rows = []
    for size in SIZES:
        times = {(side, n): [] for side in ("ours", "hf") for n in args.new_tokens}
        same = True
        for seed in args.seeds:
            hf_dir = root / f"{size.split()[0]}_{seed}"
            hf = save_model(hf_dir, size, seed).eval()
            hf.generation_config.eos_token_id = None
            ours = load_bloom(hf_dir, init_weights=False)
            ids, mask = left_padded(8, 32, SIZES[size]["vocab_size"], seed)
            for n in args.new_tokens:
                sides = ours_and_hf(ours, hf, ids, mask, n)
                for side in sides.values():  # warm-up
                    side()
                for rep in range(args.reps):
                    order = ("ours", "hf") if rep % 2 == 0 else ("hf", "ours")
                    tokens = {}
                    for side in order:
                        start = time.perf_counter()
                        with torch.no_grad():
                            tokens[side] = sides[side]()
                        times[(side, n)].append(time.perf_counter() - start)
                    same &= torch.equal(tokens["ours"], tokens["hf"])
        for n in args.new_tokens:
            ours_s, hf_s = summary(times[("ours", n)], 8 * n), summary(times[("hf", n)], 8 * n)
            rows.append({"size": size, "new": n, "ours": ours_s, "hf": hf_s, "same": same})
            print(f"{size} {n} new: ours {ours_s} hf {hf_s}", flush=True)
    return rows


def part2(args, root: Path) -> dict:
    """Launch the PP=2 worker under torchrun; return its JSON."""
    hf_dir = root / "pp_base"
    save_model(hf_dir, "base 12x768", 0)
    out = root / "pp.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [__file__, "--pp-worker", "--hf", str(hf_dir), "--out", str(out)]
    cmd += ["--reps", str(args.reps), "--seeds", *map(str, args.seeds)]
    cmd += ["--pp-new-tokens", str(args.pp_new_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"PP worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def pp_worker(args) -> None:
    """Rank 0 writes tokens/s of the three PP=2 rollouts (and the refit's seconds) as JSON."""
    import torch.distributed as dist

    from megatron_rlhf.checkpoint import checkpoint_architecture, load_bloom
    from megatron_rlhf.distributed import initialize_layouts
    from megatron_rlhf.distributed.groups import seed_layout
    from megatron_rlhf.distributed.handoff import dp_rows, gather_rows
    from megatron_rlhf.distributed.layouts import Layout
    from megatron_rlhf.generation import SamplingConfig, generate
    from megatron_rlhf.generation.rollout_engines import build_rollout_engine
    from megatron_rlhf.models.bloom import BloomModel

    torch.set_num_threads(1)
    groups = initialize_layouts(
        {"actor": Layout(tp=1, pp=2, dp=1), "rollout": Layout(tp=1, pp=1, dp=2)}
    )
    seed_layout(groups["actor"], 1234)
    actor = load_bloom(args.hf, init_weights=False, pg_collection=groups["actor"].pg_collection)
    arch = checkpoint_architecture(args.hf)
    engine = build_rollout_engine(
        actor,
        groups["actor"],
        groups["rollout"],
        lambda rollout: BloomModel(arch, init_weights=False, pg_collection=rollout.pg_collection),
    )
    batch, new = 16, args.pp_new_tokens
    sampling = SamplingConfig(max_new_tokens=new, greedy=True, eos_id=-1, pad_id=PAD)

    def on_actor(parts):
        plan = replace(sampling, pipeline_micro_batches=parts)
        return generate(actor, ids, mask, plan).response_ids

    def resharded():
        engine.refresh()
        refit_done.append(time.perf_counter())
        dp = engine.groups.dp
        rows = dp_rows(batch, dp.size(), dp.rank())
        out = engine.generate(ids[rows], mask[rows], sampling)
        return gather_rows(out.response_ids, dp, PAD)

    sides = {
        "PP=2, whole batch stage after stage": lambda: on_actor(1),
        "PP=2, pipelined (2 micro-batches)": lambda: on_actor(2),
        "resharded to PP=1 x DP=2 (refit included)": resharded,
    }
    times = {name: [] for name in sides}
    refit, same = [], True
    for seed in args.seeds:
        ids, mask = left_padded(batch, 32, arch.vocab_size, seed)
        refit_done: list[float] = []
        for side in sides.values():  # warm-up (builds and caches the reshard plan)
            side()
        for rep in range(args.reps):
            names = list(sides) if rep % 2 == 0 else list(reversed(sides))
            tokens = {}
            for name in names:
                dist.barrier()
                refit_done.clear()
                start = time.perf_counter()
                tokens[name] = sides[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                if refit_done:
                    refit.append(refit_done[0] - start)
            reference = tokens[names[0]]
            same &= all(torch.equal(t, reference) for t in tokens.values())
    if dist.get_rank() == 0:
        result = {name: summary(s, batch * new) for name, s in times.items()}
        result["refit_seconds"] = {
            "min": min(refit),
            "median": statistics.median(refit),
            "max": max(refit),
        }
        result["same"] = same
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


VLLM_SIZES = {
    "tiny 4x128": dict(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    # BLOOM-560m's width, heads and vocabulary, 4 of its 24 layers (as bench_ppo_real_shapes)
    "560m 4x1024": dict(vocab_size=250_880, hidden_size=1024, num_layers=4, num_heads=16),
}


def part_vllm(args, root: Path) -> list[dict]:
    """Ours vs vLLM vs transformers: sampled rollouts (temperature 1, per-row seeds, as PPO
    samples), B x new tokens, without and with early EOS (a model that ends
    ``--early-fraction`` of its rows before the last token); the engines alternate inside every
    repetition; tokens/s counts each engine's own generated tokens. Greedy tokens of ours and
    vLLM are compared once per seed (B=8, 32 new, no EOS)."""
    from bench_packing import eos_model, stop_probability

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.generation import SamplingConfig, generate
    from megatron_rlhf.generation.vllm_engine import VLLMGenerator
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    torch.set_num_threads(args.threads)
    rows = []
    for size in args.vllm_sizes:
        name = next(n for n in VLLM_SIZES if n.startswith(size))
        arch = BloomArchitecture(**VLLM_SIZES[name])
        initialize()
        # one engine per size; each seed's model reaches it through the in-memory sync
        generator = VLLMGenerator(
            arch, max_model_len=32 + max(args.new_tokens), max_rows=max(args.batches), seed=0
        )
        for new in args.new_tokens:
            configs = [(b, eos) for b in args.batches for eos in (False, True)]
            times = {(b, eos, e): [] for b, eos in configs for e in ("ours", "vllm", "hf")}
            tokens = {key: [] for key in times}
            greedy_same, greedy_rows, startup, sync = 0, 0, [], []
            for seed in args.seeds:
                hf_dir = root / f"vllm_{size}_{new}_{seed}"
                packing_size = "tiny" if size == "tiny" else "real"  # the same shapes there
                eos_model(hf_dir, packing_size, seed, stop_probability(args.early_fraction, new))
                ours = load_bloom(hf_dir, init_weights=False).eval()
                hf = _hf_model(hf_dir)
                startup.append(generator.startup_s)
                sync.append(generator.load_weights(hf_tensor_stream(ours)))
                if new == min(args.new_tokens):
                    ids, mask = left_padded(8, 32, arch.vocab_size, seed)
                    greedy = SamplingConfig(max_new_tokens=new, greedy=True, eos_id=-1, pad_id=PAD)
                    a = generate(ours, ids, mask, greedy).response_ids
                    b = generator.generate(ids, mask, greedy).response_ids
                    greedy_same += sum(torch.equal(x, y) for x, y in zip(a, b))
                    greedy_rows += a.shape[0]
                for batch, eos in configs:
                    ids, mask = left_padded(batch, 32, arch.vocab_size, seed)
                    sampling = SamplingConfig(
                        max_new_tokens=new, eos_id=EOS_ID if eos else -1, pad_id=PAD,
                        row_seeds=tuple(seed * 1000 + r for r in range(batch)),
                    )  # fmt: skip
                    with_hf = batch <= args.hf_max_batch
                    sides = _sides(ours, generator, hf if with_hf else None, ids, mask, sampling)
                    for side in sides.values():  # warm-up
                        side()
                    for rep in range(args.reps):
                        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                        for engine in order:
                            start = time.perf_counter()
                            with torch.no_grad():
                                out = sides[engine]()
                            times[(batch, eos, engine)].append(time.perf_counter() - start)
                            tokens[(batch, eos, engine)].append(int(out.response_mask.sum()))
            for batch, eos in configs:
                row = {"size": name, "new": new, "batch": batch, "eos": eos}
                for engine in ("ours", "vllm", "hf"):
                    seconds = times[(batch, eos, engine)]
                    if seconds:
                        rates = [t / s for t, s in zip(tokens[(batch, eos, engine)], seconds)]
                        row[engine] = {"min": min(rates), "median": statistics.median(rates),
                                       "max": max(rates)}  # fmt: skip
                        row[engine + "_per_seed"] = _per_seed_medians(rates, len(args.seeds))
                row["mean_length"] = statistics.mean(tokens[(batch, eos, "ours")]) / batch
                row["greedy"] = f"{greedy_same}/{greedy_rows}" if greedy_rows else "-"
                row["startup_s"], row["sync_s"] = (
                    statistics.median(startup),
                    statistics.median(sync),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
        generator.close()  # vLLM's teardown also ends torch.distributed
        destroy()
    return rows


def _sides(ours, generator, hf, ids, mask, sampling) -> dict:
    """The engines' rollouts of one batch (transformers' only when ``hf`` is given)."""
    from megatron_rlhf.generation import generate

    sides = {
        "ours": lambda: generate(ours, ids, mask, sampling),
        "vllm": lambda: generator.generate(ids, mask, sampling),
    }
    if hf is not None:
        sides["hf"] = lambda: _hf_sample(hf, ids, mask, sampling)
    return sides


def _per_seed_medians(rates: list[float], seeds: int) -> list[float]:
    per = len(rates) // seeds
    return [statistics.median(rates[i * per : (i + 1) * per]) for i in range(seeds)]


def _hf_model(directory: Path):
    from transformers import BloomForCausalLM

    model = BloomForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_sample(hf, ids, mask, sampling):
    """transformers' sampling with its own RNG (one seed per call), EOS as ours; returns an
    object with ``response_mask`` (its generated tokens: up to and including EOS)."""
    from types import SimpleNamespace

    torch.manual_seed(sampling.row_seeds[0])
    sequences = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, temperature=1.0,
        max_new_tokens=sampling.max_new_tokens, pad_token_id=PAD,
        eos_token_id=sampling.eos_id if sampling.eos_id >= 0 else None,
    )[:, ids.shape[1] :]  # fmt: skip
    if sampling.eos_id < 0:
        return SimpleNamespace(response_mask=torch.ones_like(sequences))
    ended = (sequences == sampling.eos_id).long().cumsum(1)
    return SimpleNamespace(
        response_mask=((ended - (sequences == sampling.eos_id).long()) == 0).long()
    )


def vllm_table(rows, args) -> str:
    def fmt(s):
        return f"{s['min']:.0f} / {s['median']:.0f} / {s['max']:.0f}" if s else "-"

    lines = [
        f"sampled, temperature 1, per-row seeds; {args.threads} threads; reps {args.reps} x seeds "
        f"{args.seeds}; early EOS: {100 * args.early_fraction:.0f} % of rows end before the last "
        "token (a model with a fixed per-step EOS probability)",
        "",
        "| model | B | new | early EOS | mean length | ours tok/s | vLLM tok/s | transformers tok/s "
        "| vLLM / ours (per seed) | greedy rows equal | vLLM start-up s | sync s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        ratio = r["vllm"]["median"] / r["ours"]["median"]
        seeds = ", ".join(f"{v / o:.2f}" for v, o in zip(r["vllm_per_seed"], r["ours_per_seed"]))
        lines.append(
            f"| {r['size']} | {r['batch']} | {r['new']} | {'yes' if r['eos'] else 'no'} "
            f"| {r['mean_length']:.1f} | {fmt(r['ours'])} | {fmt(r['vllm'])} | {fmt(r.get('hf'))} "
            f"| {ratio:.2f}x ({seeds}) | {r['greedy']} | {r['startup_s']:.1f} | {r['sync_s']:.2f} |"
        )
    return "\n".join(lines)


def table(part1_rows, pp, args) -> str:
    def fmt(s):
        return f"{s['min']:.0f} / {s['median']:.0f} / {s['max']:.0f}"

    lines = [
        f"reps {args.reps} x seeds {args.seeds}; load average before / after: "
        f"{args.load_before} / {os.getloadavg()[0]:.1f}",
        "",
        f"| model, B=8, greedy ({args.threads} threads) | new tokens | ours tok/s min / med / max "
        "| transformers tok/s min / med / max | ours / transformers (medians) | tokens equal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in part1_rows:
        ratio = r["ours"]["median"] / r["hf"]["median"]
        lines.append(
            f"| {r['size']} | {r['new']} | {fmt(r['ours'])} | {fmt(r['hf'])} | {ratio:.2f}x "
            f"| {r['same']} |"
        )
    if pp:
        base = pp["PP=2, whole batch stage after stage"]["median"]
        lines += [
            "",
            f"| base 12x768 on 2 gloo ranks, B=16, {args.pp_new_tokens} new | tok/s min / med / max "
            "| vs stage after stage (medians) |",
            "|---|---:|---:|",
        ]
        for name, s in pp.items():
            if name in ("refit_seconds", "same"):
                continue
            lines.append(f"| {name} | {fmt(s)} | {s['median'] / base:.2f}x |")
        refit = pp["refit_seconds"]
        lines += [
            "",
            f"refit (swap_model_weights PP=2 -> PP=1 x DP=2) seconds min / med / max: "
            f"{refit['min']:.3f} / {refit['median']:.3f} / {refit['max']:.3f}; "
            f"tokens of the three equal: {pp['same']}",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--pp-new-tokens", type=int, default=64, help="new tokens in part 2")
    parser.add_argument("--skip-pp", action="store_true", help="only part 1")
    parser.add_argument("--skip-single", action="store_true", help="only part 2")
    parser.add_argument(
        "--vllm", action="store_true", help="only part 3: ours vs vLLM vs transformers"
    )
    parser.add_argument("--vllm-sizes", nargs="+", default=["tiny", "560m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--early-fraction", type=float, default=0.4)
    parser.add_argument(
        "--hf-max-batch", type=int, default=64, help="transformers only up to this batch"
    )
    parser.add_argument("--pp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pp_worker:
        pp_worker(args)
        return 0
    args.load_before = f"{os.getloadavg()[0]:.1f}"
    if args.vllm:
        with tempfile.TemporaryDirectory() as tmp:
            rows = part_vllm(args, Path(tmp))
        print()
        print(vllm_table(rows, args))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = [] if args.skip_single else part1(args, Path(tmp))
        pp = None if args.skip_pp else part2(args, Path(tmp))
    print()
    print(table(rows, pp, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
