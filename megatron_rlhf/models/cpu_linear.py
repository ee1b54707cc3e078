"""fp32 linears on a CPU through oneDNN's matmul rather than MKL's sgemm.

``F.linear`` on a CPU hands fp32 products to MKL. At BLOOM's shapes on the 2-core AMD EPYC
benchmark VM (AVX-512, torch 2.13's MKL 2024.2 and oneDNN 3.12) oneDNN's inner-product kernel
is faster at every shape a PPO step runs (``benchmarks/roofline.py`` times both):

- a decode step's LM head, 8 rows x 1,024 x 250,880 (reads the 1 GB vocabulary matrix):
  56 ms against MKL's 112 ms as ``weight @ hidden^T`` and 166 ms as ``F.linear``;
- a scoring or update micro-batch's LM head, 128 rows: 367 ms against 609 ms;
- the trunk's linears at 8 rows (a decode step) 1.4-2.2x, at 128-192 rows 1.3-1.6x;
- the LM head's input gradient, (128 x 250,880) @ (250,880 x 1,024): 384 ms against 476 ms.

The weight gradient ``grad^T @ input`` stays with MKL (oneDNN was slower: 691 ms against 350).
So do small products: a oneDNN call costs ~10-20 us more than MKL's, which loses below a weight
of ~256K values (8 rows x 128 x 512: 24 us against 16; 8 x 256 x 1,024 already gains, 54 against
61). On the tiny BLOOM (hidden 128, vocabulary 512) oneDNN everywhere made the PPO step 9 %
slower; no weight of it reaches :data:`MIN_WEIGHT`, so it runs as before.

:func:`linear` is ``F.linear`` with oneDNN underneath where it applies: CPU fp32 tensors outside
autocast (a ``train.bf16`` run's products go through autocast's bf16 path unchanged), weights of
at least :data:`MIN_WEIGHT` values, and no
autograd (``torch.ops.mkldnn._linear_pointwise`` has no derivative: an inference forward, or the
forward or backward of an autograd ``Function``). Anywhere else (a GPU, bf16, fp64, a tensor
that needs a gradient) it is ``F.linear`` itself. The op is torch's own (the one its CPU compiler
emits for linears); it reads the dense fp32 weight as it is, with no packed copy, so a weight
that changes every step costs nothing extra. Its sums run in another order than MKL's: equal to
fp32 rounding (``tests/test_cpu_linear.py`` against float64).

A few rows (at most ``cpu_gemv.MAX_ROWS``: a decode step) times a contiguous weight go to our own
AVX-512 kernel instead (``kernels/fused/cpu_gemv.c``): the decode step's vocabulary product in
38-42 ms against oneDNN's 56-66 (the 1 GB matrix at a ~33 GB/s read bandwidth: a 31 ms bound),
the trunk's 8-row products ~1.5x oneDNN's. Where it cannot run (no AVX-512, no C compiler) the
product stays with oneDNN.

``MEGATRON_RLHF_CPU_LINEAR`` chooses, for side-by-side measurements: ``onednn`` turns our kernel
off (oneDNN for every product above); ``mkl`` turns both off (``F.linear`` everywhere, and a bf16
decode's vocabulary product back to MKL's ``weight @ hidden^T``: ``vocab.vocab_projection``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from megatron_rlhf.kernels import cpu_gemv

ENV = "MEGATRON_RLHF_CPU_LINEAR"


def _onednn_op():
    """torch's oneDNN linear, or None where this torch has none (no oneDNN, another version)."""
    if os.environ.get(ENV, "gemv").lower() == "mkl" or not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _gemv_enabled() -> bool:
    """Whether our few-row kernel may run (:data:`ENV` neither ``onednn`` nor ``mkl``)."""
    return os.environ.get(ENV, "gemv").lower() not in ("onednn", "mkl")


_OP = _onednn_op()
_GEMV = _gemv_enabled()
MIN_WEIGHT = 1 << 18
"""Values of the smallest weight whose products go through oneDNN (1 MB in fp32)."""


def onednn_enabled() -> bool:
    """Whether this torch has oneDNN's linear and it is not switched off (:data:`ENV`)."""
    return _OP is not None


def onednn_applies(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs this product through oneDNN."""
    return (
        _OP is not None
        and input.device.type == "cpu"
        and input.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= MIN_WEIGHT
        and input.shape[-1] == weight.shape[1]
        and input.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
    )


def few_rows_bf16(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(input, weight)`` for a bf16 CPU weight (a ``train.bf16`` run's kept copy,
    ``models/precision.bf16_copy``) and a few rows, through our kernel's bf16 path: the input
    cast to bf16 as autocast casts it, the sums in fp32, the output rounded to bf16, as oneDNN's
    bf16 product under autocast gives it. None where it does not apply (more rows, a weight
    below :data:`MIN_WEIGHT`, no AVX-512-bf16, autograd, :data:`ENV` ``onednn`` or ``mkl``)."""
    if not (_GEMV and weight.dtype == torch.bfloat16 and input.device.type == "cpu"):
        return None
    if weight.numel() < MIN_WEIGHT or input.numel() > cpu_gemv.MAX_ROWS * input.shape[-1]:
        return None  # a small weight (F.linear) or many rows (oneDNN's bf16 GEMM): no cast
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad):
        return None
    rows = input.to(torch.bfloat16)
    return cpu_gemv.gemv(rows, weight) if cpu_gemv.applies(rows, weight) else None


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)``: (..., K) x (N, K) -> (..., N), through our kernel
    (a few rows) or oneDNN on a CPU in fp32 without autograd (module docstring), else
    ``F.linear``."""
    if not onednn_applies(input, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(input, weight, bias)
    if _GEMV and cpu_gemv.applies(input, weight, bias):  # a few rows: our AVX-512 kernel
        return cpu_gemv.gemv(input, weight, bias)
    return _OP(input.contiguous(), weight, bias, "none", [], "")
