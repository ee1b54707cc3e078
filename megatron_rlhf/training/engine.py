"""One trainable model on Megatron-Core: DDP + Megatron optimizer + LR schedule + schedules.

``TrainEngine(model, OptimConfig(...), total_steps)`` wraps a :class:`BloomModel` in
Megatron-Core's ``DistributedDataParallel`` and builds Megatron's optimizer (the distributed
optimizer on GPUs; the plain FP32 optimizer on CPU, whose checkpoints resume exactly) and its
``OptimizerParamScheduler`` (linear warm-up over ``warmup_fraction`` of the steps, then cosine to
``min_lr_ratio * lr``, the paper's reward-model schedule). ``step(microbatches, loss_fn)`` runs
Megatron's forward-backward schedule (1F1B across pipeline stages) over the microbatches of one
global batch on this data-parallel rank, then one optimizer step.

``loss_fn(output, microbatch) -> (loss, {name: scalar tensor})`` sees the last stage's output:
this rank's vocab shard of the logits for an LM head, (B, S, n) for a scalar head. The loss
of each microbatch is averaged over microbatches (and data-parallel replicas, by DDP).
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_rlhf.models.bloom import vocab as vocab_layers
from megatron_rlhf.models.precision import compute_precision
from megatron_rlhf.runtime import memory
from megatron_rlhf.training.config import OptimConfig
from megatron_rlhf.training.guards import UPDATE_SKIPPED, step_is_finite
from megatron_rlhf.training.optimizer_state import (
    load_optimizer_state,
    start_adam_state,
    zero_checkpoint_padding,
)


class TrainEngine:
    """A model, its DDP wrapper, optimizer and LR schedule, and a pipelined train step."""

    def __init__(
        self,
        model,
        optim: OptimConfig,
        total_steps: int,
        checkpoint_prefix: str = "",
        *,
        distributed_optimizer: bool | None = None,
    ):
        """Every collective runs on ``model.pg_collection``, the groups the model was built on
        (one layout among several, or the launch's only one). ``distributed_optimizer``: None
        picks Megatron-Core's distributed optimizer on GPUs and its plain FP32 one on the CPU;
        True on the CPU is for tests of the GPU's optimizer code (it needs CUDA-typed
        parameters, see tests/test_distributed_optimizer.py)."""
        self.module = model
        self.checkpoint_prefix = checkpoint_prefix  # e.g. "critic." when roles share a checkpoint
        self.groups = model.pg_collection
        if distributed_optimizer is None:
            distributed_optimizer = torch.cuda.is_available()
        if next(model.parameters()).device.type == "cpu":
            memory.keep_freed_memory()  # a training run's big CPU buffers reuse freed memory
        self._build(model, optim, total_steps, distributed_optimizer)

    def _build(
        self, model, optim: OptimConfig, total_steps: int, use_distributed_optimizer: bool
    ) -> None:
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        groups = self.groups  # the model's own layout, passed to everything below
        self.model = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=model, pg_collection=groups
        )
        if not ddp_config.overlap_grad_reduce:  # no bucket waits on a gradient hook
            vocab_layers.opt_in(model)  # vocabulary gradients straight into main_grad
        config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=groups)
        config.no_sync_func = self.model.no_sync
        config.variable_seq_lengths = False
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.lr * optim.min_lr_ratio,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=use_distributed_optimizer,
            ),
            [self.model],
            use_gloo_process_groups=False,
            pg_collection=groups,
        )
        fuse_cpu_adam(self.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)
        self.steps_done = 0
        self.clip_grad = optim.clip_grad
        self.checkpoint_sharding = optim.checkpoint_sharding

    def step(self, microbatches: list[dict], loss_fn, forward_only: bool = False) -> dict:
        """Forward/backward over ``microbatches`` (same shapes), then one optimizer step.

        Each microbatch holds ``input_ids`` (B, S) and ``padding_mask`` (B, S) plus whatever
        ``loss_fn`` reads. Returns the microbatch-averaged metrics (last stage; empty elsewhere)
        plus ``lr``, ``grad_norm``, ``time/optimizer_s`` (the gradient norm, clipping and
        optimizer step) and ``update_skipped`` (1.0 when a non-finite loss or grad
        norm on any rank skipped the update; the trainer's NonFiniteGuard decides what next).
        """
        self.model.train(not forward_only)
        if not forward_only:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        batch, seq = microbatches[0]["input_ids"].shape
        groups = self.groups
        forward_backward = get_forward_backward_func(pp_size=groups.pp.size())
        with compute_precision(self.module):  # bf16 products on a CPU; never the update
            losses = forward_backward(
                forward_step_func=partial(_forward_step, loss_fn),
                data_iterator=iter(microbatches),
                model=[self.model],
                num_microbatches=len(microbatches),
                seq_length=seq,
                micro_batch_size=batch,
                forward_only=forward_only,
                p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=self.module.config),
                pg_collection=groups,
            )
        metrics = average_metrics(losses, groups)
        if not forward_only:
            start = time.perf_counter()
            metrics |= self._update(metrics.get("loss"))
            metrics["time/optimizer_s"] = time.perf_counter() - start
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    @torch.no_grad()
    def _update(self, loss: float | None) -> dict:
        """Megatron's ``optimizer.step()`` split open (as ``ChainedOptimizer.step`` does it) so
        that a non-finite loss or gradient norm on any rank skips the update on every rank:
        weights, optimizer state and LR schedule stay as they were (training/guards.py)."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float("nan") if found_inf else float(self.optimizer.get_grad_norm())
        if not step_is_finite(loss, grad_norm):
            return {"grad_norm": grad_norm, UPDATE_SKIPPED: 1.0}
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        clip_coeff = self.clip_grad / (grad_norm + 1.0e-6)  # Megatron's coefficient
        folded = []
        if self.clip_grad > 0 and clip_coeff < 1.0:
            for optimizer in chained:
                if fold_clip_into_cpu_adam(optimizer, clip_coeff):
                    folded.append(optimizer.optimizer)
                elif optimizer.get_parameters():
                    # looked up on the module: the CPU compatibility layer replaces it there
                    megatron_optimizer.clip_grad_by_total_norm_fp32(
                        optimizer.get_parameters(), self.clip_grad, grad_norm
                    )
        try:
            if not self.optimizer.step_with_ready_grads():
                raise FloatingPointError("Megatron optimizer refused a step with finite gradients")
        finally:
            for inner in folded:
                del inner.grad_scale
        self.scheduler.step(increment=1)
        self.steps_done += 1
        return {"grad_norm": grad_norm, UPDATE_SKIPPED: 0.0}

    def sharded_state_dict(self, is_loading: bool = False, sharding: str | None = None) -> dict:
        """Model and optimizer state for Megatron's dist_checkpointing (any layout for the
        model; the optimizer state follows the model's sharding). ``is_loading`` allocates
        the optimizer state first so that it can be loaded into. ``sharding`` is the
        distributed optimizer's checkpoint format (default: ``optim.checkpoint_sharding``;
        a load passes the one the checkpoint was saved in). It is always passed: without it
        Megatron-Core 0.16.1's distributed optimizer picks ``fully_sharded_model_space``,
        whose tensors its own validation refuses, so every GPU save raised."""
        start_adam_state(self.optimizer)  # MCore's torch-Adam path asserts one step count
        model_state = self.module.sharded_state_dict(prefix=self.checkpoint_prefix)
        metadata = {"distrib_optim_sharding_type": sharding or self.checkpoint_sharding}
        optimizer_state = self.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        )
        zero_checkpoint_padding(optimizer_state)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        prefix = self.checkpoint_prefix
        self.module.load_state_dict({k.removeprefix(prefix): v for k, v in loaded["model"].items()})
        load_optimizer_state(self.optimizer, loaded["optimizer"])
        fuse_cpu_adam(self.optimizer)  # a loaded state brings its param groups' flags

    def scheduler_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "steps_done": self.steps_done}

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]


