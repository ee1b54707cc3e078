"""One trainable Hugging Face BLOOM scalar model under DeepSpeed ZeRO (stage 1, 2 or 3).

The DeepSpeed-Chat / OpenRLHF way of training a reward model: transformers' ``BloomModel``
trunk plus a linear scalar head, data parallel only, with the optimizer state (ZeRO-1), the
gradients too (ZeRO-2) or also the parameters (ZeRO-3) partitioned over the ranks.
:class:`DeepSpeedTrainEngine` has :class:`~megatron_rlhf.training.TrainEngine`'s interface
(``step(microbatches, loss_fn, forward_only)``, ``module``), so the reward trainer, its
evaluation and its losses run unchanged on either engine.

What is shared with the Megatron engine, so that the two give the same numbers: the scalar
head's fixed-seed initialisation (models/bloom/model.py), torch's AdamW with Megatron's
parameter groups (no weight decay on biases and norms), Megatron's ``OptimizerParamScheduler``
(warm-up then cosine) driving the learning rate, gradient clipping by the global norm, and
the loss averaged over microbatches (DeepSpeed divides by its gradient-accumulation steps)
and data-parallel ranks.

Running on the CPU (tests, laptops): ``DS_ACCELERATOR=cpu`` is set when no GPU is present,
the ranks talk over the gloo group torch.distributed already has, the optimizer is torch's
AdamW (DeepSpeed's fused and CPU Adam ops would need a compiler at run time), and DeepSpeed's
shared-memory all-reduce op, which it compiles at start-up on a CPU machine (minutes) and only
uses for inference, is marked unavailable (:func:`_skip_cpu_only_op_builds`). bf16 needs a GPU.
"""

from __future__ import annotations

import os
import time

import torch

from megatron_rlhf.training.config import DeepSpeedConfig, OptimConfig
from megatron_rlhf.training.engine import average_metrics, build_lr_scheduler
from megatron_rlhf.training.guards import UPDATE_SKIPPED, NonFiniteError


def ensure_cpu_accelerator() -> None:
    """Point DeepSpeed at its CPU accelerator when no GPU is present (before importing it)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _skip_cpu_only_op_builds() -> None:
    """On a CPU machine DeepSpeed 0.19.8's ``TorchBackend`` JIT-compiles its shared-memory
    all-reduce op at start-up (comm/torch.py ``build_shm_op``; minutes on 2 cores) although
    training never calls it (only ``inference_all_reduce`` does); the compatibility table it
    consults is a module-level dict meant to be edited (ops/__init__.py)."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ScalarBloom(torch.nn.Module):
    """transformers' ``BloomModel`` trunk with a (hidden → n) scalar head.

    ``forward(input_ids, padding_mask)`` returns (B, S, n) float32, the output contract of the
    Megatron :class:`~megatron_rlhf.models.bloom.BloomModel` with ``head="scalar"``, so
    reward/model.py reads r and e_τ from it the same way. Parameter names are those of
    ``BloomForSequenceClassification`` (``transformer.*``, ``score.weight``) plus
    ``score.bias``, the names the Megatron side exports and imports.
    """

    def __init__(self, arch, num_scalar_outputs: int, dtype: torch.dtype = torch.float32):
        from transformers import BloomConfig, BloomModel

        from megatron_rlhf.models.bloom.model import init_replicated_head

        super().__init__()
        self.arch = arch
        self.head = "scalar"
        self.num_scalar_outputs = num_scalar_outputs
        self.vocab_size = arch.vocab_size  # no padding: the HF embedding is exactly the vocab
        self.transformer = BloomModel(BloomConfig(**arch.to_hf_dict())).to(dtype)
        self.score = torch.nn.Linear(arch.hidden_size, num_scalar_outputs)
        init_replicated_head(self.score, std=0.02)  # the Megatron head's initialisation
        self.score.to(dtype)

    @property
    def pg_collection(self):
        """The launch's process groups, as a Megatron model keeps its own: ZeRO is data
        parallel over every rank (TP = PP = 1), so these are the groups in force."""
        from megatron_rlhf.distributed.parallel import current_groups

        return current_groups()

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(
            input_ids=input_ids, attention_mask=padding_mask, use_cache=False
        ).last_hidden_state  # (B, S, H), after ln_f
        return self.score(hidden).float()  # (B, S, n)


