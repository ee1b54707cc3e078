"""Run megatron-core 0.16.1 on machines without a GPU (torch.distributed over gloo).

megatron-core hard-codes CUDA in about twenty places (``torch.cuda.current_device()`` buffers,
``device="cuda"`` literals, ``torch.cuda.synchronize()``, the CUDA RNG tracker, a
``'torch.cuda.FloatTensor'`` assert, ``weight.data.cuda()``). Nothing here changes numerics:
each patch maps one CUDA-only call to its CPU equivalent.

The patches are scoped: instead of monkey-patching ``torch.cuda`` for the whole process, each
covered megatron-core module gets its own ``torch`` name bound to :class:`_CpuTorch`, a view of
``torch`` whose ``cuda`` namespace and tensor factories point at the CPU. Every entry of
:data:`PATCHED_MODULES` names the file and the call sites it covers; ``tests/test_cpu_compat.py``
checks that those call sites still exist, so an upgrade of megatron-core fails loudly instead
of silently running unpatched code.

Active only when ``torch.cuda.is_available()`` is False; :func:`install` is idempotent.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

PINNED_MEGATRON_CORE = "0.16.1"

# module -> the CUDA-only call sites (file:line in the 0.16.1 wheel) that its CPU `torch` covers.
PATCHED_MODULES: dict[str, list[str]] = {
    "megatron.core.utils": [
        "utils.py:631 GlobalMemoryBuffer.get_tensor(device=torch.cuda.current_device())",
        'utils.py:1207 local_multi_tensor_l2_norm torch.tensor(..., device="cuda")',
    ],
    "megatron.core.tensor_parallel.random": [
        "random.py:235-238 CudaRNGStatesTracker.add: torch.cuda.get_rng_state/manual_seed",
        "random.py:422 model_parallel_cuda_manual_seed: torch.cuda.manual_seed",
    ],
    "megatron.core.pipeline_parallel.schedules": [
        'schedules.py:596,983,2138 torch.zeros([], dtype=torch.int, device="cuda")',
    ],
    "megatron.core.pipeline_parallel.p2p_communication": [
        "p2p_communication.py:190-202,313,321 device=torch.cuda.current_device()",
        "p2p_communication.py:242,398 torch.cuda.synchronize()",
    ],
    "megatron.core.distributed.param_and_grad_buffer": [
        "param_and_grad_buffer.py:783,800,806 device=torch.cuda.current_device()",
    ],
    "megatron.core.optimizer.optimizer": [
        "optimizer.py:473,481,485,907 torch.tensor(..., device='cuda')",
        "optimizer.py:1141 device=torch.cuda.current_device()",
    ],
    "megatron.core.optimizer.clip_grads": [
        "clip_grads.py:90,103,115,174,207 torch.tensor/zeros(..., device='cuda')",
    ],
    "megatron.core.tensor_parallel.mappings": [
        "mappings.py:91,... gathers/scatters allocate on torch.cuda.current_device()",
    ],
    "megatron.core.tensor_parallel.layers": [
        "layers.py:552 sequence-parallel backward: reduce-scatter buffer on current_device()",
    ],
    "megatron.core.transformer.attention": [
        "attention.py:430 _allocate_memory (static KV cache) device=torch.cuda.current_device()",
    ],
    "megatron.core.dist_checkpointing.strategies.filesystem_async": [
        "filesystem_async.py:230 torch.cuda.synchronize()",
    ],
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": [
        "state_dict_saver.py:252 torch.tensor(..., device=torch.cuda.current_device())",
    ],
    "megatron.core.dist_checkpointing.strategies.async_utils": [
        "async_utils.py:165,604 device=torch.cuda.current_device(); :212 torch.cuda.synchronize()",
    ],
    "megatron.core.resharding.copy_services.gloo_copy_service": [
        "gloo_copy_service.py:46 self._copy_stream = torch.cuda.Stream() (None on CPU; :145 skips"
        " the wait on None)",
    ],
}

# Source snippets that must still be present for the patches above to be meaningful.
EXPECTED_CALL_SITES: dict[str, list[str]] = {
    "megatron.core.utils": ["device=torch.cuda.current_device()", 'device="cuda"'],
    "megatron.core.tensor_parallel.random": [
        "torch.cuda.get_rng_state()",
        "torch.cuda.manual_seed(seed)",
    ],
    "megatron.core.pipeline_parallel.schedules": ['device="cuda"'],
    "megatron.core.pipeline_parallel.p2p_communication": [
        "torch.cuda.current_device()",
        "torch.cuda.synchronize()",
    ],
    "megatron.core.distributed.param_and_grad_buffer": ["torch.cuda.current_device()"],
    "megatron.core.optimizer.optimizer": ["device='cuda'"],
    "megatron.core.optimizer.clip_grads": [
        "device='cuda'",
        "assert param.grad.type() == 'torch.cuda.FloatTensor'",
    ],
    "megatron.core.tensor_parallel.mappings": ["device=torch.cuda.current_device()"],
    "megatron.core.tensor_parallel.layers": [
        "dim_size, dtype=input.dtype, device=torch.cuda.current_device(), requires_grad=False"
    ],
    "megatron.core.transformer.attention": ["device=torch.cuda.current_device()"],
    "megatron.core.dist_checkpointing.strategies.filesystem_async": ["torch.cuda.synchronize()"],
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": [
        "device=torch.cuda.current_device()"
    ],
    "megatron.core.dist_checkpointing.strategies.async_utils": ["torch.cuda.current_device()"],
    "megatron.core.resharding.copy_services.gloo_copy_service": [
        "self._copy_stream = torch.cuda.Stream()",
        "if self._copy_stream is not None:",
    ],
    "megatron.core.models.common.language_module.language_module": [
        "weight.data = weight.data.cuda()"
    ],
}

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn")


def _cpu_device(device):
    """Map any CUDA device spec (``"cuda"``, ``"cuda:0"``, ``0``, ``torch.device("cuda")``) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) or "cuda" in str(device):
        return torch.device("cpu")
    return device


