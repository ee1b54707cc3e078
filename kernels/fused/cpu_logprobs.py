"""The log-prob kernel's statistics and gradient over fp32 or bf16 logits on an AVX-512 CPU
(``cpu_logprobs.c``): what ``logprobs.local_stats`` and ``logprobs.rows_grad`` compute, one
pass over each row from memory instead of the PyTorch path's 4-6; and the decode sampler's
draw at top-p 1 with its log-prob (:func:`sample`), three passes over a row's cached logits
instead of the softmax, cumulative sum, search and log-softmax (about 3 ms a decode step of 8 x
250,880 on the benchmark VM).

At BLOOM's vocabulary a scoring or update micro-batch's logits are 128 x 250,880 fp32 values
(128 MB). On the 2-core AMD EPYC benchmark VM the PyTorch path takes 26-36 ms forward and
52-69 ms backward there in a PPO step (this kernel: 8 ms and 7-9 ms; README). bf16 logits (a
``train.bf16`` run's) are read as they are and computed in fp32, with the gradient rounded once
to bf16 as the PyTorch path's copy rounds it: 6-7 ms each way against its 21-25 ms, which first
copies them to fp32. Each row's sums run in fp32 lanes over blocks of 1,024 values and in fp64
across them: as accurate as the PyTorch path (log-probs and entropies within ~1e-6 of float64 at
BLOOM's vocabulary; 16 lanes over the whole row were 20x worse). Built on first use and called
through ``ctypes`` on torch's OpenMP threads (``_cpu_build.py``); where it cannot run (no
AVX-512, no compiler, a failed build), or with ``MEGATRON_RLHF_CPU_LOGPROBS=torch``, the PyTorch
path runs. GPUs take the Triton kernels, fp64 logits the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from . import _cpu_build

SOURCE = Path(__file__).with_name("cpu_logprobs.c")
ENV = "MEGATRON_RLHF_CPU_LOGPROBS"


@functools.cache
def _library():
    library = _cpu_build.load(SOURCE, "the log-prob kernel's PyTorch path")
    if library is None:
        return None
    i64, pointer, fp32, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for suffix in ("", "_bf16"):
        stats = getattr(library, f"megatron_rlhf_logprob_stats{suffix}")
        grad = getattr(library, f"megatron_rlhf_logprob_grad{suffix}")
        stats.argtypes = [pointer, i64, i64, i64, pointer, fp32, flag, pointer, flag]
        grad.argtypes = [pointer, i64, i64, i64, pointer] + [pointer] * 4
        grad.argtypes += [fp32, pointer, i64, flag]
        stats.restype = grad.restype = None
    sample = library.megatron_rlhf_sample
    sample.argtypes = [pointer, i64, i64, i64, fp32, pointer, pointer, pointer, flag]
    sample.restype = None
    return library


def enabled() -> bool:
    """Whether the kernel may run (:data:`ENV` is not ``torch``) and runs on this machine."""
    return os.environ.get(ENV, "kernel").lower() != "torch" and _library() is not None


def applies(
    rows: torch.Tensor, *others: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> bool:
    """Whether the kernel takes these (n, V) rows (and same-shaped ``others``): CPU tensors of
    one of ``dtypes`` (the statistics and gradient take fp32 and bf16 logits, the sampler fp32),
    all of one dtype, whose rows have unit stride, on a machine where it runs."""
    return (
        rows.dtype in dtypes
        and all(
            t.device.type == "cpu" and t.dtype == rows.dtype and t.dim() == 2 and t.stride(1) == 1
            for t in (rows, *others)
        )
        and enabled()
    )


LOGITS = (torch.float32, torch.bfloat16)
"""What :func:`rows_stats` and :func:`rows_grad` take."""


def _suffix(rows: torch.Tensor) -> str:
    return "_bf16" if rows.dtype == torch.bfloat16 else ""


def _pointer(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.data_ptr()


def rows_stats(
    rows: torch.Tensor, local_targets: torch.Tensor, inv_temp: float, with_entropy: bool
) -> torch.Tensor:
    """``logprobs.STATS`` (4, n) of the (n, V) rows, as ``logprobs._rows_stats_torch``."""
    n_rows, vocab = rows.shape
    stats = torch.empty((4, n_rows), dtype=torch.float32)
    targets = local_targets.to(torch.int64).contiguous()
    getattr(_library(), "megatron_rlhf_logprob_stats" + _suffix(rows))(
        rows.data_ptr(), rows.stride(0), n_rows, vocab, targets.data_ptr(), inv_temp,
        int(with_entropy), stats.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return stats


def rows_grad(
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    local_targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_lp: torch.Tensor,
    grad_ent: torch.Tensor | None,
    inv_temp: float,
) -> None:
    """Write ``logprobs.rows_grad``'s gradient of the (n, V) rows into ``grad_rows`` (their
    dtype; bf16 rounded once, to nearest even)."""
    n_rows, vocab = rows.shape
    targets = local_targets.to(torch.int64).contiguous()
    row_values = [v.to(torch.float32).contiguous() for v in (lse, entropy, grad_lp)]
    grad_ent = None if grad_ent is None else grad_ent.to(torch.float32).contiguous()
    getattr(_library(), "megatron_rlhf_logprob_grad" + _suffix(rows))(
        rows.data_ptr(), rows.stride(0), n_rows, vocab, targets.data_ptr(),
        *(v.data_ptr() for v in row_values), _pointer(grad_ent), inv_temp,
        grad_rows.data_ptr(), grad_rows.stride(0), torch.get_num_threads(),
    )  # fmt: skip


def sample(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (k,), log-probs (k,)): each row's token drawn from ``softmax(logits /
    temperature)`` (k, V) by inverse CDF at its uniform (k,), and its log-prob, as
    ``generation.decode``'s sampler at top-p 1 (:func:`applies` to ``logits``)."""
    n_rows, vocab = logits.shape
    tokens = torch.empty(n_rows, dtype=torch.int64)
    logprobs = torch.empty(n_rows, dtype=torch.float32)
    draws = uniforms.to(torch.float32).contiguous()
    _library().megatron_rlhf_sample(
        logits.data_ptr(), logits.stride(0), n_rows, vocab, 1.0 / temperature, draws.data_ptr(),
        tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return tokens, logprobs
