"""Per-step wall time, end-to-end tokens/s and (on GPUs) MFU, for every trainer's metrics.

``step_throughput(seconds, tokens, model_flops)`` gives the three scalars each trainer adds to
its step metrics (``metrics.jsonl`` and TensorBoard): ``time/step_s``,
``throughput/tokens_per_s`` (every real token the step processed, prompt and response, over
all data-parallel replicas) and, on a GPU the hardware table knows, ``throughput/mfu`` (model
FLOPs counted as in :mod:`megatron_rlhf.planning.hardware`: 6N + attention per trained token,
2N + attention per forward-only token, over the world's dense bf16 peak).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.planning import hardware
from megatron_rlhf.planning.shapes import model_params, shape_of


def step_throughput(seconds: float, tokens: float, model_flops: float) -> dict:
    """The step's time, tokens/s and (GPU) MFU over every rank of the launch."""
    seconds = max(seconds, 1e-9)
    metrics = {"time/step_s": seconds, "throughput/tokens_per_s": tokens / seconds}
    gpu = hardware.cuda_gpu()
    if gpu is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        metrics["throughput/mfu"] = hardware.mfu(model_flops, seconds, world, gpu)
    return metrics


def train_flops(arch, tokens: float, seq_len: int) -> float:
    """Model FLOPs of training ``tokens`` tokens of sequences ``seq_len`` long."""
    per_token = hardware.train_flops_per_token(
        model_params(shape_of(arch)), arch.num_layers, arch.hidden_size, seq_len
    )
    return per_token * tokens


def forward_flops(arch, tokens: float, seq_len: int) -> float:
    """Model FLOPs of a forward pass over ``tokens`` tokens (scoring, generation)."""
    per_token = hardware.forward_flops_per_token(
        model_params(shape_of(arch)), arch.num_layers, arch.hidden_size, seq_len
    )
    return per_token * tokens


def global_token_count(mask: torch.Tensor, group) -> float:
    """Real tokens in ``mask`` summed over the data-parallel ``group`` (None: this rank)."""
    return summed_over((mask != 0).sum(), group)  # a packed mask holds sequence ids


def summed_over(value: torch.Tensor, group) -> float:
    """A scalar tensor summed over ``group`` (None: this rank's), on the tensor's device."""
    total = value.to(torch.float64).reshape(1)
    if group is not None:
        dist.all_reduce(total, group=group)
    return float(total)


def ppo_step_flops(roles, tokens: float, seq_len: int, epochs: int) -> float:
    """A PPO step's model FLOPs: the rollout and four scoring passes forward, then ``epochs``
    updates of the actor and the critic (rollout counted as one forward over every token)."""
    flops = 2 * forward_flops(roles.actor.arch, tokens, seq_len)  # rollout + old log-probs
    flops += forward_flops(roles.reference.arch, tokens, seq_len)
    flops += forward_flops(roles.critic.arch, tokens, seq_len)
    if roles.reward is not None:
        flops += forward_flops(roles.reward.arch, tokens, seq_len)
    flops += epochs * train_flops(roles.actor.arch, tokens, seq_len)
    return flops + epochs * train_flops(roles.critic.arch, tokens, seq_len)


def train_step_throughput(arch, microbatches: list[dict], seconds: float, groups) -> dict:
    """``step_throughput`` of one ``TrainEngine.step`` over ``microbatches`` (this rank's share
    of the global batch; real tokens from ``padding_mask``, summed over the data-parallel group
    of ``groups``, the trained model's ProcessGroupCollection). Attention FLOPs are counted at
    the mean sequence length (a packed row's mask holds sequence ids 1..k, a padded row's 1)."""
    group = groups.dp if groups.dp.size() > 1 else None
    mask = torch.cat([mb["padding_mask"].reshape(-1) for mb in microbatches])
    tokens = global_token_count(mask, group)
    sequences = summed_over(
        sum(mb["padding_mask"].amax(dim=-1).sum() for mb in microbatches), group
    )
    mean_length = max(1, round(tokens / max(sequences, 1.0)))
    return step_throughput(seconds, tokens, train_flops(arch, tokens, mean_length))
