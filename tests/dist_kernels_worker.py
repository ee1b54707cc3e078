"""Torchrun worker for ``tests/test_kernels_dist.py``: TP=2 against TP=1, and DP whitening.

Run under ``torchrun --nproc-per-node 2`` over gloo. Every check runs on both ranks from the same
seed (drawn per launch, named in every detail); it passes only if it passed on both ranks.
References: the same call at TP=1 on the full vocabulary, a float64 ``log_softmax``,
megatron-core's ``vocab_parallel_cross_entropy`` at TP=2, and whitening of all ranks' data
gathered into one process.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron_rlhf.kernels import masked_whiten, token_logprobs, token_logprobs_from_hidden
from torchrun_harness import Harness

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")
harness = Harness(__doc__)


@contextlib.contextmanager
def count_collectives():
    """Count calls of torch.distributed collectives inside the block."""
    counts = {"n": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ref_logprobs(logits, targets, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def close(a, b, atol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"
    return f"{what} {err:.2g}"


def check_logits_tp2(gen, group, dtype):
    rank, vocab_local = dist.get_rank(group), 389  # V = 778: not a multiple of any block size
    logits = (torch.randn(3, 6, 2 * vocab_local, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 2 * vocab_local, (3, 6), generator=gen)
    targets[0, :2] = torch.tensor([vocab_local - 1, vocab_local])  # the shard boundary
    w_lp, w_h = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    columns = slice(rank * vocab_local, (rank + 1) * vocab_local)
    shard = logits[..., columns].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    with count_collectives() as forward_calls:
        lp2, h2 = token_logprobs(shard, targets, 0.8, group, return_entropy=True)
    with count_collectives() as backward_calls:
        ((lp2 * w_lp).sum() + (h2 * w_h).sum()).backward()
    assert forward_calls["n"] == 1 and backward_calls["n"] == 0, (forward_calls, backward_calls)
    lp1, h1 = token_logprobs(full, targets, 0.8, return_entropy=True)
    ((lp1 * w_lp).sum() + (h1 * w_h).sum()).backward()
    ref_lp, ref_h = ref_logprobs(logits, targets, 0.8)
    grad_scale = full.grad.abs().max().item()
    grad_tol = (3e-6 if dtype == torch.float32 else 2e-2) * grad_scale
    return "; ".join(
        [
            "1 collective forward, 0 backward",
            close(lp2, lp1, 2e-6, "logp tp2-tp1"),
            close(h2, h1, 2e-6, "entropy tp2-tp1"),
            close(lp2, ref_lp, 2e-5, "logp tp2-float64"),
            close(h2, ref_h, 2e-5, "entropy tp2-float64"),
            close(shard.grad, full.grad[..., columns], grad_tol, "grad shard tp2-tp1"),
        ]
    )


def check_hidden_tp2(gen, group):
    rank, vocab_local, width = dist.get_rank(group), 301, 16
    hidden = torch.randn(2, 9, width, generator=gen)
    weight = torch.randn(2 * vocab_local, width, generator=gen) * 0.3
    targets = torch.randint(0, 2 * vocab_local, (2, 9), generator=gen)
    w_lp, w_h = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
    kwargs = dict(return_entropy=True, token_chunk=7, vocab_chunk=128)
    h2_in, w2_in = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    with count_collectives() as forward_calls:
        lp2, h2 = token_logprobs_from_hidden(h2_in, w2_in, targets, 1.1, group, **kwargs)
    with count_collectives() as backward_calls:
        ((lp2 * w_lp).sum() + (h2 * w_h).sum()).backward()
    assert forward_calls["n"] == 1 and backward_calls["n"] == 1, (forward_calls, backward_calls)
    h1_in, w1_in = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp1, h1 = token_logprobs_from_hidden(h1_in, w1_in, targets, 1.1, **kwargs)
    ((lp1 * w_lp).sum() + (h1 * w_h).sum()).backward()
    ref_lp, ref_h = ref_logprobs(hidden.double() @ weight.double().T, targets, 1.1)
    return "; ".join(
        [
            "1 collective forward, 1 backward (grad of hidden)",
            close(lp2, lp1, 2e-6, "logp tp2-tp1"),
            close(h2, h1, 2e-6, "entropy tp2-tp1"),
            close(lp2, ref_lp, 2e-5, "logp tp2-float64"),
            close(h2, ref_h, 2e-5, "entropy tp2-float64"),
            close(h2_in.grad, h1_in.grad, 1e-5, "grad hidden tp2-tp1"),
            close(w2_in.grad, w1_in.grad[rows], 1e-5, "grad weight shard tp2-tp1"),
        ]
    )


def check_vs_megatron_core(gen, group):
    """Our TP=2 log-probs equal minus megatron-core's vocab-parallel cross-entropy at TP=2."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, vocab_local = dist.get_rank(group), 250
    logits = torch.randn(5, 3, 2 * vocab_local, generator=gen) * 4  # (T, B, V): Megatron layout
    targets = torch.randint(0, 2 * vocab_local, (5, 3), generator=gen)
    shard = logits[..., rank * vocab_local : (rank + 1) * vocab_local]
    ours_in = shard.clone().requires_grad_()
    mcore_in = shard.clone().requires_grad_()
    ours = token_logprobs(
        ours_in, targets, tp_group=parallel_state.get_tensor_model_parallel_group()
    )
    mcore_loss = vocab_parallel_cross_entropy(mcore_in, targets)  # (T, B)
    ours.sum().neg().backward()
    mcore_loss.sum().backward()
    return "; ".join(
        [
            close(-ours, mcore_loss, 2e-6, "-logp vs mcore loss"),
            close(ours_in.grad, mcore_in.grad, 1e-6, "grad vs mcore"),
        ]
    )


