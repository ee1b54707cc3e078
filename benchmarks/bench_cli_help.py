"""How long ``--help`` takes for every command and tool, before and after a change.

    python benchmarks/bench_cli_help.py [--reps 3] [--baseline OLD_CHECKOUT]

Each command's ``--help`` runs in a fresh interpreter (``python -m megatron_rlhf CMD --help``,
``python tools/X.py --help``) with this checkout on ``PYTHONPATH``, and, with ``--baseline``,
the same in another checkout (e.g. ``git archive 7cb57b3 | tar -x -C /tmp/old``), the two
interleaved, ``--reps`` times each. Reported: wall and CPU seconds (user + sys of the child,
which other jobs on a shared machine disturb far less than wall time) and peak RSS, median of
the reps (min-max of the wall in brackets).

Latest run (2-core CPU shared with 7 other jobs at load average 20-30, so wall times are
inflated many times over and noisy; CPU seconds and RSS are the figures to compare), 1 rep
(the machine's shared job queue was saturated), baseline = main at 7cb57b3 (before issue 10;
it had no train-sft), after = this change. torch + megatron-core cost ~8-10 CPU s and 440 MB
before argparse ran; now nothing heavy loads for ``--help``:

| command | before wall s | before CPU s | before RSS MB | after wall s | after CPU s | after RSS MB |
|---|---:|---:|---:|---:|---:|---:|
| demo | 0.21 | 0.07 | 15 | 0.28 | 0.09 | 16 |
| generate | 40.55 | 8.87 | 436 | 0.23 | 0.09 | 16 |
| train-sft | (none) | | | 0.32 | 0.13 | 18 |
| train-reward | 40.77 | 8.31 | 436 | 0.21 | 0.12 | 19 |
| score | 7.07 | 2.66 | 219 | 0.32 | 0.11 | 17 |
| eval-reward | 13.23 | 2.82 | 219 | 2.81 | 0.11 | 16 |
| train-ppo | 47.91 | 10.01 | 439 | 1.22 | 0.14 | 19 |
| eval-policy | 41.66 | 8.89 | 437 | 1.26 | 0.15 | 18 |
| tools/preprocess_data.py | 12.37 | 2.86 | 220 | 0.70 | 0.23 | 28 |
| tools/build_rehearsal_clusters.py | 16.47 | 2.75 | 220 | 1.01 | 0.22 | 33 |
| tools/convert_checkpoint.py | 44.54 | 8.45 | 439 | 0.22 | 0.07 | 15 |
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["demo", "generate", "train-sft", "train-reward", "score", "eval-reward",
            "train-ppo", "eval-policy"]  # fmt: skip
TOOLS = ["tools/preprocess_data.py", "tools/build_rehearsal_clusters.py",
         "tools/convert_checkpoint.py"]  # fmt: skip


def run_once(checkout: Path, target: str) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of one ``--help`` in a fresh interpreter (``os.wait4``
    gives that child's own resource usage)."""
    argv = [sys.executable, str(checkout / target)] if target.startswith("tools/") else [
        sys.executable, "-m", "megatron_rlhf", target]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout), "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen([*argv, "--help"], cwd=checkout, env=env, stdout=out,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        ok = proc.returncode == 0 and b"usage:" in out.read()
    if not ok:
        return float("nan"), float("nan"), float("nan")  # e.g. a command the baseline lacks
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # ru_maxrss in KB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    checkouts = ([args.baseline] if args.baseline else []) + [REPO]
    samples = {(c, t): [] for c in checkouts for t in COMMANDS + TOOLS}
    for _ in range(args.reps):
        for target in COMMANDS + TOOLS:
            for checkout in checkouts:  # interleaved: both sides see the same machine load
                samples[(checkout, target)].append(run_once(checkout, target))
    print("| command | " + " | ".join(
        f"{'before' if c != REPO else 'after'} wall s [min-max] | CPU s | RSS MB" for c in checkouts
    ) + " |")  # fmt: skip
    print("|---|" + "---:|---:|---:|" * len(checkouts))
    for target in COMMANDS + TOOLS:
        cells = []
        for checkout in checkouts:
            walls, cpus, rss = zip(*samples[(checkout, target)])
            cells += [
                f"{statistics.median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}]",
                f"{statistics.median(cpus):.2f}",
                f"{statistics.median(rss):.0f}",
            ]
        print(f"| {target} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