def fuse_cpu_adam(optimizer) -> None:
    """Run torch's fused Adam kernel on CPU parameters.

    Without Transformer Engine or Apex, Megatron-Core builds ``torch.optim.Adam``/``AdamW``
    with torch's defaults, and for CPU tensors those pick the per-tensor loop (``foreach`` and
    ``fused`` are CUDA defaults): at 307M parameters (BLOOM-560m's vocabulary, 4 layers) one
    step takes 1.2-1.7 s on 2 cores against 0.17 s fused, and a PPO step makes two (actor and
    critic). The fused kernel computes the same update up to rounding. GPU parameters keep what Megatron-Core chose (TE/Apex fused Adam, or torch's CUDA
    default)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.device.type == "cpu" for p in group["params"]):
                group.update(fused=True, foreach=False, differentiable=False, capturable=False)


def fold_clip_into_cpu_adam(optimizer, clip_coeff: float) -> bool:
    """Have torch's fused CPU Adam scale the gradients by ``clip_coeff`` as it reads them,
    instead of a clipping sweep that rewrites every gradient first; return whether it will.

    Clipping by the total norm multiplies every gradient by one coefficient before the step.
    The fused kernel divides each gradient it reads by the optimizer's ``grad_scale`` (the hook
    ``torch.amp.GradScaler`` uses to unscale), before the weight decay and the moments, which is
    the same update without the sweep: at BLOOM-560m's 614M trained parameters (actor and critic)
    the sweep reads and writes 2.5 GB, ~0.07 s a step on the 2-core benchmark VM. Equal to
    rounding: ``g / (1 / c)`` against ``g * c``. Applies where :func:`fuse_cpu_adam` made every
    param group fused CPU Adam; elsewhere (GPUs, other optimizers) Megatron's clipping runs.
    The caller deletes ``grad_scale`` after the step."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    groups = [group for group in inner.param_groups if group["params"]]
    if not groups or not all(
        group["fused"] and all(p.device.type == "cpu" for p in group["params"]) for group in groups
    ):
        return False
    inner.grad_scale = torch.tensor(1.0 / clip_coeff, dtype=torch.float32)
    return True