def _cpu_factory(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    wrapped.__name__ = factory.__name__
    return wrapped


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as seen by a patched module: the CPU device and the CPU RNG."""

    def __init__(self):
        super().__init__(
            current_device=lambda: torch.device("cpu"),
            synchronize=lambda *args, **kwargs: None,
            empty_cache=lambda: None,
            is_available=lambda: False,
            device_count=lambda: 0,
            get_rng_state=lambda *args, **kwargs: torch.get_rng_state(),
            set_rng_state=lambda state, *args, **kwargs: torch.set_rng_state(state),
            manual_seed=lambda seed: torch.random.default_generator.manual_seed(seed),
            Stream=lambda *args, **kwargs: None,
        )

    def __getattr__(self, name):  # everything else (nvtx, Stream types, ...) is the real one
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched module: identical except ``cuda`` and device arguments."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _rng_state_get(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _rng_state_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of clip_grads.py:138 (its :167 asserts ``'torch.cuda.FloatTensor'``)."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


@contextlib.contextmanager
def tensor_cuda_is_identity():
    """Scope for language_module.py:244 (``weight.data = weight.data.cuda()`` with tied
    embeddings across pipeline stages): ``Tensor.cuda()`` returns the tensor itself."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


_installed = False


def install() -> bool:
    """Install the CPU patches if there is no GPU; return whether they are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    import megatron.core

    if megatron.core.__version__ != PINNED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron_rlhf's CPU compatibility layer covers megatron-core=={PINNED_MEGATRON_CORE}"
            f" but {megatron.core.__version__} is installed; "
            f"`pip install megatron-core=={PINNED_MEGATRON_CORE}`"
        )
    cpu_torch = _CpuTorch()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = cpu_torch
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _rng_state_get
    random._set_cuda_rng_state = _rng_state_set
    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    # clip_grads.py:42 falls back to torch.norm per gradient, fp32-accumulated on a CPU: low by
    # up to ~3.6 % at BLOOM's 257M-value vocabulary gradient (kernels/fused/cpu_norm.py)
    from megatron_rlhf.kernels import cpu_norm

    importlib.import_module("megatron.core.optimizer.clip_grads").l2_norm_impl = cpu_norm.l2_norm
    _installed = True
    return True
