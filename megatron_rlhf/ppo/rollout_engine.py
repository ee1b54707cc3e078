"""The rollout seam: which model, in which layout, generates a PPO step's responses.

The PPO loop only sees :class:`RolloutEngine`: before each rollout it calls ``refresh()`` (bring
the generation weights up to date with the actor's last update), then ``ppo.rollout.rollout_global``
calls ``generate(...)`` on every rank of the world with this rank's share of the global prompts
(split over the data-parallel group of ``engine.groups``), and hands the responses back to every
rank (``distributed/handoff.py``). Two engines today:

- :class:`TrainingLayoutEngine`: the actor generates in its own training layout (no copy).
- :class:`ReshardedEngine`: a second copy of the actor in the rollout layout
  (``parallel.rollout``), refreshed in memory by Megatron-Core's refit,
  ``megatron.core.resharding.swap_model_weights(actor, copy, "gloo" | "nccl")`` (a reshard plan
  between the two models' ``pg_collection``s, built once and cached on the copy).

Plugging in another engine (vLLM, Megatron-Core's inference engine; pipelined micro-batches at
PP > 1 are already inside ``generate``):
write a class with ``groups`` (the ``ProcessGroupCollection`` of the layout it generates in),
``refresh()`` and ``generate(prompt_ids, prompt_mask, sampling) ->
GenerationOutput`` with the contract of :func:`megatron_rlhf.generation.generate` (left-padded
prompts of this rank's rows; every rank of a replica gets the same outputs; honour
``sampling.row_seeds`` so that tokens do not depend on the layout), and return it from
:func:`build_rollout_engine`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_rlhf.distributed.groups import LayoutGroups
from megatron_rlhf.generation import GenerationOutput, SamplingConfig, generate


class RolloutEngine(Protocol):
    groups: object
    """The process groups (a ``ProcessGroupCollection``) the engine generates on; its DP ranks
    split the global prompts."""

    def refresh(self) -> None:
        """Make the generation weights equal the actor's current weights (collective)."""

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig
    ) -> GenerationOutput:
        """Responses of this rank's rows (collective over ``self.groups``)."""


class TrainingLayoutEngine:
    """The actor generates in its training layout."""

    def __init__(self, actor):
        self.actor, self.groups = actor, actor.pg_collection

    def refresh(self) -> None:
        pass

    def generate(self, prompt_ids, prompt_mask, sampling) -> GenerationOutput:
        return generate(self.actor, prompt_ids, prompt_mask, sampling)


class ReshardedEngine:
    """A copy of the actor in the rollout layout, refit from the actor before each rollout."""

    def __init__(self, actor, model):
        self.actor, self.model, self.groups = actor, model, model.pg_collection
        self.model.requires_grad_(False)
        self.copy_service = refit_copy_service()

    def refresh(self) -> None:
        from megatron.core.resharding import swap_model_weights

        with torch.no_grad():
            swap_model_weights(self.actor, self.model, self.copy_service)

    def generate(self, prompt_ids, prompt_mask, sampling) -> GenerationOutput:
        return generate(self.model, prompt_ids, prompt_mask, sampling)


def refit_copy_service():
    """Megatron-Core's weight-copy service for the refit: gloo on the CPU; on GPUs NCCL, with its
    same-rank copies ordered after the default stream.

    ``execute_reshard_plan`` (resharding/execution.py:37) makes each source slice contiguous on
    the default stream, then ``NCCLCopyService.run`` copies same-rank slices on a side stream
    that never waits for those copies: without the wait a rollout copy can read a slice before it
    is written (when the rollout's TP differs from the actor's). One event wait per refit.
    """
    if not torch.cuda.is_available():
        from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

        return GlooCopyService()
    from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService

    class OrderedNCCLCopyService(NCCLCopyService):
        def run(self):
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            super().run()

    return OrderedNCCLCopyService()


def build_rollout_engine(
    actor, actor_groups: LayoutGroups, rollout_groups: LayoutGroups, build_copy
) -> RolloutEngine:
    """The training-layout engine when the layouts agree, else a resharded copy of the actor
    (a model); ``build_copy(rollout_groups)`` builds an unloaded actor model on those groups."""
    if rollout_groups is actor_groups:
        return TrainingLayoutEngine(actor)
    return ReshardedEngine(actor, build_copy(rollout_groups))
