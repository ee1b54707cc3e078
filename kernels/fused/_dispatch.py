"""Choose between the Triton kernels and the PyTorch reference path.

Triton runs when it is importable and the tensor is on a CUDA device, or when
``TRITON_INTERPRET=1`` was set before this package was imported (Triton's interpreter then runs the
same kernels on CPU tensors, exactly but slowly: that is how the kernels are tested without a GPU).
Triton reads that variable when a kernel is decorated, so it must be set before the first import.

On a GPU the first call probes Triton once (compiles and launches a one-element kernel): Triton
builds its launcher with the host C compiler and ``Python.h`` on first launch, so a machine
without them would otherwise fail in every kernel call. A failed probe warns once, naming the
error, and every kernel takes its PyTorch path (correct, slower).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Iterator

import torch

# Guarded: triton is an optional GPU dependency, imported (by triton_*.py) only when used.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_pytorch_only = False


def _interpreter_index_of_size_one_arrays() -> None:
    """Triton < 3.7's interpreter turns a scalar kernel argument (a NumPy array of shape (1,))
    into a Python int with ``int(array)`` (``range(0, n)`` in a kernel), which NumPy >= 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.7+ squeezes
    the array first. Triton 3.6 is what torch 2.11 (the GPU image's) pins, so the interpreter
    tests would fail there on every kernel with a loop: the same fix, applied to old versions
    in interpreter mode only (compiled kernels never take this path)."""
    import triton
    import triton.runtime.interpreter as interpreter

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if (major, minor) >= (3, 7) or patch_tensor is None or getattr(patch_tensor, "squeezes", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes = True
    interpreter._patch_lang_tensor = patched


if INTERPRET and HAVE_TRITON:
    _interpreter_index_of_size_one_arrays()


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` should go through the Triton kernels."""
    if not HAVE_TRITON or _pytorch_only:
        return False
    return INTERPRET or (tensor.is_cuda and triton_launches())


@functools.cache
def triton_launches() -> bool:
    """Whether a Triton kernel compiles and runs on this GPU (probed once per process)."""
    try:
        from .triton_probe import probe

        probe()
    except Exception as err:  # no compiler, no Python.h, an unsupported GPU, a driver error
        warnings.warn(
            f"Triton cannot compile or launch a kernel here ({type(err).__name__}: {err}); "
            "the log-prob, advantage and attention kernels take their PyTorch paths",
            stacklevel=2,
        )
        return False
    return True


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
