"""Training on Megatron-Core: DDP, optimizer, LR schedule, pipelined steps, exact resume."""

from megatron_rlhf.training.engine import OptimConfig, TrainEngine

__all__ = ["OptimConfig", "TrainEngine"]
