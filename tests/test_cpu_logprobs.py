"""kernels/fused/cpu_logprobs.c: the log-prob kernel's statistics and gradient over fp32 logits
equal float64 to fp32 rounding at awkward vocabulary sizes (off the 16-lane vector, below one
vector, BLOOM's 250,880), with temperatures, -inf logits, strided rows, another rank's targets and
an unaligned gradient; a row without mass gives the PyTorch path's statistics, a nan stays nan;
``logprobs.py`` runs it only where it applies. (``test_kernels.py`` tests the PyTorch path.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from megatron_rlhf.kernels import cpu_gemv, cpu_logprobs, cpu_norm, token_logprobs
from megatron_rlhf.kernels import logprobs as logprobs_module

needs_kernel = pytest.mark.skipif(
    not cpu_logprobs.enabled(), reason="no AVX-512 or no C compiler: the kernel cannot run here"
)


def test_our_cpu_kernels_build_wherever_they_can_run():
    """A machine with AVX-512 and a C compiler runs our kernels (this one, cpu_gemv.c and
    cpu_norm.c): a failed build, which would skip every kernel test of them or leave their tests
    on the PyTorch path, fails here instead."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if torch.backends.cpu.get_cpu_capability() == "AVX512" and compiler:
        assert cpu_logprobs._library() is not None  # whatever the switch says
        assert cpu_gemv.available()
        assert cpu_norm._library() is not None


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
@needs_kernel
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


@needs_kernel
def test_bloom_vocabulary(gen):
    logits = torch.randn(2, 3, 250_880, generator=gen) * 3
    targets = torch.randint(0, 250_880, (2, 3), generator=gen)
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True)
    ref_lp, ref_h = ref_logprobs(logits, targets)
    # a few fp32 ulps of values ~13: the row sums are fp64 across blocks (16 fp32 lanes over
    # the whole row were 2e-5 and 7e-5 off here, 20x the PyTorch path's error)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=5e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_h, atol=5e-6, rtol=0)


@pytest.mark.parametrize("with_entropy", [False, True])
@needs_kernel
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


@needs_kernel
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


@needs_kernel
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


