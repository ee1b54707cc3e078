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
layer norms, softmax and the losses stay fp32 (autocast's CPU lists).

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


def params_dtype(bf16: bool) -> torch.dtype:
    """The parameter dtype of every model of a run with this resolved ``bf16`` setting."""
    return torch.bfloat16 if bf16 and torch.cuda.is_available() else torch.float32


def mark_cpu_bf16(model: torch.nn.Module, bf16: bool) -> torch.nn.Module:
    """Mark a trained model (fp32 parameters) of a ``bf16`` run on a CPU: its forward runs in
    an autocast region wherever it is called (scoring, evaluation); the training step and the
    generation open one around all of their forwards."""
    if bf16 and not torch.cuda.is_available():
        setattr(model, CPU_BF16, True)
        forward = model.forward

        @functools.wraps(forward)
        def forward_in_bf16(*args, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
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
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