class DeepSpeedTrainEngine:
    """A :class:`ScalarBloom` in a DeepSpeed engine with AdamW and the warm-up/cosine schedule."""

    def __init__(
        self,
        model: ScalarBloom,
        optim: OptimConfig,
        total_steps: int,
        zero: DeepSpeedConfig,
        *,
        micro_batch_size: int,
        num_microbatches: int,
        bf16: bool = False,
        activation_checkpointing: bool = False,
    ):
        ensure_cpu_accelerator()
        import deepspeed

        _skip_cpu_only_op_builds()
        if activation_checkpointing:
            model.transformer.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.module = model
        self.num_microbatches = num_microbatches
        optimizer = torch.optim.AdamW(
            _param_groups(model, optim.weight_decay),
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=_deepspeed_config(zero, optim, micro_batch_size, num_microbatches, bf16),
            dist_init_required=False,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)
        self.steps_done = 0

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def step(self, microbatches: list[dict], loss_fn, forward_only: bool = False) -> dict:
        """Forward/backward over ``microbatches``, then one optimizer step (as TrainEngine)."""
        self.engine.train(not forward_only)
        if len(microbatches) != self.num_microbatches and not forward_only:
            raise ValueError(
                f"{len(microbatches)} microbatches, DeepSpeed expects {self.num_microbatches}"
            )
        per_microbatch, optimizer_seconds = [], 0.0
        for microbatch in microbatches:
            microbatch = {
                key: value.to(self.device) if torch.is_tensor(value) else value
                for key, value in microbatch.items()
            }
            with torch.set_grad_enabled(not forward_only):
                output = self.engine(microbatch["input_ids"], microbatch["padding_mask"])
                loss, metrics = loss_fn(output, microbatch)
            per_microbatch.append({"loss": loss.detach().clone(), **metrics})
            if not forward_only:
                if not torch.isfinite(loss):
                    raise NonFiniteError(
                        f"non-finite loss {float(loss)} on rank {self.engine.global_rank}: the "
                        "run stops before any update (lower optim.lr or check the data)"
                    )
                self.engine.backward(loss)  # scaled by 1 / num_microbatches by DeepSpeed
                start = time.perf_counter()
                self.engine.step()  # the optimizer steps at the last microbatch only
                optimizer_seconds += time.perf_counter() - start
        metrics = average_metrics(per_microbatch)
        if not forward_only:
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else 0.0
            if not torch.isfinite(torch.tensor(grad_norm)):
                raise NonFiniteError(
                    f"non-finite gradient norm {grad_norm}: the run stops (lower optim.lr)"
                )
            self.scheduler.step(increment=1)
            self.steps_done += 1
            metrics["grad_norm"] = grad_norm
            metrics["time/optimizer_s"] = optimizer_seconds  # as TrainEngine reports it
            metrics[UPDATE_SKIPPED] = 0.0  # a non-finite step raises above instead
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def scheduler_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "steps_done": self.steps_done}

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter, whole, on rank 0 (None elsewhere); collective under ZeRO-3, where
        it gathers one module at a time so no rank ever holds two full copies."""
        import torch.distributed as dist

        if self.engine.zero_optimization_stage() == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.module.state_dict()
        if dist.get_rank() != 0:
            return None
        return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's default groups: no weight decay on biases and other 1-D parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


def _deepspeed_config(
    zero: DeepSpeedConfig, optim: OptimConfig, micro: int, accumulation: int, bf16: bool
) -> dict:
    if zero.zero_stage not in (1, 2, 3):
        raise ValueError(f"deepspeed.zero_stage={zero.zero_stage} must be 1, 2 or 3")
    zero_config = {
        "stage": zero.zero_stage,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "contiguous_gradients": True,
        "overlap_comm": torch.cuda.is_available(),
    }
    if zero.zero_stage == 3:
        zero_config["stage3_prefetch_bucket_size"] = zero.stage3_prefetch_bucket_size
        zero_config["stage3_gather_16bit_weights_on_model_save"] = True
    if zero.offload_optimizer:
        zero_config["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": torch.cuda.is_available(),
        }
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": optim.clip_grad,
        "zero_optimization": zero_config,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW, also when offloading
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
