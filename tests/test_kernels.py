"""The PyTorch (CPU) path of ``megatron_rlhf.kernels`` against float64 references (our C
log-prob kernel is switched off here; ``test_cpu_logprobs.py`` tests it).

References are written independently of the kernels: a full float64 ``log_softmax`` for the
log-probs and entropy, and per-token Python loops (as in TRL/OpenRLHF) for GAE and the shaped
rewards. Inputs are fresh random tensors with ragged masks and awkward sizes.
"""

from __future__ import annotations

import sys

import pytest
import torch
from megatron_rlhf.kernels import advantages as advantages_module
from megatron_rlhf.kernels import (
    cpu_logprobs,
    gae,
    kl_penalty,
    masked_whiten,
    shaped_rewards,
    token_logprobs,
    token_logprobs_from_hidden,
)
from megatron_rlhf.kernels import logprobs as logprobs_module


def ref_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """float64 log p(target) and entropy from a full log_softmax."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # (B, T, V)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def ragged_mask(batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Rows 0...0 1...1 0...0 of random lengths, plus an empty, a full and a one-token row."""
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=generator)
    lengths[:3] = torch.tensor([0, seq_len, 1])
    starts = (torch.rand(batch, generator=generator) * (seq_len - lengths + 1)).long()
    starts[1] = 0
    positions = torch.arange(seq_len)
    return (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])


def ref_gae(rewards, values, mask, gamma, lam):
    """Per-token loop in float64: next value 0 after the last response token, 0 on padding."""
    rewards, values = rewards.double(), values.double()
    advantages = torch.zeros_like(values)
    for b in range(values.shape[0]):
        valid = set(torch.nonzero(mask[b]).flatten().tolist())
        running = 0.0
        for t in sorted(valid, reverse=True):
            has_next = (t + 1) in valid
            next_value = float(values[b, t + 1]) if has_next else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * (running if has_next else 0.0)
            advantages[b, t] = running
    return advantages, (advantages + values) * mask


@pytest.fixture(autouse=True)
def pytorch_path(monkeypatch):
    """fp32 logits take the PyTorch path, as this file's tests say, not our C kernel."""
    monkeypatch.setenv(cpu_logprobs.ENV, "torch")


@pytest.fixture
def gen():
    """Fresh inputs every run; the seed is printed so that a failure can be replayed."""
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def small_chunks(monkeypatch):
    """Make the PyTorch path take several chunks, with a remainder, even at tiny sizes."""
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_float64(dtype, temperature, gen, small_chunks):
    logits = (torch.randn(3, 7, 389, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 389, (3, 7), generator=gen)
    logprobs, entropy = token_logprobs(logits, targets, temperature, return_entropy=True)
    ref_lp, ref_h = ref_logprobs(logits, targets, temperature)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (3, 7)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, atol=2e-5, rtol=1e-5)
    only_lp = token_logprobs(logits, targets, temperature)
    torch.testing.assert_close(only_lp, logprobs, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_at_bloom_vocab(dtype, gen):
    """V = 250,880 (BLOOM): fp32 accumulators keep the error at float32 rounding."""
    logits = (torch.randn(2, 3, 250_880, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 250_880, (2, 3), generator=gen)
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True)
    ref_lp, ref_h = ref_logprobs(logits, targets)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, atol=1e-4, rtol=1e-5)


def test_token_logprobs_gradcheck(gen):
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 11, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, targets, 0.8), (logits,))
    assert torch.autograd.gradcheck(
        lambda z: token_logprobs(z, targets, 1.3, return_entropy=True), (logits,)
    )
    # a strided view (logits[:, :-1], the usual shift) goes through the per-sequence path
    shifted_targets = torch.randint(0, 11, (2, 2), generator=gen)
    assert torch.autograd.gradcheck(
        lambda z: token_logprobs(z[:, :-1], shifted_targets, return_entropy=True), (logits,)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_grad_matches_float64_autograd(dtype, gen, small_chunks):
    logits = (torch.randn(2, 9, 300, generator=gen) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (2, 9), generator=gen)
    weights_lp, weights_h = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    logprobs, entropy = token_logprobs(logits[:, 1:], targets[:, 1:], 0.9, return_entropy=True)
    ((logprobs * weights_lp[:, 1:]).sum() + (entropy * weights_h[:, 1:]).sum()).backward()
    ref_in = logits.detach().double().requires_grad_()
    ref_lp, ref_h = ref_logprobs(ref_in[:, 1:], targets[:, 1:], 0.9)
    ((ref_lp * weights_lp[:, 1:]).sum() + (ref_h * weights_h[:, 1:]).sum()).backward()
    scale = ref_in.grad.abs().max().item()  # fp32: a few ulps of the largest entry; bf16: 2^-6
    tol = 3e-6 * scale if dtype == torch.float32 else 2e-2 * scale
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=tol, rtol=0)


