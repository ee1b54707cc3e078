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

    by_shape: dict[tuple[int, int], LayoutGroups] = {}
    result = {}
    for role, layout in layouts.items():
        shape = (layout.tp, layout.pp)
        if shape not in by_shape:
            unseal()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp
            )
            by_shape[shape] = LayoutGroups(
                layout=layout, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
            )
        result[role] = by_shape[shape]
    seal()
    return result


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