def build_lr_scheduler(optimizer, optim: OptimConfig, total_steps: int):
    """Megatron's ``OptimizerParamScheduler`` on ``optimizer``'s param groups: linear warm-up
    from 0 over ``optim.warmup_fraction`` of the steps, then cosine to ``min_lr_ratio * lr``."""
    warmup = int(math.ceil(optim.warmup_fraction * total_steps))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style="cosine",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


def _forward_step(loss_fn, data_iterator, model):
    device = next(model.parameters()).device
    microbatch = {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in next(data_iterator).items()
    }
    positions = microbatch.get("output_positions")  # only these columns' outputs (BloomModel)
    kwargs = {} if positions is None else {"output_positions": positions}
    output = model(microbatch["input_ids"], microbatch["padding_mask"], **kwargs)
    return output, partial(_loss_on_last_stage, loss_fn, microbatch)


def _loss_on_last_stage(loss_fn, microbatch, output):
    loss, metrics = loss_fn(output, microbatch)
    # clone: the schedule divides the returned loss by num_microbatches in place, which would
    # also shrink a detached view of it (schedules.py:269)
    return loss, {"loss": loss.detach().clone(), **{k: v.detach() for k, v in metrics.items()}}


def average_metrics(per_microbatch: list[dict], groups=None) -> dict:
    """Mean of each metric over the microbatches (last pipeline stage of ``groups``, a model's
    ProcessGroupCollection; None: no pipeline, as under DeepSpeed). Empty on other stages."""
    last_stage = groups is None or groups.pp.rank() == groups.pp.size() - 1
    if not per_microbatch or not last_stage:
        return {}
    keys = per_microbatch[0].keys()
    return {k: float(torch.stack([m[k].float() for m in per_microbatch]).mean()) for k in keys}
