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

__all__ = [
    "ParallelConfig",
    "compute_device",
    "destroy",
    "init_process_group",
    "initialize",
    "initialize_layouts",
    "validate",
]
