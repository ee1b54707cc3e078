"""Learning under bounded staleness (``async.*``) on the tests' known-reward task.

    PYTHONPATH=. python benchmarks/bench_async_staleness.py [--seeds 1 2 3] [--steps 12]
        [--arms gae "no correction"]

The task of ``tests/test_ppo_training.py`` (a random tiny BLOOM; reward = share of response
tokens equal to token 7, ~0.02 at the start) trained in this process for ``--steps`` steps
per arm and seed: synchronous, and staleness 1 and 2 without correction (``async.is_cap=0``,
GAE), with the policy term's importance weight (``is_cap=2``, GAE) and with it and V-trace
targets (``value_targets=vtrace``); ``--arms``: sync and the arms whose name holds one of
the words. Printed: each arm's mean reward over its last three steps, per seed and averaged
(the logged reward is that of the rollout trained at the step, so a stale arm's lags the actor
by its staleness), then with three seeds or more the learning gate of tests/test_ppo_async.py
over every three-seed set: the arm's gain over the start as a share of the synchronous one's.

Latest run (2-core CPU, one core, shared; torch 2.13.0+cpu), 12 steps, seeds 1 2 3: 6 min
wall for the 21 runs (~6 s a run when the core is free), 650 MB peak RSS. The same seeds give
the same figures (every run is deterministic):

| arm | last-three reward, mean | per seed |
|---|---:|---|
| sync | 0.623 | 0.648 0.424 0.797 |
| staleness 1, no correction | 0.549 | 0.319 0.724 0.603 |
| staleness 1, is_cap=2, gae | 0.541 | 0.251 0.674 0.698 |
| staleness 1, is_cap=2, vtrace | 0.204 | 0.250 0.321 0.042 |
| staleness 2, no correction | 0.260 | 0.239 0.418 0.122 |
| staleness 2, is_cap=2, gae | 0.544 | 0.393 0.529 0.711 |
| staleness 2, is_cap=2, vtrace | 0.072 | 0.096 0.104 0.016 |

The two vtrace rows (and the V-trace figures below) were measured when
``async.value_targets=vtrace`` also set the actor's advantages to V-trace's. It now sets only
the critic's targets (9f10e75; the advantages stay GAE), which is the combination the last
paragraph measured apart (0.487 / 0.350); the table has not been rerun since.

Seeds 1-16, ``--arms gae "no correction"`` (80 runs), mean (least-most per seed): sync 0.721
(0.344-0.961); staleness 1 0.617 with is_cap=2 (0.057-0.876), 0.527 without (0.141-0.794);
staleness 2 0.430 with (0.049-0.831), 0.276 without (0.023-0.604). The gate's share reached
1/3 in 559 / 512 of the 560 three-seed sets with is_cap=2 (staleness 1 / 2; least 0.23 /
0.10, median 0.87 / 0.59), 558 / 342 without (least 0.25 / 0.10, median 0.73 / 0.37). The policy term's weight raises the mean at staleness 2 (0.430 vs 0.276) and a
little at staleness 1, but not on every seed (on 13 and 12 of the 16). V-trace targets slow learning here: the traces
``lam * min(1, pi_old/mu)`` multiply over a response's tokens (pi_old/mu has a std of ~0.5 a
token at this task's learning rate), so the final reward reaches early tokens' advantages
weakly (correlation of the first token's advantage with the score, staleness 1, seed 3: GAE
0.22 / 0.79 / 0.91 vs V-trace -0.07 / 0.48 / 0.50 at steps 2 / 4 / 7) and the barely trained
critic does not make up for it; V-trace's returns for the critic with GAE's advantages for the
policy gave 0.487 / 0.350 (staleness 1 / 2), between the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from itertools import combinations
from pathlib import Path
from statistics import mean, median

ARMS = {
    "sync": [],
    "staleness 1, no correction": ["async.max_staleness=1", "async.is_cap=0"],
    "staleness 1, is_cap=2, gae": ["async.max_staleness=1"],
    "staleness 1, is_cap=2, vtrace": ["async.max_staleness=1", "async.value_targets=vtrace"],
    "staleness 2, no correction": ["async.max_staleness=2", "async.is_cap=0"],
    "staleness 2, is_cap=2, gae": ["async.max_staleness=2"],
    "staleness 2, is_cap=2, vtrace": ["async.max_staleness=2", "async.value_targets=vtrace"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--arms", nargs="+", default=[""], help="only the arms whose name holds one of these"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from ppo_fixtures import make_ppo_setup

    from megatron_rlhf.ppo.train_cli import main as train_ppo

    arms = {arm: o for arm, o in ARMS.items() if arm == "sync" or any(a in arm for a in args.arms)}
    with tempfile.TemporaryDirectory() as tmp:
        setup = make_ppo_setup(Path(tmp))
        rewards = {}  # arm: [each seed's rewards, a step each]
        for arm, overrides in arms.items():
            rewards[arm] = []
            for seed in args.seeds:
                output_dir = Path(tmp) / f"run_{len(rewards)}_{seed}"
                code = train_ppo(
                    ["--config", str(setup["config"]), f"train.output_dir={output_dir}",
                     f"train.seed={seed}", f"train.steps={args.steps}",
                     "train.save_interval=1000", *overrides]
                )  # fmt: skip
                assert code == 0, (arm, seed, code)
                lines = (output_dir / "metrics.jsonl").read_text().splitlines()
                rewards[arm].append([json.loads(line)["reward/mean"] for line in lines])
    finals = {arm: [sum(run[-3:]) / 3 for run in runs] for arm, runs in rewards.items()}
    print("| arm | last-three reward, mean | per seed |\n|---|---:|---|")
    for arm, values in finals.items():
        print(f"| {arm} | {mean(values):.3f} | {' '.join(f'{v:.3f}' for v in values)} |")
    print_gate(finals, [run[0] for run in rewards["sync"]])


def print_gate(finals: dict[str, list[float]], starts: list[float]) -> None:
    """The learning gate of tests/test_ppo_async.py over every three-seed set of the seeds:
    each arm's gain over the start (the last-three reward less step 1's), summed over the set,
    as a share of the synchronous run's; in how many sets it reaches a third, the least and
    median."""
    sets = list(combinations(range(len(starts)), 3))
    if not sets:
        return
    print(f"\nshare of the synchronous gain, pooled over each of {len(sets)} three-seed sets")
    for arm, values in finals.items():
        shares = sorted(
            sum(values[i] - starts[i] for i in chosen)
            / sum(finals["sync"][i] - starts[i] for i in chosen)
            for chosen in sets
        )
        reached = sum(share >= 1 / 3 for share in shares)
        print(f"{arm}: >= 1/3 in {reached}, least {shares[0]:.2f}, median {median(shares):.2f}")


if __name__ == "__main__":
    main()
