"""Step throughput of asynchronous PPO: synchronous vs staleness 1, colocated vs disaggregated.

    PYTHONPATH=. python benchmarks/bench_async_overlap.py [--worlds 2 4] [--seeds 1 2]
        [--reps 3] [--steps 6] [--skip 2] [--cpus 0,1] [--records runs.jsonl]
    PYTHONPATH=. python benchmarks/bench_async_overlap.py --report runs.jsonl

Four arms, each a ``torchrun --nproc-per-node W`` launch of ``train-ppo`` on the tests'
known-reward task (``tests/ppo_fixtures.make_ppo_setup``) for ``--steps`` steps: colocated
synchronous (the baseline), colocated ``async.max_staleness=1``, and
``placement.mode=disaggregated`` with ``placement.rollout_ranks=W/2`` (W=2: one rollout rank and
one training rank; W=4: two and two) at staleness 0 and 1. The arms are interleaved
(A B C D, A B C D, ...) over ``--reps`` repetitions x ``--seeds`` (``train.seed``) at each world
size, so a drift of the machine's load hits every arm alike.

A launch's seconds per step are the median of ``time/step_s`` (metrics.jsonl: the training
ranks' weight sync + wait for the batch + score + advantages + update) over its steps after the
first ``--skip`` (the first ones include warm-up and, at staleness 1, the generation of two
batches); the interval between the arrivals of consecutive metrics.jsonl lines (polled every
20 ms, so the logging, guard and end-of-step collectives are in it) is printed beside it as a
check, and so is the launch's wall clock (start-up included). Per arm: min / median / max of
the launches' seconds per step, the ratio of its median to the colocated synchronous arm's at
the same world size, that ratio per seed, and whether every seed puts it on the same side of 1
(only that is claimed). For the disaggregated arms: the rollout ranks' seconds generating the
batch (``rollout/generate_s``) against the training ranks' wait for it (``time/rollout_s``):
the share of generation hidden behind the update is 1 - wait / generate.

The config is generation-heavy: 128 new tokens (EOS is sampled at random, so a batch decodes
until its longest response: ~128 sequential steps), 32 prompts a step (the fixture's: 16), one
PPO epoch of one minibatch in micro-batches of 8, and the actor's lr at 1e-4 so that the
responses keep the random model's length from step to step (at the fixture's 2e-2 they fell
from ~60 to ~20 tokens within 4 steps at width 128). The model is the fixture's, 2 layers x 32
(vocab 64), not wider: in a one-rank probe (colocated sync, one shared core) generation took
0.46 of the step at width 32, 0.35 at 64 and 0.32 at 128. Decoding is 128 sequential forwards
of a few rows, bound on a CPU by the cost of each op, while score and update take every token
at once, so width adds more to the update than to generation (``--hidden`` to try).

On 2 cores: at W=2 each rank can have a core, so the rollout rank can generate while the
training rank updates. At W=4 the four ranks share the two cores: whatever one side overlaps
it takes from the other's core time, so the overlap cannot buy time there (measured anyway).

Latest run (2-core CPU VM, idle apart from this, load < 2 at W=2; torch 2.13.0+cpu; defaults,
``--steps 8 --skip 2``): W=2 seeds 1 2 3 x 3 reps, W=4 seeds 1 2 x 3 reps, 60 launches, 14 min
wall (a W=2 launch ~10 s, a W=4 one ~18 s, start-up included):

| W | arm | s/step min / med / max | vs colocated sync | per seed | every seed | line arrivals, med | launch wall, med | n |
|---|---|---|---:|---|---|---:|---:|---:|
| 2 | colocated, sync | 0.24 / 0.29 / 0.41 | 1.00x | 1.00 1.00 1.00 | — | 0.29 | 11.0 | 9 |
| 2 | colocated, N=1 | 0.27 / 0.30 / 0.44 | 1.02x | 0.86 0.93 1.11 | mixed | 0.31 | 11.3 | 9 |
| 2 | disaggregated, sync | 0.29 / 0.36 / 0.46 | 1.23x | 1.04 1.10 1.21 | slower | 0.36 | 11.0 | 9 |
| 2 | disaggregated, N=1 | 0.21 / 0.25 / 0.32 | 0.84x | 0.74 0.61 0.91 | faster | 0.25 | 9.7 | 9 |
| 4 | colocated, sync | 0.40 / 0.46 / 0.53 | 1.00x | 1.00 1.00 | — | 0.48 | 18.9 | 6 |
| 4 | colocated, N=1 | 0.44 / 0.46 / 0.66 | 0.99x | 1.52 0.89 | mixed | 0.46 | 18.8 | 6 |
| 4 | disaggregated, sync | 0.26 / 0.34 / 0.43 | 0.73x | 0.81 0.69 | faster | 0.35 | 17.7 | 6 |
| 4 | disaggregated, N=1 | 0.26 / 0.30 / 0.35 | 0.65x | 0.75 0.58 | faster | 0.30 | 17.5 | 6 |

The training ranks' step by stage (time/<stage>_s, median over a launch's measured steps, then over launches; colocated ranks log no weight sync)

| W | arm | weight_sync | rollout | score | update |
|---|---|---:|---:|---:|---:|
| 2 | colocated, sync | 0.000 | 0.152 | 0.041 | 0.104 |
| 2 | colocated, N=1 | 0.000 | 0.125 | 0.069 | 0.114 |
| 2 | disaggregated, sync | 0.001 | 0.137 | 0.064 | 0.154 |
| 2 | disaggregated, N=1 | 0.001 | 0.003 | 0.092 | 0.149 |
| 4 | colocated, sync | 0.000 | 0.256 | 0.061 | 0.140 |
| 4 | colocated, N=1 | 0.000 | 0.240 | 0.096 | 0.122 |
| 4 | disaggregated, sync | 0.002 | 0.163 | 0.051 | 0.121 |
| 4 | disaggregated, N=1 | 0.002 | 0.018 | 0.128 | 0.115 |

Generation hidden behind the update (sums over a launch's measured steps; min / med / max over launches)

| W | arm | generate s | training ranks' wait s | hidden share |
|---|---|---|---|---|
| 2 | disaggregated, sync | 0.64 / 0.80 / 1.10 | 0.66 / 0.82 / 1.12 | -0.03 / -0.02 / -0.02 |
| 2 | disaggregated, N=1 | 0.72 / 0.84 / 1.18 | 0.01 / 0.02 / 0.03 | 0.97 / 0.98 / 0.99 |
| 4 | disaggregated, sync | 0.75 / 1.02 / 1.34 | 0.78 / 1.02 / 1.37 | -0.04 / -0.03 / 0.03 |
| 4 | disaggregated, N=1 | 1.11 / 1.55 / 1.68 | 0.04 / 0.22 / 0.36 | 0.68 / 0.87 / 0.97 |

At W=2 the disaggregated staleness-1 step is faster than the colocated synchronous one on every
seed (0.84x of the medians; 0.61-0.91 per seed; the ranges overlap): the rollout rank's
generation (~0.14 s a step) is 97-99% hidden and the step is the training rank's score +
update, which on one rank (32 rows) costs more than on two (16 each). The disaggregated
synchronous step is slower on every seed (1.23x): the sides take turns and one rank trains.
Colocated staleness 1 is no faster (mixed: 0.86-1.11); its score stage is longer, since at
N >= 1 pi_old is recomputed by an actor forward instead of taken from the rollout. At W=4 both
disaggregated arms are faster than colocated sync on both seeds, but not through overlap:
staleness 1 and 0 are level within noise, and generation, sharing the cores with the update,
takes 1.5x as long and is 68-97% hidden. Colocated, each of the 4 ranks runs all 128 decode
steps (and every stage's per-op cost) over 8 rows; disaggregated only 2 ranks decode, which on
2 cores is likely most of the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ARMS = {
    "colocated, sync": [],
    "colocated, N=1": ["async.max_staleness=1"],
    "disaggregated, sync": ["placement.mode=disaggregated"],
    "disaggregated, N=1": ["placement.mode=disaggregated", "async.max_staleness=1"],
}
BASELINE = "colocated, sync"
STAGES = ("weight_sync", "rollout", "score", "update")
"""The logged ``time/<stage>_s`` shown per arm (advantages: ~1 ms)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--reps-by-world", default="", help="e.g. 4:2 (fewer reps at W=4)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="the actor's (responses' length)")
    parser.add_argument("--cpus", default="", help="taskset -c list for every launch")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a launch may take")
    parser.add_argument("--records", type=Path, help="append each launch's record (JSON lines)")
    parser.add_argument("--report", type=Path, help="print the tables of a records file only")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # to the launch's finally
    if args.report is not None:
        records = [json.loads(line) for line in args.report.read_text().splitlines()]
        print_report(records)
        return
    reps = {world: args.reps for world in args.worlds}
    reps |= {int(w): int(r) for w, r in (item.split(":") for item in args.reps_by_world.split())}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        config = make_setup(Path(tmp), args)
        for world in args.worlds:
            for rep in range(reps[world]):
                for seed in args.seeds:
                    for arm in ARMS:
                        output_dir = Path(tmp) / f"w{world}_r{rep}_s{seed}_{len(records)}"
                        record = launch(config, world, arm, seed, output_dir, args)
                        record |= {"rep": rep, "skip": args.skip}
                        records.append(record)
                        print(summary_line(record), flush=True)
                        if args.records is not None:
                            with open(args.records, "a", encoding="utf-8") as handle:
                                handle.write(json.dumps(record) + "\n")
    print_report(records)