@pytest.mark.parametrize("token_chunk", [4, 64])  # several token chunks, or one
def test_hidden_path_matches_full_logits_and_gradcheck(token_chunk, gen):
    hidden = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(13, 6, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 13, (2, 5), generator=gen)

    def ours(h, w):
        return token_logprobs_from_hidden(
            h, w, targets, 0.9, return_entropy=True, token_chunk=token_chunk, vocab_chunk=5
        )

    ref_lp, ref_h = ref_logprobs(hidden @ weight.T, targets, 0.9)
    logprobs, entropy = ours(hidden, weight)
    torch.testing.assert_close(logprobs, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(entropy, ref_h, atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(ours, (hidden, weight))


def test_hidden_path_bf16_matches_logits_path(gen):
    """Tiles are formed in the input dtype, so the result equals the logits path on h @ W.T."""
    hidden = torch.randn(3, 20, 32, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(700, 32, generator=gen) * 0.2).bfloat16().requires_grad_()
    targets = torch.randint(0, 700, (3, 20), generator=gen)
    lp, h = token_logprobs_from_hidden(
        hidden, weight, targets, return_entropy=True, token_chunk=17, vocab_chunk=256
    )
    ref_lp, ref_h = ref_logprobs(hidden.detach() @ weight.detach().T, targets)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), ref_h, atol=2e-5, rtol=1e-5)
    (lp.sum() + h.sum()).backward()
    ref_h_in = hidden.detach().double().requires_grad_()
    ref_w_in = weight.detach().double().requires_grad_()
    ref2_lp, ref2_h = ref_logprobs(ref_h_in @ ref_w_in.T, targets)
    (ref2_lp.sum() + ref2_h.sum()).backward()
    for ours, ref in [(hidden.grad, ref_h_in.grad), (weight.grad, ref_w_in.grad)]:
        assert ours.dtype == torch.bfloat16
        err = (ours.double() - ref).norm() / ref.norm()
        assert err < 2e-2, err


def test_token_logprobs_with_masked_vocab(gen):
    """-inf logits (a masked vocabulary) give exact values and finite gradients."""
    logits = torch.randn(2, 4, 60, generator=gen)
    logits[0, :, :25] = float("-inf")
    logits[1, 3, 1:] = float("-inf")  # a single candidate: log p = 0, entropy 0
    targets = torch.randint(25, 60, (2, 4), generator=gen)
    targets[1, 3] = 0
    logits.requires_grad_()
    logprobs, entropy = token_logprobs(logits, targets, 0.7, return_entropy=True)
    ref = torch.log_softmax(logits.detach().double() / 0.7, dim=-1)
    ref_h = -(ref.exp() * ref).nan_to_num().sum(-1)
    expected_lp = ref.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(logprobs.double(), expected_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h, atol=1e-6, rtol=1e-6)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[0, :, :25] == 0).all()


