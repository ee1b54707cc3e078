"""torch.distributed and Megatron-Core parallel state, set up in one place.

``initialize(tp=2, pp=2, arch=arch)`` works under ``torchrun`` (reads RANK/WORLD_SIZE/
LOCAL_RANK) and in a plain single process (world size 1). NCCL with GPUs, gloo without; on CPU
the megatron-core compatibility layer is installed first. The layout is validated
(``layouts.validate_layouts``) before any process group or model is built.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from megatron_rlhf.distributed import cpu_compat
from megatron_rlhf.distributed.layouts import Layout, validate_layouts


def compute_device() -> torch.device:
    """Where models and their inputs live: this process's GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: this process's GPU under NCCL
    (which reduces CUDA tensors only), else the CPU (gloo)."""
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return compute_device()
    return torch.device("cpu")


def group_max(value: int, group=None) -> int:
    """The largest ``value`` over the ranks of ``group`` (the world by default; collective when
    distributed: one all-reduce of one integer on :func:`collective_device`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def world_max(value: int) -> int:
    """The largest ``value`` over every rank of the world."""
    return group_max(value)


def current_groups():
    """The ``ProcessGroupCollection`` of the one layout that ``initialize`` set up: what a model
    built without explicit groups keeps. Refused while several layouts share the launch
    (``initialize_layouts``): then every model is built on its own layout's groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlhf.distributed.groups import ROLE_API, GlobalParallelStateError, is_sealed

    if is_sealed():
        raise GlobalParallelStateError(
            f"no single layout is in force: several layouts share this launch; {ROLE_API}"
        )
    return ProcessGroupCollection.use_mpu_process_groups()


def model_groups(model):
    """The ProcessGroupCollection a model was built with (through a DDP wrapper too)."""
    return getattr(model, "pg_collection", None) or model.module.pg_collection


@contextlib.contextmanager
def default_group(group):
    """Within the block, ``group`` stands for the world wherever a collective is given no
    group (Megatron-Core's optimizer set-up and dist-checkpoint reads and writes, our
    barriers): train-ppo's training ranks of the disaggregated placement run what only they
    take part in this way, while the rollout ranks go on. Ranks keep their numbers (the
    group holds ranks ``0..n-1``); None: the world itself.

    It swaps torch's private ``distributed_c10d._world.default_pg``, which every collective
    without a group reads (Megatron-Core takes no group there to pass instead). Known to work
    on torch 2.11 (the GPU image) and 2.13 (the CPU install); ``tests/test_default_group.py``
    fails, naming the attribute, on a torch that moves it."""
    from torch.distributed.distributed_c10d import _world

    if group is None:
        yield
        return
    world, _world.default_pg = _world.default_pg, group
    try:
        yield
    finally:
        _world.default_pg = world


def layout_group(groups):
    """Every rank of the layout of ``groups`` (a ``ProcessGroupCollection``): Megatron-Core's
    distributed-optimizer instance group, which with one instance is the whole layout: the
    world, or in train-ppo's disaggregated placement the training ranks."""
    return groups.intra_dist_opt


def vocab_group(groups):
    """The TP group the vocabulary of a model with ``groups`` is split over; None when it is not
    split (tp = 1: the vocab-parallel kernels then skip their all-reduces)."""
    return groups.tp if groups.tp.size() > 1 else None


def is_first_stage(groups) -> bool:
    """This rank holds the first pipeline stage of the model whose ``groups`` these are."""
    return groups.pp.rank() == 0


def is_last_stage(groups) -> bool:
    return groups.pp.rank() == groups.pp.size() - 1


def stage_rank(groups, stage: int) -> int:
    """Global rank of pipeline stage ``stage`` (modulo the stages: -1 is the last, one past the
    last is the first) in this rank's pipeline."""
    return dist.get_global_rank(groups.pp, stage % groups.pp.size())


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group() -> None:
    """torch.distributed over NCCL (GPU) or gloo (CPU); a 1-process group outside torchrun.

    Outside torchrun the group's store is an in-memory ``HashStore``, new at every call: no
    port to pick (picking a free port and binding it later races with any other process on the
    machine), and one process can run several commands in a row (the demo does).
    """
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "TORCHELASTIC_RUN_ID" in os.environ or "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def initialize(
    tp: int = 1,
    pp: int = 1,
    *,
    sequence_parallel: bool = False,
    arch=None,
    seed: int = 1234,
) -> Layout:
    """Validate the one layout of a command that loads one model (key ``parallel``; ``arch``:
    its model, anything with ``num_heads`` and ``num_layers``), then initialise
    torch.distributed and Megatron-Core over it; return the Layout. ``seed`` seeds the
    model-parallel RNG (weights initialised identically for every layout)."""
    archs = {"": arch} if arch is not None else None
    layout = validate_layouts(
        {"": (tp, pp)}, world_size_from_env(), archs, sequence_parallel=sequence_parallel
    )[""]
    cpu_compat.install()
    init_process_group()
    from megatron.core import parallel_state, tensor_parallel

    from megatron_rlhf.distributed.groups import is_sealed, unseal

    if is_sealed():  # a multi-layout launch ran before in this process (the demo)
        unseal()
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp
        ):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return layout


def initialize_layouts(layouts: dict[str, Layout]) -> dict:
    """torch.distributed plus every role's process groups (``distributed/groups.py``), with
    Megatron-Core's global state sealed. Returns {role: LayoutGroups}; seed each layout's RNG
    (``groups.seed_layout``) before building its models."""
    from megatron_rlhf.distributed.groups import build_layout_groups

    cpu_compat.install()
    init_process_group()
    return build_layout_groups(layouts)


def destroy() -> None:
    """Tear down Megatron-Core's groups and torch.distributed (end of a command or a test)."""
    from megatron_rlhf.distributed.groups import unseal

    unseal()
    if dist.is_initialized():
        dist.destroy_process_group()
