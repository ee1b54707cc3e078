"""bf16 on a CPU as on a GPU: where the weights live in fp32 and the products run in bf16.

On a GPU ``train.bf16: true`` builds every model with bf16 parameters, and Megatron-Core's
optimizer keeps fp32 master copies of the trained ones. Its mixed-precision optimizers take
CUDA tensors only (``Float16OptimizerWithFloat16Params`` refuses a CPU ``BFloat16Tensor``), so
on a CPU with bf16 matrix units (AMX, AVX-512-bf16: ~5x fp32's rate at BLOOM-560m's shapes on
the 2-core benchmark machine) the split is made the other way round: every model keeps fp32
parameters (a trained model's are its master weights) and its forward and backward run under
``torch.autocast("cpu", torch.bfloat16)``. Each matrix product takes bf16 copies of its
operands (a weight is cast once per autocast region, and reused by every micro-batch and decode
step inside it), accumulates in fp32, and a weight's gradient reaches the fp32 gradient buffer;
layer norms, softmax and the losses stay fp32 (autocast's CPU lists). The vocabulary matrix,
most of BLOOM's weights, keeps its bf16 copy between regions (:func:`bf16_copy`).

The frozen models (reference, reward) run the same way, not in bf16 parameters: at step 1 the
actor and the reference then compute the same numbers and the KL penalty starts at 0, as on a
GPU where both hold the same bf16 weights. (bf16 parameters for the reference and autocast for
the actor gave a KL of 5e-4 nats a token at step 1 on the tiny PPO fixture: a bias as large as
a KL target spread over a few dozen tokens.)

:func:`mark_cpu_bf16` makes every forward of the model an autocast region;
:func:`compute_precision` opens a wider one: ``TrainEngine.step`` around the forward-backward
schedule (the backward too: Megatron-Core's linear layers are autograd functions whose backward
multiplies the incoming bf16 gradient by the fp32 weight, which only autocast reconciles), the
generation around all of its decode steps (each weight cast once, not once a step). A region
never spans an optimizer step: autocast's cast cache is keyed by the tensor, not its version,
so a region that outlived an update would keep multiplying by the old weights.
"""

from __future__ import annotations

import contextlib
import functools

import torch

CPU_BF16 = "cpu_bf16_compute"
"""The attribute that marks a model whose products run in bf16 on a CPU."""
FROZEN = "cpu_bf16_frozen"
"""The attribute of a frozen model's parameters (reference, reward): nothing writes them after
the model is loaded, so their bf16 copies (:func:`bf16_copy`) outlive a region."""
_BF16_COPY = "_cpu_bf16_copy"

_regions = 0  # the outermost autocast regions opened by this module, counted
_inside = False  # whether the current one was opened by this module


@contextlib.contextmanager
def _bf16_region():
    """``torch.autocast("cpu", torch.bfloat16)``; an outermost one starts a new region for
    :func:`bf16_copy`."""
    global _regions, _inside
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
        return
    _regions, _inside = _regions + 1, True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        _inside = False


def bf16_copy(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 operand of an fp32 CPU weight inside a region of this module, kept between
    regions in a buffer of its own: made once and refreshed in place, where autocast makes a
    fresh copy in every region (and, for a weight that does not require grad, at every product).

    For BLOOM's vocabulary matrix (0.5 GB in bf16 at BLOOM-560m's width) a fresh copy cost
    0.15-0.67 s on the 2-core benchmark machine, mostly page faults, and a PPO step made about
    seven (the rollout, the actor's and the reference's scoring micro-batches, the update); a
    refresh in place costs 0.08 s. A trained weight's copy is refreshed in each new region (a
    region never spans an optimizer step, and the distributed optimizer and the rollout weight
    sync write weights through other tensors, which no version counter sees); a frozen model's
    (:data:`FROZEN`) only when its version counter moved (a load). Anywhere else (a GPU, no
    region, a region not opened here, a bf16 weight) the weight itself, for autocast to cast.
    Costs one bf16 copy of the matrix per model that uses it (none on a GPU)."""
    if not (_inside and weight.dtype == torch.float32 and weight.device.type == "cpu"):
        return weight
    key = (weight._version, None if getattr(weight, FROZEN, False) else _regions)
    held = getattr(weight, _BF16_COPY, None)
    if held is not None and held[1] == key:
        return held[0]
    copy = torch.empty_like(weight, dtype=torch.bfloat16) if held is None else held[0]
    with torch.no_grad():
        copy.copy_(weight)
    setattr(weight, _BF16_COPY, (copy, key))
    return copy


def params_dtype(bf16: bool) -> torch.dtype:
    """The parameter dtype of every model of a run with this resolved ``bf16`` setting."""
    return torch.bfloat16 if bf16 and torch.cuda.is_available() else torch.float32


def mark_cpu_bf16(model: torch.nn.Module, bf16: bool, frozen: bool = False) -> torch.nn.Module:
    """Mark a model (fp32 parameters) of a ``bf16`` run on a CPU: its forward runs in an
    autocast region wherever it is called (scoring, evaluation); the training step and the
    generation open one around all of their forwards. ``frozen``: nothing writes its weights
    after this (a reference or reward model), so their bf16 copies are kept (:func:`bf16_copy`)."""
    if bf16 and not torch.cuda.is_available():
        setattr(model, CPU_BF16, True)
        if frozen:
            for param in model.parameters():
                setattr(param, FROZEN, True)
        forward = model.forward

        @functools.wraps(forward)
        def forward_in_bf16(*args, **kwargs):
            with _bf16_region():
                return forward(*args, **kwargs)

        model.forward = forward_in_bf16
    return model


def cpu_autocast(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s ops run under a CPU autocast region (False on any other device:
    ``meta`` has no autocast state to ask for)."""
    return tensor.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def compute_precision(model) -> contextlib.AbstractContextManager:
    """The autocast region of a marked model (through a DDP wrapper too), else a no-op."""
    while not hasattr(model, CPU_BF16) and hasattr(model, "module"):
        model = model.module
    if getattr(model, CPU_BF16, False):
        return _bf16_region()
    return contextlib.nullcontext()
