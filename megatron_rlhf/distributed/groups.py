"""The process groups of every layout in a launch, owned by the models built on them.

A launch may hold several layouts over one world (train-ppo's roles, eval-policy's policy and
judge). Each layout's groups are built once, at start-up, by Megatron-Core's own
``initialize_model_parallel`` (collective: every rank builds every layout, in the same order),
and kept as a :class:`~megatron.core.process_groups_config.ProcessGroupCollection` in a
:class:`LayoutGroups`. Everything downstream takes them explicitly: ``BloomModel(...,
pg_collection=groups.pg_collection)`` hands them to ``GPTModel`` (every layer, the ALiBi
slopes, the scalar head), ``TrainEngine`` to DDP, the optimizer, ``finalize_model_grads`` and
the pipeline schedule, and the forward-only helpers (``distributed/pipeline.py``,
``generation``, ``ppo/scoring.py``) read ``model.pg_collection``. No group is created or
destroyed after start-up.

Megatron-Core's global parallel state is then *sealed*: its group globals hold a sentinel whose
every use raises :class:`GlobalParallelStateError`, so code that still reads the globals (which
layout's would it get?) fails at once instead of reducing over the wrong ranks.

    groups = build_layout_groups({"actor": Layout(tp=2, pp=2, dp=1), "reward": ...}, seed)
    seed_layout(groups["actor"], seed)                  # RNG of the actor's TP rank
    actor = load_bloom(path, pg_collection=groups["actor"].pg_collection)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_rlhf.distributed.layouts import Layout

ROLE_API = (
    "megatron_rlhf builds every model on explicit process groups (distributed/groups.py): read "
    "the model's own groups with distributed.parallel.model_groups(model) (its "
    "ProcessGroupCollection: .tp, .pp, .dp) or a Role's .pg, never Megatron-Core's "
    "parallel_state"
)


class GlobalParallelStateError(RuntimeError):
    """Megatron-Core's global parallel state was read while layouts own their groups."""


class _Sealed:
    """What a sealed parallel_state global holds: any use raises, naming the role API."""

    def __init__(self, name: str):
        self._name = name

    def _fail(self, *args, **kwargs):
        raise GlobalParallelStateError(
            f"Megatron-Core's global parallel state (parallel_state.{self._name}) was read while "
            f"several layouts share this launch; {ROLE_API}"
        )

    __getattr__ = __call__ = __hash__ = __eq__ = __bool__ = __len__ = __iter__ = _fail
    __getitem__ = __contains__ = __index__ = __int__ = _fail


@dataclass(frozen=True, eq=False)
class LayoutGroups:
    """The process groups of one layout on this rank."""

    layout: Layout
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.pg_collection.tp)


def build_layout_groups(layouts: dict[str, Layout]) -> dict[str, LayoutGroups]:
    """Groups for every role's layout; roles with the same (tp, pp) share one set.

    Must be called on every rank with the same ``layouts`` (group creation is collective).
    Leaves Megatron-Core's global parallel state sealed (see the module docstring).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    by_shape: dict[tuple[int, int, int, int], LayoutGroups] = {}
    result = {}
    for role, layout in layouts.items():
        shape = (layout.tp, layout.pp, layout.first_rank, layout.size)
        if shape in by_shape:
            result[role] = by_shape[shape]
            continue
        if layout.first_rank == 0 and layout.size == dist.get_world_size():
            unseal()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp
            )
            collection = ProcessGroupCollection.use_mpu_process_groups()
        else:
            collection = subset_groups(layout)
        by_shape[shape] = result[role] = LayoutGroups(layout=layout, pg_collection=collection)
    seal()
    return result


def subset_groups(layout: Layout):
    """The process groups of a layout over ranks ``[first_rank, first_rank + size)`` only
    (train-ppo's disaggregated placement), in Megatron-Core's rank order (tp fastest, then
    dp, then pp), built with Megatron-Core's ``HyperCommGrid``: the groups
    ``initialize_model_parallel`` would build for that layout on a world of its own, with one
    context-parallel rank, one expert and one distributed-optimizer instance. Collective over
    the whole world (every rank creates every group); a rank outside the layout gets an empty
    collection (every group None)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid(
        [layout.tp, 1, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"], layout.first_rank
    )
    tp, cp, dp, pp = (grid.create_pg(dim) for dim in ("tp", "cp", "dp", "pp"))
    mp, tp_dp = grid.create_pg(["tp", "pp"]), grid.create_pg(["tp", "dp"])
    everyone = grid.create_pg(["tp", "cp", "dp", "pp"])
    stages = grid.get_rank_enum("pp")  # one list of ranks per pipeline
    embedding = _group_of([[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in stages])
    position = _group_of([[p[0]] for p in stages])
    if not layout.holds(dist.get_rank()):
        return ProcessGroupCollection()
    return ProcessGroupCollection(
        tp=tp, pp=pp, mp=mp, embd=embedding, pos_embd=position, cp=cp, tp_cp=tp, hcp=None,
        ep=cp, expt_tp=tp, tp_ep=tp, tp_ep_pp=mp, tp_dp_cp=tp_dp, dp=dp, dp_cp=dp,
        expt_dp=dp, intra_dp_cp=dp, intra_expt_dp=dp, inter_dist_opt=None,
        intra_dist_opt=everyone,
    )  # fmt: skip


def _group_of(rank_lists: list[list[int]]):
    """This rank's group among ``rank_lists`` (None if it is in none); collective."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def seed_layout(groups: LayoutGroups, seed: int) -> None:
    """Seed Megatron-Core's model-parallel RNG for models built on ``groups`` (weights that are
    initialised, not loaded, then equal those of every other layout, as at one layout)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=groups.tp_rank, ep_rank=0, etp_rank=0
    )


_SEALED: list[str] = []


def _state_names() -> list[str]:
    """parallel_state's globals that hold a group or a group's ranks."""
    from megatron.core import parallel_state

    return [
        name
        for name in vars(parallel_state)
        if name.startswith("_")
        and name.upper() == name
        and (name.endswith("_GROUP") or "_GROUP_" in name or name.endswith("_RANKS"))
    ]


def seal() -> None:
    """Replace Megatron-Core's global groups by sentinels that raise when used. The global
    memory buffer (scratch space of the sequence-parallel gathers) is kept."""
    from megatron.core import parallel_state

    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state.destroy_model_parallel()
    parallel_state._GLOBAL_MEMORY_BUFFER = buffer
    for name in _state_names():
        setattr(parallel_state, name, _Sealed(name))
        _SEALED.append(name)


def unseal() -> None:
    """Undo :func:`seal`: Megatron-Core's global parallel state back to uninitialised."""
    from megatron.core import parallel_state

    while _SEALED:
        setattr(parallel_state, _SEALED.pop(), None)
    parallel_state.destroy_model_parallel()


def is_sealed() -> bool:
    return bool(_SEALED)