def check_whiten_dp2(gen, group):
    rank = dist.get_rank(group)
    rank_gen = torch.Generator().manual_seed(int(gen.initial_seed()) + 1 + rank)
    batch = 3 + 2 * rank  # unequal shares of the data-parallel batch
    lengths = torch.randint(0, 24, (batch,), generator=rank_gen)
    mask = torch.arange(23) < lengths[:, None]
    x = torch.randn(batch, 23, generator=rank_gen) * 2 + 5
    everyone = [None, None]
    dist.all_gather_object(everyone, (x, mask), group=group)
    selected = torch.cat([xi[mi] for xi, mi in everyone]).double()
    mean, std = selected.mean(), torch.sqrt(selected.var(unbiased=True) + 1e-8)
    details = []
    for shift_mean in (True, False):
        out = masked_whiten(x, mask, group=group, shift_mean=shift_mean)
        expected = (x.double() - mean) / std + (0.0 if shift_mean else mean)
        details.append(close(out, expected * mask, 1e-5, f"shift_mean={shift_mean}"))
    return "; ".join(details)


@functools.cache
def world_group():
    return dist.new_group(list(range(dist.get_world_size())))


@functools.cache
def shared_seed() -> int:
    """A fresh seed per launch, the same on every rank."""
    seed = torch.tensor([torch.seed() % 2**31])
    dist.broadcast(seed, src=0)
    return int(seed)


def seeded(offset: int, check) -> str:
    """Run ``check(generator, group)`` from the launch's seed + ``offset``; name the seed."""
    seed = shared_seed()
    try:
        detail = check(torch.Generator().manual_seed(seed + offset), world_group())
    except Exception as err:
        raise RuntimeError(f"seed {seed}") from err
    return f"seed {seed}: {detail}"


@harness.check
def logits_tp2_fp32(args) -> str:
    return seeded(0, lambda gen, group: check_logits_tp2(gen, group, torch.float32))


@harness.check
def logits_tp2_bf16(args) -> str:
    return seeded(1, lambda gen, group: check_logits_tp2(gen, group, torch.bfloat16))


@harness.check
def hidden_tp2(args) -> str:
    return seeded(2, check_hidden_tp2)


@harness.check
def vs_megatron_core_tp2(args) -> str:
    return seeded(3, check_vs_megatron_core)


@harness.check
def whiten_dp2(args) -> str:
    return seeded(4, check_whiten_dp2)


if __name__ == "__main__":
    harness.main()