def test_token_logprobs_rejects_bad_inputs():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="target ids"):
        token_logprobs(logits, torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="target ids"):
        token_logprobs(logits, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="expected logits"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs_from_hidden(logits, torch.randn(7, 4), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_penalty_matches_float64(kind, gen):
    logprobs = -torch.rand(4, 33, generator=gen) * 5
    ref_logprobs_ = logprobs + torch.randn(4, 33, generator=gen) * torch.logspace(-6, 0, 33)
    log_ratio = logprobs.double() - ref_logprobs_.double()
    expected = {
        "k1": log_ratio,
        "k2": log_ratio**2 / 2,
        "k3": torch.expm1(-log_ratio) + log_ratio,
        "abs": log_ratio.abs(),
    }[kind]
    out = kl_penalty(logprobs, ref_logprobs_, kind)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logprobs, ref_logprobs_, "k4")


def test_shaped_rewards_match_loop(gen):
    mask = ragged_mask(9, 23, gen)
    kl = torch.randn(9, 23, generator=gen)
    scores = torch.randn(9, generator=gen)
    out = shaped_rewards(scores, kl, mask, beta=0.05)
    expected = torch.zeros(9, 23, dtype=torch.float64)
    for b in range(9):
        valid = torch.nonzero(mask[b]).flatten().tolist()
        for t in valid:
            expected[b, t] = -0.05 * float(kl[b, t])
        if valid:
            expected[b, valid[-1]] += float(scores[b])
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seq_len", [1, 64, 150])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
def test_gae_matches_float64_loop(seq_len, gamma, lam, gen):
    mask = ragged_mask(6, seq_len, gen)
    rewards = torch.randn(6, seq_len, generator=gen)
    values = torch.randn(6, seq_len, generator=gen)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages.double(), ref_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(returns.double(), ref_ret, atol=2e-5, rtol=1e-5)


def test_gae_float64_is_exact(gen):
    mask = ragged_mask(5, 97, gen)
    rewards = torch.randn(5, 97, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 97, generator=gen, dtype=torch.float64)
    advantages, returns = gae(rewards, values, mask.double(), 0.97, 0.9)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(advantages, ref_adv, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(returns, ref_ret, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("discount", [1.0, 0.999, 0.9])
def test_discounted_sum_long_sequences(discount, gen):
    """T = 2,048 with gamma*lam up to 1: relative error at fp32 rounding, no overflow."""
    x = torch.randn(3, 2048, generator=gen)
    out = advantages_module.discounted_reverse_cumsum(x, discount)
    weights = discount ** torch.arange(2048, dtype=torch.float64)
    # out_t = sum_j w_(j-t) x_j = (suffix sums of w_j x_j) / w_t, fine in float64 here
    expected = (x.double() * weights).flip(1).cumsum(1).flip(1) / weights
    scale = expected.abs().max()
    torch.testing.assert_close(out.double() / scale, expected / scale, atol=2e-6, rtol=0)


def test_gae_rejects_holes_and_bad_shapes():
    values = torch.zeros(2, 5)
    holey = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="row 0 has a hole"):
        gae(values, values, holey, 1.0, 0.95)
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        gae(values, values[:, :4], holey, 1.0, 0.95)
    with pytest.raises(ValueError, match="gamma"):
        gae(values, values, holey.abs(), 1.5, 0.95)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_float64(shift_mean, gen):
    mask = ragged_mask(7, 31, gen)
    x = torch.randn(7, 31, generator=gen) * 3 + 10
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    selected = x[mask].double()
    expected = (x.double() - selected.mean()) / torch.sqrt(selected.var(unbiased=True) + 1e-8)
    if not shift_mean:
        expected += selected.mean()
    expected = expected * mask
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, torch.zeros_like(mask))


def test_a_triton_that_cannot_launch_falls_back_to_pytorch(monkeypatch):
    """A failed probe (no compiler, no Python.h) warns once and routes GPU tensors to the
    PyTorch paths; a working one routes them to Triton. Probed once per process."""
    import types

    from megatron_rlhf.kernels import _dispatch

    gpu_tensor = types.SimpleNamespace(is_cuda=True)  # what use_triton reads of a CUDA tensor
    monkeypatch.setattr(_dispatch, "HAVE_TRITON", True)
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    calls = []

    def failing_probe():
        calls.append(1)
        raise RuntimeError("Failed to find C compiler")

    probe_module = types.ModuleType("megatron_rlhf.kernels.triton_probe")
    probe_module.probe = failing_probe
    monkeypatch.setitem(sys.modules, "megatron_rlhf.kernels.triton_probe", probe_module)
    _dispatch.triton_launches.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Failed to find C compiler.*PyTorch paths"):
            assert not _dispatch.use_triton(gpu_tensor)
        assert not _dispatch.use_triton(gpu_tensor) and len(calls) == 1
        _dispatch.triton_launches.cache_clear()
        probe_module.probe = lambda: None
        assert _dispatch.use_triton(gpu_tensor)
        assert not _dispatch.use_triton(types.SimpleNamespace(is_cuda=False))
    finally:
        _dispatch.triton_launches.cache_clear()
