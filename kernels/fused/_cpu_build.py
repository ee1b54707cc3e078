"""Build and load our C kernels for the CPU (``cpu_gemv.c``, ``cpu_logprobs.c``, ``cpu_norm.c``).

Each C source is compiled once per source and machine, on first use, with the host's C compiler
(``$CC``, else ``cc``) into ``$MEGATRON_RLHF_KERNEL_CACHE`` (default
``~/.cache/megatron_rlhf/kernels``): a file named by the hash of the source and flags, written
under a temporary name and renamed, so concurrent processes never load a half-written library.
The sources are plain C with AVX-512 intrinsics and OpenMP (torch's own libgomp, already loaded,
runs their threads: one thread pool), called through ``ctypes`` (which releases the GIL). Where
the CPU lacks AVX-512, no compiler is found or the build fails, :func:`load` returns None (a
failed build warns once, naming the error) and callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

FLAGS = ("-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC")
CACHE_ENV = "MEGATRON_RLHF_KERNEL_CACHE"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "megatron_rlhf" / "kernels"
    return Path(os.environ.get(CACHE_ENV) or default)


def build(source: Path, directory: Path | None = None) -> Path:
    """Compile ``source`` (unless this source and these flags already are) and return the
    library's path. Raises ``RuntimeError`` naming the compiler's output on failure."""
    text = source.read_bytes()
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    library = directory / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=library.name, suffix=".partial", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", partial], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"building {source.name} with `{compiler}` failed:\n{result.stderr.strip()}"
            )
        os.replace(partial, library)  # whole or absent, whoever else builds it at once
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


@functools.cache
def load(source: Path, fallback: str) -> ctypes.CDLL | None:
    """``source``'s built library, or None where it cannot run here (module docstring);
    ``fallback`` names what runs instead, for the warning."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    try:
        return ctypes.CDLL(str(build(source)))
    except (OSError, RuntimeError) as error:
        warnings.warn(f"{source.name} is unavailable, using {fallback}: {error}", stacklevel=2)
        return None
