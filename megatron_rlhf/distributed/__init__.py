"""Distributed setup (torch.distributed + Megatron-Core parallel state) and the CPU layer.

The names below load ``parallel.py`` (and torch) on first use, so the pure modules of this
package (``layouts.py``: the layout config, type and validator, and the ``--parallel`` flags)
import without torch and every command's ``--help`` stays fast.
"""

import importlib

from megatron_rlhf.utils import at_command_end

__all__ = [
    "compute_device",
    "destroy",
    "init_process_group",
    "initialize",
    "initialize_layouts",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.parallel"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _destroy() -> None:
    from megatron_rlhf.distributed.parallel import destroy

    destroy()


at_command_end(_destroy, distributed=True)  # a command run distributed tears its groups down
