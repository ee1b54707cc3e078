"""A one-element Triton kernel: does Triton compile and launch on this machine's GPU?"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def probe() -> None:
    """Raise unless the kernel compiles, launches and computes 1 + 1 on the current GPU."""
    x = torch.ones(1, device="cuda", dtype=torch.float32)
    _add_one[(1,)](x)
    if x.item() != 2.0:
        raise RuntimeError(f"the probe kernel computed {x.item()} for 1 + 1")
