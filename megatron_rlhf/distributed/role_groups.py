"""Megatron-Core process groups of several layouts in one world, one active at a time.

Every layout's groups are built once, at start-up, by Megatron-Core's own
``initialize_model_parallel`` (collective: every rank builds every layout, in the same order),
and kept as (a) the :class:`~megatron.core.process_groups_config.ProcessGroupCollection` that
``GPTModel``, ``TransformerBlock``, attention, the tensor-parallel layers, DDP and the
optimizer capture when they are constructed, and (b) the values of ``parallel_state``'s module
globals for that layout. :func:`active` points ``parallel_state`` at one layout's groups for the
duration of a block: the code that still reads the globals at call time (our forward-only
pipeline and generation loop, the vocab-parallel log-prob callers, checkpoint loaders, and
Megatron-Core's pipeline schedules and p2p communication, which in 0.16.1 fall back to
``parallel_state`` when no ``pg_collection`` is passed) then sees the same groups as the model.
No group is created or destroyed after start-up.

    groups = build_layout_groups({"actor": Layout(tp=2, pp=2, dp=1), "reward": ...})
    with active(groups["actor"]):
        actor = load_bloom(...)          # built on the actor's groups
    with active(groups["reward"]):
        scores = score(...)              # runs on the reward's groups
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from megatron_rlhf.distributed.layouts import Layout


@dataclass
class LayoutGroups:
    """The process groups of one layout on this rank."""

    layout: Layout
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    state: dict  # parallel_state's module globals for this layout

    @property
    def dp_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.pg_collection.dp)

    @property
    def dp_group(self):
        return self.pg_collection.dp


def _state_names() -> list[str]:
    from megatron.core import parallel_state

    return [
        name
        for name in vars(parallel_state)
        if name.startswith("_") and name[1:2].isupper() and name.upper() == name
    ]


def _snapshot() -> dict:
    from megatron.core import parallel_state

    return {name: getattr(parallel_state, name) for name in _state_names()}


def _restore(state: dict) -> None:
    from megatron.core import parallel_state

    for name, value in state.items():
        setattr(parallel_state, name, value)


def _cleared(state: dict) -> dict:
    """The pre-initialisation values (None, and {} for the hybrid DP/CP cache)."""
    return {name: {} if isinstance(value, dict) else None for name, value in state.items()}


def build_layout_groups(layouts: dict[str, Layout]) -> dict[str, LayoutGroups]:
    """Groups for every role's layout; roles with the same (tp, pp) share one set.

    Must be called on every rank with the same ``layouts`` (group creation is collective).
    Leaves ``parallel_state`` pointing at the first role's layout.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    outer = _snapshot()
    by_shape: dict[tuple[int, int], LayoutGroups] = {}
    result = {}
    for role, layout in layouts.items():
        shape = (layout.tp, layout.pp)
        if shape not in by_shape:
            _restore(_cleared(outer))
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp
            )
            by_shape[shape] = LayoutGroups(
                layout=layout,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                state=_snapshot(),
            )
        result[role] = by_shape[shape]
    _restore(next(iter(result.values())).state)
    return result


@contextlib.contextmanager
def active(groups: LayoutGroups):
    """Point Megatron-Core's ``parallel_state`` at ``groups`` inside the block (nestable)."""
    outer = _snapshot()
    _restore(groups.state)
    try:
        yield groups
    finally:
        _restore(outer)
