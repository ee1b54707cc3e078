"""Training on Megatron-Core: DDP, optimizer, LR schedule, pipelined steps, exact resume."""

from megatron_rlhf.utils import lazy_exports

# Imported on first use, so a trainer's command line parses before megatron-core loads.
_EXPORTS = {"OptimConfig": "config", "TrainEngine": "engine"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
