"""GAE on the CPU: the per-token Python loop of TRL/OpenRLHF against ``megatron_rlhf.kernels.gae``.

    python benchmarks/bench_gae.py [--batch 64 256] [--tokens 1024 2048]

``loop`` is the peers' ``get_advantages_and_returns``: T sequential steps of small tensor ops over
the batch. ``ours`` is the vectorised path (two small matmuls with matrices of powers of
gamma*lam, no loop over T), mask validation included. Both get ragged right-padded masks;
``max |diff|`` is between the two outputs. Time: the best of 20 calls (loop: 3).

Measured on a 2-core CPU, no GPU, torch 2.13.0+cpu, with ``python benchmarks/bench_gae.py``
(gamma = 1, lam = 0.95) on a quiet moment of the shared machine:

       B     T  loop (ms)  ours (ms)  speedup  max |diff|
      64  1024       16.9       0.31      55x    4.77e-06
      64  2048       34.3       0.41      83x    4.77e-06
     256  1024       21.3       0.54      39x    5.25e-06
     256  2048       42.6       0.95      45x    5.72e-06

Single-threaded (``OMP_NUM_THREADS=1``): 49x, 67x, 19x, 27x. Under heavy load from other jobs
the loop slows more than ours (ratios of 90-300x were seen), except that two threads then fight
for the cores: use ``OMP_NUM_THREADS=1`` on a busy machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from megatron_rlhf.kernels import gae


def gae_loop(rewards, values, mask, gamma: float, lam: float):
    """The per-token loop every peer uses (values and rewards masked, next value 0 at the end)."""
    values = values * mask
    rewards = rewards * mask
    last_gae = 0.0
    advantages_reversed = []
    seq_len = rewards.shape[1]
    for t in reversed(range(seq_len)):
        next_values = values[:, t + 1] if t < seq_len - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages * mask, (advantages + values) * mask


def best_of(repeats: int, fn, *args) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    args = parser.parse_args(argv)
    print(
        f"{'B':>4} {'T':>5} {'loop (ms)':>10} {'ours (ms)':>10} {'speedup':>8} {'max |diff|':>11}"
    )
    generator = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for tokens in args.tokens:
            rewards = torch.randn(batch, tokens, generator=generator)
            values = torch.randn(batch, tokens, generator=generator)
            lengths = torch.randint(1, tokens + 1, (batch,), generator=generator)
            mask = (torch.arange(tokens) < lengths[:, None]).float()
            inputs = (rewards, values, mask, args.gamma, args.lam)
            loop_s, (loop_adv, _) = best_of(3, gae_loop, *inputs)
            ours_s, (ours_adv, _) = best_of(20, gae, *inputs)
            diff = (loop_adv - ours_adv).abs().max().item()
            print(
                f"{batch:>4} {tokens:>5} {1e3 * loop_s:10.1f} {1e3 * ours_s:10.2f} "
                f"{loop_s / ours_s:7.0f}x {diff:11.2e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
