"""Megatron-Core 0.16.1's distributed optimizer on torch Adam: what its checkpoints need.

Without Transformer Engine or Apex (the bare CUDA image this project is lent), Megatron-Core
wraps ``torch.optim.Adam``/``AdamW``, a path it exercises far less than TE's FusedAdam. Code of
``megatron/core/optimizer/distrib_optimizer.py`` breaks a save or a resume there in the ways
below; each public function works around some of them without changing what a step computes
(``tests/test_distributed_optimizer.py`` resumes bit-for-bit through the real optimizer):

- ``state_dict()`` asserts one Adam step count over the parameters (:640-642), and
  ``sharded_state_dict()`` calls it even to build a state dict to load into (:1246). torch Adam
  creates its state at the first step, so a fresh engine could neither resume nor save at step 0:
  :func:`start_adam_state`.
- ``load_state_dict`` reads the step from the param groups (:818-831) and then copies the
  parameter state over every entry of the optimizer's state, ``step`` included (:936-940):
  ``fully_reshardable`` left the step out of what it copies (:2097), so ``KeyError: 'step'``;
  ``dp_reshardable`` copies the step the state had when the state dict to load into was built
  (a local, unsaved object: :1663-1666), so every resume restarted Adam's bias correction at
  step 0. ``load_state_dict`` also gives every parameter the same step tensor (:829-831), which
  torch Adam then advances once per parameter at each step, and the ``dp_reshardable`` copy
  writes into views of fp32 parameters outside ``no_grad``: :func:`load_optimizer_state` (which
  also gives back the step the CPU's plain FP32 optimizer leaves out of a step-0 checkpoint).
- ``dp_reshardable`` writes the gaps between parameters in a bucket from ``torch.empty`` (:1631),
  so a checkpoint held whatever memory was there (NaN included, which the save's finite check
  refuses): :func:`zero_checkpoint_padding`.
"""

from __future__ import annotations

import torch


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_adam(optimizer) -> torch.optim.Optimizer | None:
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) else None


def start_adam_state(optimizer) -> None:
    """Give a torch Adam that has not stepped yet the state its first step would create.

    The state is what torch's ``Adam._init_group`` makes (torch/optim/adam.py): step 0 and zero
    moments; the step on the parameter's device as float32 when fused or capturable, else a CPU
    scalar of the default float dtype. The first step after it computes exactly what it would
    have. An optimizer that already holds state, or is not torch Adam, is left alone."""
    for chained in _chained(optimizer):
        inner = _torch_adam(chained)
        if inner is None or inner.state:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = {"step": _step_zero(param, group)}
                names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
                for name in names:
                    state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
                inner.state[param] = state


def _step_zero(param: torch.Tensor, group: dict) -> torch.Tensor:
    """torch Adam's initial step: on the parameter's device as float32 when fused or capturable,
    else a CPU scalar of ``_get_scalar_dtype()`` (float64 when that is the default float dtype)."""
    if group.get("fused") or group.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=_cpu_step_dtype())


def _cpu_step_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def load_optimizer_state(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict(state_dict)``, with a distributed optimizer's torch-Adam steps
    (just loaded from its param groups) set aside while the parameter state is copied in, and
    each parameter given its own step tensor afterwards. Without grad: the ``dp_reshardable``
    copy (unlike the ``fully_reshardable`` one) writes into views of fp32 parameters, which
    autograd refuses for a leaf that requires grad."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = _chained(optimizer)
    if len(chained) == 1:
        states = [state_dict]
    else:  # ChainedOptimizer.load_state_dict's order
        items = state_dict.items() if isinstance(state_dict, dict) else enumerate(state_dict)
        states = [state for _, state in sorted(items)]
    for inner, state in zip(chained, states, strict=True):
        adam = _torch_adam(inner)
        if adam is not None and not isinstance(inner, DistributedOptimizer):
            _step_zero_where_missing(state)
        if (
            adam is None
            or not isinstance(inner, DistributedOptimizer)
            or "param_state" not in state
        ):
            inner.load_state_dict(state)
        else:
            load_parameter_state = {
                "fully_reshardable": inner.load_parameter_state_from_fully_reshardable,
                "dp_reshardable": inner.load_parameter_state_from_dp_reshardable,
            }[state["param_state_sharding_type"]]
            inner.load_state_dict({k: v for k, v in state.items() if not k.startswith("param_")})
            steps = {param: entry.pop("step") for param, entry in adam.state.items()}
            load_parameter_state(state["param_state"])  # param, exp_avg, exp_avg_sq only
            for param, step in steps.items():
                adam.state[param]["step"] = step
        if adam is not None:
            _own_step_tensors(adam)


def _step_zero_where_missing(state_dict: dict) -> None:
    """The plain FP32 optimizer saves a common step only when it is truthy (optimizer.py:1031),
    so a step-0 checkpoint has moments without a step, which torch Adam refuses to load
    (``KeyError: 'step'``). A CPU scalar, which ``load_state_dict`` moves where the group needs
    it (torch's ``_process_value_according_to_param_policy``)."""
    entries = state_dict.get("state", {})
    if "common_step" in entries:
        return
    for entry in entries.values():
        if isinstance(entry, dict) and "exp_avg" in entry and "step" not in entry:
            entry["step"] = torch.tensor(0.0, dtype=_cpu_step_dtype())


def _own_step_tensors(adam: torch.optim.Optimizer) -> None:
    """One step tensor per parameter, as torch Adam makes them: a shared one is advanced once per
    parameter at every step (its foreach and fused kernels add 1 to each listed tensor)."""
    seen = set()
    for entry in adam.state.values():
        step = entry.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                entry["step"] = step.clone()
            seen.add(id(entry["step"]))


def zero_checkpoint_padding(sharded_state) -> None:
    """Zero the ``dp_reshardable`` gaps between parameters (``torch.empty``) before a save, so a
    checkpoint is deterministic and its finite check sees no stale memory. The gaps are the
    entries Megatron-Core marks ``padding``; a load overwrites them and reads nothing back."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sharded_state, dict):
        padding = sharded_state.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.obj is True:
            for value in sharded_state.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
            return
        children = sharded_state.values()
    elif isinstance(sharded_state, (list, tuple)):
        children = sharded_state
    else:
        return
    for child in children:
        zero_checkpoint_padding(child)