def make_setup(root: Path, args) -> Path:
    """The fixture's task with a wider model, written under ``root``; its config's path."""
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from ppo_fixtures import make_ppo_setup

    setup = make_ppo_setup(root / "setup", hidden_size=args.hidden, num_heads=4)
    config = yaml.safe_load(setup["config"].read_text())
    config["rollout"] |= {"prompts_per_step": args.prompts, "max_new_tokens": args.max_new_tokens}
    config["ppo"] |= {"epochs": args.epochs, "num_minibatches": 1}
    config["actor_optim"]["lr"] = args.lr
    config["train"] |= {
        "micro_batch_size": args.micro_batch,
        "save_interval": 10_000,
        "sample_interval": 10_000,
    }
    path = root / "overlap.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, world: int, arm: str, seed: int, output_dir: Path, args) -> dict:
    """One torchrun launch of train-ppo; its per-step metrics and line arrival times."""
    overrides = list(ARMS[arm])
    if "placement.mode=disaggregated" in overrides:
        overrides.append(f"placement.rollout_ranks={world // 2}")
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
        "--standalone", "-m", "megatron_rlhf", "train-ppo", "--config", str(config),
        f"train.output_dir={output_dir}", f"train.seed={seed}", f"train.steps={args.steps}",
        *overrides,
    ]  # fmt: skip
    if args.cpus:
        command = ["taskset", "-c", args.cpus, *command]
    repo = Path(__file__).resolve().parent.parent
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]),
    }
    metrics_file, arrivals = output_dir / "metrics.jsonl", []
    log = output_dir.with_suffix(".log")
    start = time.time()
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while process.poll() is None and time.time() - start < args.timeout:
                lines = count_lines(metrics_file)
                arrivals += [time.time()] * (lines - len(arrivals))
                time.sleep(0.02)
        finally:  # past the timeout, or this script stopped (SIGTERM, Ctrl-C): no orphans
            if process.poll() is None:
                kill_tree(process)
    wall = time.time() - start
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if (
        metrics_file.exists()
    ) else []  # fmt: skip
    record = {"world": world, "arm": arm, "seed": seed, "rc": process.returncode, "wall_s": wall}
    record["steps"] = [
        {k: v for k, v in s.items() if k in ("step", "rollout/generate_s") or k.startswith("time/")}
        for s in steps
    ]
    record["arrivals"] = arrivals[: len(steps)]
    if process.returncode != 0 or len(steps) != args.steps:
        record["log_tail"] = log.read_text()[-2000:]
    return record


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers (torchrun puts each worker in its own session, and
    a worker blocked in a collective does not act on SIGTERM)."""
    import psutil

    launcher = psutil.Process(process.pid)
    for child in [*launcher.children(recursive=True), launcher]:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def per_launch(record: dict) -> dict | None:
    """A launch's medians over its steps after the skipped ones (None if it failed)."""
    steps, skip = record["steps"], record["skip"]
    if record["rc"] != 0 or len(steps) <= skip:
        return None
    kept = steps[skip:]
    arrivals = record["arrivals"]
    gaps = [b - a for a, b in zip(arrivals[skip - 1 :], arrivals[skip:])] if skip else []
    figures = {"step_s": median(s["time/step_s"] for s in kept), "wall_s": record["wall_s"]}
    figures["stages"] = {
        stage: median(s.get(f"time/{stage}_s", 0.0) for s in kept) for stage in STAGES
    }
    figures["arrival_s"] = median(gaps) if gaps else float("nan")
    if "rollout/generate_s" in kept[0]:
        figures["generate_s"] = sum(s["rollout/generate_s"] for s in kept)
        figures["wait_s"] = sum(s["time/rollout_s"] for s in kept)
    return figures


