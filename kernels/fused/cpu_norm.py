"""Sums of squares of fp32 tensors on a CPU, accurate at any size: what a gradient norm reduces.

torch's CPU norm of an fp32 tensor accumulates in fp32 across each thread's whole run of the
values, so its error grows with the tensor's size. For values of one magnitude (randn), against
float64: -1.1e-5 at 1M values, -5.4e-3 at 64M, **-3.6e-2 at BLOOM's 257M-value vocabulary
gradient** (2 threads; one thread the same). Real gradients, whose norm a few large values carry,
lose less: the actor's and critic's norms in a PPO step at BLOOM-560m's shapes (307M values each)
came out 5.4e-5 to 7.7e-5 low, always low. Megatron-Core without Apex or Transformer Engine takes
its gradient norm that way (``local_multi_tensor_l2_norm``: ``torch.norm`` per gradient), so on a
CPU the logged ``grad_norm`` and a clipped step's coefficient carried that bias. GPUs reduce in a
tree and are not affected.

:func:`sum_of_squares` sums blocks of 4,096 values in fp32 lanes and the blocks in fp64
(``cpu_norm.c``; within 1e-8 of float64 at 257M values and in those PPO steps, one read of
the values: 33-37 ms at 257M against ``torch.norm``'s 39-42 on the 2-core benchmark VM). Where
the kernel cannot run (no AVX-512, no compiler, another dtype or a non-contiguous tensor) the
same blocking runs in PyTorch: fp32 dot products of 2^16 values summed in fp64.
:func:`l2_norm` is the drop-in for Megatron-Core's ``l2_norm_impl`` that
``distributed/cpu_compat.py`` installs.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from . import _cpu_build

SOURCE = Path(__file__).with_name("cpu_norm.c")
CHUNK = 1 << 16  # values per fp32 partial sum on the PyTorch path


@functools.cache
def _library():
    library = _cpu_build.load(SOURCE, "fp32 partial sums in PyTorch")
    if library is not None:
        function = library.megatron_rlhf_sum_squares
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        function.restype = ctypes.c_double
    return library


def sum_of_squares(tensor: torch.Tensor) -> float:
    """The sum of ``tensor``'s squared values, accurate to fp32 rounding at any size (a float:
    fp64). Non-finite values give a non-finite sum."""
    tensor = tensor.detach()
    if (
        tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and tensor.is_contiguous()
        and _library() is not None
    ):
        return _library().megatron_rlhf_sum_squares(
            tensor.data_ptr(), tensor.numel(), torch.get_num_threads()
        )
    flat = tensor.reshape(-1).float()
    return math.fsum(float(torch.dot(chunk, chunk)) for chunk in flat.split(CHUNK))


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s signature and result for CPU tensors (as Megatron-Core's
    ``local_multi_tensor_l2_norm``, which it replaces): the norm of all of ``tensor_lists[0]``
    as one vector, a 1-element fp32 tensor, and with ``per_tensor`` each tensor's norm."""
    sums = [sum_of_squares(tensor) for tensor in tensor_lists[0]]
    norm = torch.tensor([math.sqrt(math.fsum(sums))], dtype=torch.float32)
    return norm, torch.tensor([math.sqrt(s) for s in sums]) if per_tensor else None
