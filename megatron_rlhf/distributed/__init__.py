"""Distributed setup (torch.distributed + Megatron-Core parallel state) and the CPU layer."""

from megatron_rlhf.distributed.parallel import (
    ParallelConfig,
    compute_device,
    destroy,
    init_process_group,
    initialize,
    initialize_layouts,
    validate,
)
from megatron_rlhf.utils import at_command_end

at_command_end(destroy, distributed=True)  # a command run distributed tears its groups down

__all__ = [
    "ParallelConfig",
    "compute_device",
    "destroy",
    "init_process_group",
    "initialize",
    "initialize_layouts",
    "validate",
]