@pytest.mark.parametrize("vocab", [7, 389, 4099, 250_880])
@needs_kernel
def test_bf16_logits_equal_float64_and_the_pytorch_paths_gradient(vocab, gen, monkeypatch):
    """bf16 logits (a train.bf16 run's LM head), computed in fp32 as the PyTorch path does on
    its fp32 copies: statistics equal float64 of the bf16 values; the gradient is float64's
    rounded once to bf16, and the PyTorch path's bit for bit but where the two fp32 values
    straddle a bf16 rounding boundary (one bf16 ulp, or fp32 rounding's absolute size where the
    entropy term's two parts nearly cancel)."""
    logits = (torch.randn(2, 5, vocab, generator=gen) * 3).bfloat16()
    logits[1, 2, : vocab // 2] = -1e4  # probability 0 (-inf: no finite float64 entropy gradient)
    targets = torch.randint(vocab // 2, vocab, (2, 5), generator=gen)
    w_lp, w_h = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    assert cpu_logprobs.applies(logits.view(-1, vocab), dtypes=cpu_logprobs.LOGITS)

    def run(z, log_probs):
        z = z.requires_grad_()
        lp, h = log_probs(z)
        ((lp * w_lp).sum() + (h * w_h).sum()).backward()
        return lp.detach(), h.detach(), z.grad

    ours = run(logits.clone(), lambda z: token_logprobs(z, targets, 0.8, return_entropy=True))
    reference = run(logits.double(), lambda z: ref_logprobs(z, targets, 0.8))
    torch.testing.assert_close(ours[0].double(), reference[0], atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(ours[1].double(), reference[1], atol=2e-5, rtol=1e-6)
    assert ours[2].dtype == torch.bfloat16
    torch.testing.assert_close(ours[2].double(), reference[2], atol=1e-7, rtol=2**-8)
    monkeypatch.setenv(cpu_logprobs.ENV, "torch")
    torch_path = run(logits.clone(), lambda z: token_logprobs(z, targets, 0.8, return_entropy=True))
    differ = ours[2] != torch_path[2]
    assert differ.float().mean() < 1e-3
    ulp = torch_path[2].float().abs() * 2**-7  # bf16 keeps 8 significant bits
    bound = ulp.clamp(min=1e-7)  # the float64 check's atol above
    assert ((ours[2].float() - torch_path[2].float()).abs()[differ] <= bound[differ]).all()


@needs_kernel
def test_bf16_gradient_rows_unaligned_with_a_tail_and_nan(gen):
    """A bf16 gradient row off a 32-byte line takes plain stores and its last V % 16 values
    are written alone (nothing past the row: the buffer's last element stays 0); a nan logit
    gives nan gradients."""
    rows = (torch.randn(3, 777, generator=gen) * 2).bfloat16()
    targets, lse = torch.tensor([0, -1, 776]), torch.logsumexp(rows.float(), 1)
    zeros, grad_lp = torch.zeros(3), torch.randn(3, generator=gen)
    buffer = torch.zeros(3 * 777 + 2, dtype=torch.bfloat16)
    unaligned = buffer[1:-1].view(3, 777)
    cpu_logprobs.rows_grad(rows, unaligned, targets, lse, zeros, grad_lp, None, 1.0)
    expected = -torch.softmax(rows.double(), 1) * grad_lp[:, None].double()
    expected[0, 0] += grad_lp[0]
    expected[2, 776] += grad_lp[2]
    torch.testing.assert_close(unaligned.double(), expected, atol=1e-7, rtol=2**-8)
    assert buffer[0] == 0 and buffer[-1] == 0
    rows[1, 5] = float("nan")
    cpu_logprobs.rows_grad(rows, unaligned, targets, lse, zeros, grad_lp, None, 1.0)
    assert unaligned[1].isnan().any() and unaligned[[0, 2]].isfinite().all()


@needs_kernel
def test_runs_only_where_it_applies(monkeypatch):
    rows = torch.randn(4, 64)
    assert cpu_logprobs.applies(rows)
    assert not cpu_logprobs.applies(rows.double())
    assert not cpu_logprobs.applies(rows.bfloat16())  # the sampler's: fp32 only
    assert cpu_logprobs.applies(rows.bfloat16(), dtypes=cpu_logprobs.LOGITS)
    assert not cpu_logprobs.applies(rows.double(), dtypes=cpu_logprobs.LOGITS)
    assert not cpu_logprobs.applies(rows.t())  # columns of unit stride, not rows
    assert not cpu_logprobs.applies(
        rows, torch.empty(4, 64, dtype=torch.bfloat16), dtypes=cpu_logprobs.LOGITS
    )  # one dtype for the rows and their gradient
    monkeypatch.setenv(cpu_logprobs.ENV, "torch")
    assert not cpu_logprobs.applies(rows)
    assert logprobs_module.new_workspace(rows) is not None  # the PyTorch path's scratch


@pytest.mark.parametrize("vocab, temperature", [(5, 1.0), (1000, 0.7), (250_880, 1.0)])
@needs_kernel
def test_sample_draws_the_inverse_cdf_token_and_its_logprob(vocab, temperature, gen):
    """Uniforms aimed at the middle of chosen tokens' CDF intervals (float64) draw exactly
    those tokens; the log-probs equal float64's log-softmax; -inf (padded) entries are never
    drawn, even by a uniform just below 1."""
    rows = 6
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, vocab - 2 :] = -float("inf")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    wanted = torch.randint(0, vocab - 2, (rows,), generator=gen)
    wanted[0] = 0
    wanted[1] = vocab - 3  # the last token of nonzero probability
    lower = torch.where(wanted > 0, cdf.gather(1, (wanted - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    uniforms = ((lower + cdf.gather(1, wanted[:, None])[:, 0]) / 2 / cdf[:, -1]).float()
    uniforms[1] = 1.0 - 2**-24  # the largest float below 1: the last positive token
    tokens, logprobs = cpu_logprobs.sample(logits, uniforms, temperature)
    small = probs.gather(1, wanted[:, None])[:, 0] < 1e-6  # too narrow an interval for fp32
    assert torch.equal(tokens[~small], wanted[~small]), (tokens, wanted)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), ref, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_choose_tokens_takes_the_kernel_at_top_p_1(gen, monkeypatch):
    """The decode's sampler: the kernel's draw equals the PyTorch path's (softmax, cumulative
    sum, search, log-softmax) on the same uniforms; top-p < 1 keeps the PyTorch path."""
    from megatron_rlhf.generation import decode

    logits = torch.randn(8, 2, 4099, generator=gen)[:, -1] * 2  # strided rows, as in decode
    uniforms = torch.rand(8, generator=gen)
    sampling = decode.SamplingConfig(temperature=0.8)
    ours = decode.choose_tokens(logits, sampling, uniforms)
    monkeypatch.setenv(cpu_logprobs.ENV, "torch")
    theirs = decode.choose_tokens(logits, sampling, uniforms)
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)
    monkeypatch.delenv(cpu_logprobs.ENV)
    calls = []
    monkeypatch.setattr(cpu_logprobs, "sample", lambda *a: calls.append(a))
    decode.choose_tokens(logits, decode.SamplingConfig(temperature=0.8, top_p=0.9), uniforms)
    assert not calls
