"""A few rows times a large fp32 matrix on an AVX-512 CPU: our own kernel (``cpu_gemv.c``).

A decode step's LM head is such a product: 8 rows x 1,024 x 250,880 at BLOOM-560m's width, the
1 GB vocabulary matrix read once for 8 rows. Measured on the 2-core AMD EPYC benchmark VM (Zen 4,
torch 2.13, read bandwidth ~33 GB/s, so a 31 ms bound): this kernel 38-42 ms, oneDNN's inner
product 56-66 ms, MKL's 112-166 ms. It also wins on the trunk's 8-row products (1,024 x 3,072:
0.31 ms against oneDNN's 0.47-0.52) and up to ~24 rows; at 32 rows and more oneDNN's blocked
GEMM is as fast or faster, so :data:`MAX_ROWS` bounds where it runs. In bf16 (a ``train.bf16``
run's decode, on a CPU with AVX-512-bf16) the same product, 0.5 GB read, takes 14-20 ms against
oneDNN's bf16 product's 33-43 ms (a 16 ms bound).

It is built on first use and called through ``ctypes`` on torch's own OpenMP threads
(``_cpu_build.py``); where it cannot run (no AVX-512, no compiler, a failed build),
:func:`available` is False and callers keep oneDNN's product.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import _cpu_build

SOURCE = Path(__file__).with_name("cpu_gemv.c")
MAX_ROWS = 24
"""Most rows of x it takes (oneDNN's GEMM is as fast from ~32 rows on: module docstring)."""


def build(directory: Path | None = None) -> Path:
    """Compile ``cpu_gemv.c`` (once per source and flags) and return the library's path."""
    return _cpu_build.build(SOURCE, directory)


@functools.cache
def _library():
    """The built library with its functions' signatures, or None where it cannot run here."""
    library = _cpu_build.load(SOURCE, "oneDNN's product")
    if library is None:
        return None
    i64, pointer, threads = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fp32, bf16 = library.megatron_rlhf_gemv, library.megatron_rlhf_gemv_bf16
    fp32.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, pointer, i64, threads]
    bf16.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, i64, threads]
    fp32.restype = bf16.restype = None
    return library


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel runs on this machine in ``dtype`` (fp32, or bf16 where the CPU has
    AVX-512-bf16); builds it on the first call."""
    if dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported():
        return False
    return dtype in (torch.float32, torch.bfloat16) and _library() is not None


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` takes ``F.linear(input, weight, bias)``: on a CPU, fp32 or bf16
    (no bias), at most :data:`MAX_ROWS` rows, a contiguous weight, rows of input with unit
    stride. (Autograd and autocast are the caller's to rule out: ``models/cpu_linear.py``.)"""
    rows = input.numel() // max(input.shape[-1], 1)
    return (
        0 < rows <= MAX_ROWS
        and input.device.type == weight.device.type == "cpu"
        and input.dtype == weight.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and input.shape[-1] == weight.shape[1] > 0
        and (bias is None or (bias.dtype == torch.float32 == input.dtype and bias.is_contiguous()))
        and available(input.dtype)
    )


def gemv(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a few rows: (..., K) x (N, K) -> (..., N), where
    :func:`applies`. bf16 sums in fp32 and returns them rounded to bf16, as oneDNN's bf16
    product does."""
    rows, (n, k) = input.numel() // input.shape[-1], weight.shape
    flat = input.reshape(rows, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    operands = (flat.data_ptr(), flat.stride(0), rows, weight.data_ptr(), n, k)
    if input.dtype == torch.bfloat16:
        _library().megatron_rlhf_gemv_bf16(*operands, out.data_ptr(), n, torch.get_num_threads())
        out = out.to(torch.bfloat16)
    else:
        bias_pointer = None if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        _library().megatron_rlhf_gemv(*operands, bias_pointer, out.data_ptr(), n, threads)
    return out.reshape(*input.shape[:-1], n)
