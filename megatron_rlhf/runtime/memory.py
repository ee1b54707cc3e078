"""Keep freed CPU memory in the process, as a GPU caching allocator keeps freed device memory.

torch's CPU allocator is glibc's ``malloc``, which serves every block above its mmap threshold
(at most 32 MB) with a fresh ``mmap`` and returns it to the kernel on ``free``. At BLOOM's
vocabulary a PPO step makes six such blocks that could reuse each other's memory (scoring's and
the update's 128 x 250,880 fp32 logits, 128 MB each, and the update's logit gradients), and each
fresh one costs a page fault and a kernel zeroing every 4 KB on first touch: ~190K faults and
0.3-1.8 s of system CPU time a step at BLOOM-560m's shapes on the 2-core benchmark VM. With
mmap off and the heap never trimmed (``mallopt``'s documented ``M_MMAP_MAX = 0`` and
``M_TRIM_THRESHOLD = -1``), glibc serves them from the heap's free lists instead: ~10 faults a
step. The cost is the one every caching allocator has: the process holds its high-water mark
until it ends, and a freed block in the middle of the heap serves only requests it fits (the
benchmark's peak resident memory: median 12.26 GB against 12.29, but 12.70 in two of six runs;
``benchmarks/bench_ppo_real_shapes.py`` reports it). Switched on by every training engine on a
CPU (``training/engine.py``).

``MEGATRON_RLHF_CPU_MALLOC=system`` keeps glibc's defaults (for side-by-side measurements).
Elsewhere than glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import os
import platform

from megatron_rlhf.runtime.processes import _LIBC

ENV = "MEGATRON_RLHF_CPU_MALLOC"
M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_MAX = -4

_kept = False


def keep_freed_memory() -> bool:
    """Switch glibc's allocator to keep freed memory for reuse (once per process); return
    whether it is on. Call it before the large allocations of a CPU run."""
    global _kept
    if _kept:
        return True
    if os.environ.get(ENV, "keep").lower() == "system":
        return False
    if _LIBC is None or platform.libc_ver()[0] != "glibc" or not hasattr(_LIBC, "mallopt"):
        return False
    # mallopt returns 1 on success; -1 as M_TRIM_THRESHOLD turns trimming off (mallopt(3))
    _kept = bool(_LIBC.mallopt(M_MMAP_MAX, 0)) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, -1))
    return _kept
