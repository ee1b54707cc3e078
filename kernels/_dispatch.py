"""Choose between the Triton kernels and the PyTorch reference path.

Triton runs when it is importable and the tensor is on a CUDA device, or when
``TRITON_INTERPRET=1`` was set before this package was imported (Triton's interpreter then runs the
same kernels on CPU tensors, exactly but slowly: that is how the kernels are tested without a GPU).
Triton reads that variable when a kernel is decorated, so it must be set before the first import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

# Guarded: triton is an optional GPU dependency, imported (by triton_*.py) only when used.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_pytorch_only = False


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` should go through the Triton kernels."""
    return HAVE_TRITON and not _pytorch_only and (tensor.is_cuda or INTERPRET)


@contextlib.contextmanager
def pytorch_only() -> Iterator[None]:
    """Run every kernel of this package on its PyTorch path inside the block.

    For comparing the Triton kernels against the reference on the same (GPU) tensors.
    """
    global _pytorch_only
    previous, _pytorch_only = _pytorch_only, True
    try:
        yield
    finally:
        _pytorch_only = previous
