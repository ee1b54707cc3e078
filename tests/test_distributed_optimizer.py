"""Megatron-Core's distributed optimizer on torch Adam (the bare CUDA image's path), on the CPU.

Without Transformer Engine or Apex, Megatron-Core 0.16.1's ``DistributedOptimizer`` wraps
``torch.optim.Adam``/``AdamW``; its ``state_dict()`` asserts one Adam step count over the
parameters, and ``sharded_state_dict()`` calls it even to build a state dict to load into. torch
Adam has no state before its first step, so a fresh engine could not resume, nor save at step 0
(``TrainEngine`` gives it that state first: ``start_adam_state``).

The GPU builds this optimizer for every training run; the CPU builds the plain FP32 one. Here the
real ``DistributedOptimizer`` runs on CPU tensors over the 1-rank gloo group: its constructor
accepts only parameters whose ``Tensor.type()`` names CUDA (distrib_optimizer.py:361, 420), and
the ``fully_reshardable`` save gathers through ``torch.cuda.current_device()`` and
``Tensor.cuda()`` (:1077, :1089). :func:`cpu_distributed_optimizer` maps exactly those to the CPU
for the test's duration (as ``megatron_rlhf/distributed/cpu_compat.py`` does for the modules the
CPU path uses); the optimizer's own code runs unchanged. ``tests/test_gpu.py`` runs the same
resume on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_bloom_units import single_process  # noqa: F401  (module-scoped fixture)

from megatron_rlhf.models.bloom.config import BloomArchitecture

pytestmark = pytest.mark.usefixtures("single_process")  # Megatron-Core state at world size 1

ARCH = BloomArchitecture(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4)


@pytest.fixture
def cpu_distributed_optimizer(monkeypatch):
    """CPU tensors report CUDA type names (``torch.cuda.FloatTensor``: what the constructor
    checks), and distrib_optimizer.py's ``torch.cuda`` and ``Tensor.cuda()`` stay on the CPU."""
    from megatron.core.optimizer import distrib_optimizer

    from megatron_rlhf.distributed import cpu_compat

    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    monkeypatch.setattr(torch.Tensor, "type", cuda_type)
    monkeypatch.setattr(distrib_optimizer, "torch", cpu_compat._CpuTorch())
    with cpu_compat.tensor_cuda_is_identity():
        yield


def _engine(seed: int, sharding: str | None):
    """``sharding`` None: the CPU's plain FP32 optimizer (the same torch Adam inside)."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.config import OptimConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = BloomModel(ARCH, head="scalar")
    optim = OptimConfig(
        lr=1e-2, warmup_fraction=0.0, checkpoint_sharding=sharding or "fully_reshardable"
    )
    distributed = sharding is not None
    engine = TrainEngine(model, optim, total_steps=10, distributed_optimizer=distributed)
    for optimizer in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        assert isinstance(optimizer, DistributedOptimizer) == distributed
        assert type(optimizer.optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    return engine


def _batch(step: int) -> list[dict]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(4, ARCH.vocab_size, (2, 12), generator=generator)
    return [{"input_ids": ids, "padding_mask": torch.ones_like(ids)}]


def _loss(output, microbatch):
    return output[..., 0].float().pow(2).mean(), {}


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable", None])
@pytest.mark.parametrize("saved_after", [0, 2])
def test_a_fresh_engine_resumes_torch_adam_exactly(request, tmp_path, sharding, saved_after):
    """Saved after 0 or 2 steps and resumed into a freshly built engine (another init), the next
    two steps equal the uninterrupted run's, bit for bit. Before ``training/optimizer_state.py``
    the distributed optimizer's load (and its save at step 0) raised Megatron-Core's
    ``assert len(steps) == 1``; with that alone, a ``fully_reshardable`` load raised
    ``KeyError: 'step'``, a ``dp_reshardable`` one restarted Adam at step 0 and its save could
    hold NaN padding, and the shared step tensor advanced once per parameter. The plain
    optimizer (sharding None) lost its step in a step-0 checkpoint."""
    if sharding is not None:
        request.getfixturevalue("cpu_distributed_optimizer")
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.training.checkpointing import (
        load_training_checkpoint,
        save_training_checkpoint,
    )

    straight = _engine(seed=0, sharding=sharding)
    for step in range(saved_after):
        straight.step(_batch(step), _loss)
    metadata = dist_ckpt.model_metadata(straight.module)
    save_training_checkpoint(tmp_path, saved_after, {"model": straight}, metadata, {})
    before = [p.detach().clone() for p in straight.module.parameters()]
    want = [straight.step(_batch(saved_after + k), _loss) for k in range(2)]
    moved = max((a - b).abs().max().item() for a, b in zip(straight.module.parameters(), before))
    assert moved > 1e-3  # the compared steps really update the weights

    resumed = _engine(seed=1, sharding=sharding)  # another init: all must come from the checkpoint
    load_training_checkpoint(tmp_path / f"step_{saved_after:07d}", {"model": resumed})
    got = [resumed.step(_batch(saved_after + k), _loss) for k in range(2)]
    for a, b in zip(want, got):  # two steps: a step count shared or off by one shows in the second
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    for (name, a), b in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(a, b), name
