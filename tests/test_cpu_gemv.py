"""kernels/fused/cpu_gemv.c: a few rows times an fp32 matrix equals float64 to fp32 rounding at
awkward shapes (widths off the 16-lane vector, row counts off the 8 x 3 tile, fewer matrix rows
than threads x tile), with bias and strided rows; its build is cached, atomic and fails loudly;
``models/cpu_linear.linear`` runs it only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron_rlhf.kernels import cpu_gemv
from test_cpu_linear import _assert_fp32_rounding  # within a k-term fp32 dot's error bound

from megatron_rlhf.models import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason="no AVX-512 or no C compiler: the kernel cannot run here"
)


@pytest.mark.parametrize(
    "rows, n, k",
    [
        (1, 4099, 64),  # one row; the matrix's rows not a multiple of the 3-row tile
        (8, 2731, 1024),  # a decode step of 8 at BLOOM-560m's width
        (3, 7, 53),  # a width off the 16-lane vector: the masked tail
        (9, 1000, 17),  # one row past the 8-row tile: a tile of 8 and one of 1
        (cpu_gemv.MAX_ROWS, 301, 96),  # the most rows it takes: three 8-row tiles
        (5, 4, 15),  # fewer matrix rows than threads x tile, a width below one vector
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_to_fp32_rounding(rows, n, k, bias):
    generator = torch.Generator().manual_seed(rows * 7919 + n + k + bias)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    assert cpu_gemv.applies(x, w, b)
    out = cpu_gemv.gemv(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    _assert_fp32_rounding(out, x, w, b)


@pytest.mark.skipif(not cpu_gemv.available(torch.bfloat16), reason="no AVX-512-bf16 here")
@pytest.mark.parametrize("rows, n, k", [(8, 2731, 1024), (3, 7, 53), (9, 1000, 33), (1, 5, 31)])
def test_bf16_equals_float64_to_bf16_output_rounding(rows, n, k):
    """bf16 operands (widths off the 32-value line: the masked tail): the products of bf16
    values are exact in fp32, so the fp32 sums are float64's to a k-term fp32 dot product's
    error, then rounded once to bf16 (half a unit of its 8-bit mantissa)."""
    generator = torch.Generator().manual_seed(rows * 31 + n + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(n, k, generator=generator).bfloat16()
    out = cpu_gemv.gemv(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    expected = x.double() @ w.double().t()
    sums = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    bound = sums + expected.abs() * 2.0**-8
    assert ((out.double() - expected).abs() <= bound).all()
    assert ((out.double() - expected).abs() > 0).any()  # the output is bf16, not the fp32 sums


def test_strided_rows_and_leading_dims():
    """A decode step's (S=1, B, H) input cut from a wider buffer (rows of stride > K), and a
    column-strided input (copied first): each equals float64 with the leading dims kept."""
    generator = torch.Generator().manual_seed(3)
    buffer = torch.randn(1, 6, 80, generator=generator)
    x = buffer[..., 5:69]  # (1, 6, 64), rows of stride 80
    w = torch.randn(1283, 64, generator=generator)
    out = cpu_gemv.gemv(x, w)
    assert out.shape == (1, 6, 1283)
    _assert_fp32_rounding(out.reshape(6, -1), x.reshape(6, 64), w)
    columns = torch.randn(64, 6, generator=generator).t()  # (6, 64), unit stride across rows
    _assert_fp32_rounding(cpu_gemv.gemv(columns, w), columns, w)


def test_one_thread_equals_two_bit_for_bit():
    """Threads split the matrix's rows, never a dot product: the result is the same bits."""
    generator = torch.Generator().manual_seed(11)
    x, w = torch.randn(8, 200, generator=generator), torch.randn(3001, 200, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.gemv(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, cpu_gemv.gemv(x, w))


def test_applies_only_to_what_it_computes():
    x, w = torch.randn(4, 32), torch.randn(100, 32)
    assert cpu_gemv.applies(x, w)
    assert not cpu_gemv.applies(torch.randn(cpu_gemv.MAX_ROWS + 1, 32), w)  # oneDNN's GEMM
    assert not cpu_gemv.applies(x, torch.randn(32, 100).t())  # a transposed weight view
    assert not cpu_gemv.applies(x.double(), w.double())
    assert cpu_gemv.applies(x.bfloat16(), w.bfloat16()) == cpu_gemv.available(torch.bfloat16)
    assert not cpu_gemv.applies(x.bfloat16(), w.bfloat16(), torch.randn(100))  # no bf16 bias
    assert not cpu_gemv.applies(x.bfloat16(), w)  # mixed dtypes
    assert not cpu_gemv.applies(torch.randn(0, 32), w)
    assert not cpu_gemv.applies(x, w, torch.randn(100).double())


def test_cpu_linear_runs_it_for_a_few_rows_and_the_switch_turns_it_off(monkeypatch):
    """``cpu_linear.linear`` hands a few rows to the kernel (its bits), more rows to oneDNN;
    ``MEGATRON_RLHF_CPU_LINEAR=onednn`` keeps every product with oneDNN."""
    if cpu_linear._OP is None:
        pytest.skip("this torch has no oneDNN linear")
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(cpu_linear.MIN_WEIGHT // 64 + 5, 64, generator=generator)
    x = torch.randn(1, 8, 64, generator=generator)
    assert torch.equal(cpu_linear.linear(x, w), cpu_gemv.gemv(x, w))
    many = torch.randn(cpu_gemv.MAX_ROWS + 3, 64, generator=generator)
    _assert_fp32_rounding(cpu_linear.linear(many, w), many, w)
    w16, x16 = w.bfloat16(), x.float()  # a bf16 decode: the kept bf16 copy, the fp32 stream
    if cpu_gemv.available(torch.bfloat16):
        assert torch.equal(cpu_linear.few_rows_bf16(x16, w16), cpu_gemv.gemv(x16.bfloat16(), w16))
    assert cpu_linear.few_rows_bf16(x16, w16[:100]) is None  # a small weight: F.linear
    assert cpu_linear.few_rows_bf16(many, w16) is None  # many rows: oneDNN's bf16 GEMM
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    assert not cpu_linear._gemv_enabled() and cpu_linear._onednn_op() is not None
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    assert not cpu_linear._gemv_enabled() and cpu_linear._onednn_op() is None
    monkeypatch.delenv(cpu_linear.ENV)
    assert cpu_linear._gemv_enabled()
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_build_is_cached_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    library = cpu_gemv.build(tmp_path)
    assert library.parent == tmp_path and library.exists()
    stamp = library.stat().st_mtime_ns
    assert cpu_gemv.build(tmp_path) == library and library.stat().st_mtime_ns == stamp
    monkeypatch.setenv("CC", "false")  # a compiler that fails: another key, no library
    with pytest.raises(RuntimeError, match="cpu_gemv.c.*failed"):
        cpu_gemv.build(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.name]  # no partial file