def summary_line(record: dict) -> str:
    figures = per_launch(record)
    head = f"W={record['world']} seed {record['seed']} rep {record['rep']} {record['arm']}:"
    if figures is None:
        return f"{head} FAILED rc={record['rc']}\n{record.get('log_tail', '')}"
    line = f"{head} {figures['step_s']:.3f} s/step (arrivals {figures['arrival_s']:.3f})"
    if "generate_s" in figures:
        line += f", generate {figures['generate_s']:.2f} s, wait {figures['wait_s']:.2f} s"
    return line + f", launch {figures['wall_s']:.1f} s"


def spread(values: list[float], digits: int = 2) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), median(values), max(values)))


def print_report(records: list[dict]) -> None:
    for record in records:
        if per_launch(record) is None:
            print(f"failed: W={record['world']} seed {record['seed']} {record['arm']}")
    launches = [(r, f) for r in records if (f := per_launch(r)) is not None]
    print(
        "| W | arm | s/step min / med / max | vs colocated sync | per seed | every seed "
        "| line arrivals, med | launch wall, med | n |\n|---|---|---|---:|---|---|---:|---:|---:|"
    )
    stage_rows, hidden_rows = [], []
    for world in sorted({r["world"] for r, _ in launches}):
        seeds = sorted({r["seed"] for r, _ in launches if r["world"] == world})

        def steps(arm: str, seeds: list[int] = seeds, world: int = world) -> list[float]:
            return [
                f["step_s"] for r, f in launches
                if r["world"] == world and r["arm"] == arm and r["seed"] in seeds
            ]  # fmt: skip

        for arm in ARMS:
            mine = [f for r, f in launches if r["world"] == world and r["arm"] == arm]
            if not mine:
                continue
            step = [f["step_s"] for f in mine]
            ratio = median(step) / median(steps(BASELINE)) if steps(BASELINE) else math.nan
            per_seed = [
                median(steps(arm, [seed])) / median(steps(BASELINE, [seed]))
                for seed in seeds
                if steps(arm, [seed]) and steps(BASELINE, [seed])
            ]
            verdict = (
                "—" if arm == BASELINE
                else "faster" if all(p < 1 for p in per_seed)
                else "slower" if all(p > 1 for p in per_seed)
                else "mixed"
            )  # fmt: skip
            print(
                f"| {world} | {arm} | {spread(step)} | {ratio:.2f}x "
                f"| {' '.join(f'{p:.2f}' for p in per_seed)} | {verdict} "
                f"| {median(f['arrival_s'] for f in mine):.2f} "
                f"| {median(f['wall_s'] for f in mine):.1f} | {len(step)} |"
            )
            stages = [median(f["stages"][stage] for f in mine) for stage in STAGES]
            stage_rows.append(f"| {world} | {arm} | {' | '.join(f'{v:.3f}' for v in stages)} |")
            if "generate_s" in mine[0]:
                generate, wait = [f["generate_s"] for f in mine], [f["wait_s"] for f in mine]
                hidden = [1 - w / g for w, g in zip(wait, generate)]
                hidden_rows.append(
                    f"| {world} | {arm} | {spread(generate)} | {spread(wait)} | {spread(hidden)} |"
                )
    print(
        "\nThe training ranks' step by stage (time/<stage>_s, median over a launch's measured "
        "steps, then over launches; colocated ranks log no weight sync)\n\n"
        f"| W | arm | {' | '.join(STAGES)} |\n|---|---|{'---:|' * len(STAGES)}"
    )
    print("\n".join(stage_rows))
    if hidden_rows:
        print(
            "\nGeneration hidden behind the update (sums over a launch's measured steps; "
            "min / med / max over launches)\n\n| W | arm | generate s | training ranks' wait s "
            "| hidden share |\n|---|---|---|---|---|"
        )
        print("\n".join(hidden_rows))


if __name__ == "__main__":
    main()
