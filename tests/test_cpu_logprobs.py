"""kernels/fused/cpu_logprobs.c: the log-prob kernel's statistics and gradient over fp32 logits
equal float64 to fp32 rounding at awkward vocabulary sizes (off the 16-lane vector, below one
vector, BLOOM's 250,880), with temperatures, -inf logits, strided rows, another rank's targets and
an unaligned gradient; a row without mass gives the PyTorch path's statistics, a nan stays nan;
``logprobs.py`` runs it only where it applies. (``test_kernels.py`` tests the PyTorch path.)"""

from __future__ import annotations

import pytest
import torch
from megatron_rlhf.kernels import cpu_logprobs, token_logprobs
from megatron_rlhf.kernels import logprobs as logprobs_module

pytestmark = pytest.mark.skipif(
    not cpu_logprobs.enabled(), reason="no AVX-512 or no C compiler: the kernel cannot run here"
)


def ref_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """float64 log p(target) and entropy from a full log_softmax; a -inf logit adds 0."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    plogp = torch.where(logp > -float("inf"), logp.exp() * logp, 0.0)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -plogp.sum(-1)


@pytest.fixture
def gen():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("vocab", [7, 16, 389, 4099])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_float64(vocab, temperature, gen):
    logits = torch.randn(3, 5, vocab, generator=gen) * 4
    logits[0, 1, : vocab // 2] = -float("inf")  # masked (padded) vocabulary entries
    targets = torch.randint(vocab // 2, vocab, (3, 5), generator=gen)
    assert cpu_logprobs.applies(logits.view(-1, vocab))
    logprobs, entropy = token_logprobs(logits, targets, temperature, return_entropy=True)
    ref_lp, ref_h = ref_logprobs(logits, targets, temperature)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, atol=2e-5, rtol=1e-5)
    only_lp = token_logprobs(logits, targets, temperature)  # the entropy's sums skipped
    torch.testing.assert_close(only_lp, logprobs, atol=0, rtol=0)


def test_bloom_vocabulary(gen):
    logits = torch.randn(2, 3, 250_880, generator=gen) * 3
    targets = torch.randint(0, 250_880, (2, 3), generator=gen)
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True)
    ref_lp, ref_h = ref_logprobs(logits, targets)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradient_equals_float64_autograd(with_entropy, gen):
    """logits[:, 1:] (strided rows: the per-sequence path) at a temperature, with entries whose
    probability is 0 in fp32 and float64 (-inf has no finite float64 entropy gradient)."""
    logits = (torch.randn(2, 9, 301, generator=gen) * 3).requires_grad_()
    with torch.no_grad():
        logits[1, 4, :100] = -1e4
    targets = torch.randint(100, 301, (2, 9), generator=gen)
    w_lp, w_h = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)

    def loss(z, log_probs):
        lp, h = log_probs(z[:, 1:], targets[:, 1:])
        return (lp * w_lp).sum() + ((h * w_h).sum() if with_entropy else 0.0)

    loss(logits, lambda z, t: token_logprobs(z, t, 0.9, return_entropy=True)).backward()
    reference = logits.detach().double().requires_grad_()
    loss(reference, lambda z, t: ref_logprobs(z, t, 0.9)).backward()
    torch.testing.assert_close(logits.grad.double(), reference.grad, atol=2e-6, rtol=1e-5)


def test_another_ranks_targets_and_a_row_without_mass(gen):
    """Targets -1 (on another TP rank) and an all -inf row: the PyTorch path's statistics."""
    rows = torch.randn(6, 1000, generator=gen) * 5
    rows[2] = -float("inf")
    targets = torch.tensor([3, -1, 5, 999, -1, 0])
    for with_entropy in (False, True):
        ours = cpu_logprobs.rows_stats(rows, targets, 1.25, with_entropy)
        ref = logprobs_module._rows_stats_torch(rows.double(), targets, 1.25, with_entropy, None)
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
    assert ours[0, 2] == logprobs_module.EMPTY_MAX and ours[1, 2] == 0 == ours[2, 2]


def test_unaligned_gradient_and_nan(gen):
    """A gradient row that starts off a 64-byte line takes plain stores; a nan logit gives nan
    log-probs and gradients (the non-finite guard sees it), not a finite number."""
    rows = torch.randn(3, 777, generator=gen)
    targets, lse = torch.tensor([0, -1, 776]), torch.logsumexp(rows, 1)
    zeros, grad_lp = torch.zeros(3), torch.randn(3, generator=gen)
    buffer = torch.zeros(3 * 777 + 1)
    unaligned = buffer[1:].view(3, 777)
    cpu_logprobs.rows_grad(rows, unaligned, targets, lse, zeros, grad_lp, None, 1.0)
    expected = -torch.softmax(rows.double(), 1) * grad_lp[:, None].double()
    expected[0, 0] += grad_lp[0]
    expected[2, 776] += grad_lp[2]
    torch.testing.assert_close(unaligned.double(), expected, atol=1e-6, rtol=1e-5)
    assert buffer[0] == 0
    logits = rows[None].clone()
    logits[0, 1, 5] = float("nan")
    logprobs, entropy = token_logprobs(logits, targets.clamp(min=0)[None], return_entropy=True)
    assert logprobs[0, 1].isnan() and entropy[0, 1].isnan()
    assert logprobs[0, [0, 2]].isfinite().all() and entropy[0, [0, 2]].isfinite().all()


def test_runs_only_where_it_applies(monkeypatch):
    rows = torch.randn(4, 64)
    assert cpu_logprobs.applies(rows)
    assert not cpu_logprobs.applies(rows.double())
    assert not cpu_logprobs.applies(rows.bfloat16())
    assert not cpu_logprobs.applies(rows.t())  # columns of unit stride, not rows
    assert not cpu_logprobs.applies(rows, torch.empty(4, 64, dtype=torch.bfloat16))
    monkeypatch.setenv(cpu_logprobs.ENV, "torch")
    assert not cpu_logprobs.applies(rows)
    assert logprobs_module.new_workspace(rows) is not None  # the PyTorch path's scratch
