"""models/cpu_linear.py: fp32 CPU linears through oneDNN equal float64 to fp32 rounding, at
awkward shapes and layouts, and step aside wherever oneDNN's op must not run (autograd,
autocast, other dtypes, switched off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models import cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear._OP is None, reason="this torch has no oneDNN linear")


@pytest.fixture(autouse=True)
def onednn_only(monkeypatch):
    """Our few-row kernel off, so that the few-row cases here run oneDNN's op, as their names
    say (the kernel's own checks: tests/test_cpu_gemv.py)."""
    monkeypatch.setattr(cpu_linear, "_GEMV", False)


def _assert_fp32_rounding(out, x, w, b=None):
    """``out`` is ``x @ w^T + b`` to fp32 rounding: within the bound of a k-term fp32 dot
    product's error (it grows with k and the terms' magnitudes) of the float64 product."""
    expected = x.double() @ w.double().t()
    expected = expected if b is None else expected + b.double()
    bound = 4 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t()).max()
    assert (out.double() - expected).abs().max().item() <= bound.item()


@pytest.mark.parametrize(
    "shape",
    [
        ((1, 64), (4099, 64)),  # one row (a decode step of one prompt)
        ((3, 7, 53), (4957, 53)),  # 3-D, odd widths
        ((8, 1, 96), (2731, 96)),  # a decode step's (S, B, H) layout
        ((129, 33), (7951, 33)),  # more rows than a row of the weight holds
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_to_fp32_rounding(shape, bias):
    generator = torch.Generator().manual_seed(sum(shape[0]) + bias)
    x = torch.randn(*shape[0], generator=generator)
    w = torch.randn(*shape[1], generator=generator)
    b = torch.randn(shape[1][0], generator=generator) if bias else None
    assert cpu_linear.onednn_applies(x, w)
    out = cpu_linear.linear(x, w, b)
    assert out.shape == (*shape[0][:-1], shape[1][0]) and out.dtype == torch.float32
    _assert_fp32_rounding(out, x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_strided_operands():
    """A transposed input (made contiguous) and a transposed weight view (the LM head's input
    gradient, ``grad @ W`` as ``linear(grad, W.t())``)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(520, 12, generator=generator).t()  # (12, 520), not contiguous
    w = torch.randn(520, 509, generator=generator).t()  # (509, 520) view of a (520, 509) matrix
    assert cpu_linear.onednn_applies(x, w)
    _assert_fp32_rounding(cpu_linear.linear(x, w), x, w)


def test_steps_aside_where_onednn_must_not_run():
    x, w = torch.randn(4, 8), torch.randn(cpu_linear.MIN_WEIGHT // 8, 8)
    assert cpu_linear.onednn_applies(x, w)
    assert not cpu_linear.onednn_applies(x, w[:-1])  # a small weight: MKL's lower overhead
    assert not cpu_linear.onednn_applies(x.double(), w.double())  # fp64: F.linear
    assert not cpu_linear.onednn_applies(x.bfloat16(), w.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 run's products: autocast's
        assert not cpu_linear.onednn_applies(x, w)
        assert cpu_linear.linear(x, w).dtype == torch.bfloat16
    trained = w.clone().requires_grad_()
    assert not cpu_linear.onednn_applies(x, trained)  # oneDNN's op has no derivative
    out = cpu_linear.linear(x, trained)
    out.sum().backward()  # F.linear took it: the gradient arrives
    torch.testing.assert_close(trained.grad, x.sum(0).expand_as(w))
    with torch.no_grad():
        assert cpu_linear.onednn_applies(x, trained)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    assert cpu_linear._onednn_op() is None
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    assert cpu_linear._onednn_op() is not None
