"""The rollout seam: which model, in which layout, generates (a PPO step's responses, and
``generate``'s and ``eval-policy``'s through ``generation/prompts.engine_from_args``).

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

- :class:`VLLMRolloutEngine` (``rollout.engine=vllm``): vLLM serves the actor in the rollout
  layout (vLLM's TP = the layout's TP, one vLLM data-parallel replica per DP rank), its
  weights replaced in memory before each rollout (``generation/vllm_engine.py``).

Plugging in another engine (Megatron-Core's inference engine, SGLang; pipelined micro-batches
at PP > 1 are already inside ``generate``): write a class with ``groups`` (the
``ProcessGroupCollection`` of the layout it generates in), ``refresh()`` (returns the seconds
the weight sync took, or None), ``close()``, and ``generate(prompt_ids, prompt_mask, sampling)
-> GenerationOutput`` with the contract of :func:`megatron_rlhf.generation.generate`
(left-padded prompts of this rank's rows; every rank of a replica gets the same outputs;
honour ``sampling.row_seeds`` so that tokens do not depend on the layout), and return it from
:func:`build_rollout_engine`.
"""

from __future__ import annotations

import time
import warnings
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.groups import LayoutGroups
from megatron_rlhf.distributed.parallel import group_max, world_max
from megatron_rlhf.generation import GenerationOutput, SamplingConfig, generate
from megatron_rlhf.utils import InputError


class RolloutEngine(Protocol):
    groups: object
    """The process groups (a ``ProcessGroupCollection``) the engine generates on; its DP ranks
    split the global prompts."""

    sync_bytes_per_rank: int | None
    """Bytes a ``refresh()`` writes into this rank's generation weights (0: none, the actor
    itself generates)."""
    sync_remote_bytes_per_rank: int | None
    """Of those, the bytes this rank receives from other ranks (None: not known)."""

    def refresh(self) -> float | None:
        """Make the generation weights equal the actor's current weights (collective); the
        seconds a weight copy took, or None when the engine generates with the actor itself."""

    def close(self) -> None:
        """Release the engine (end of the run)."""

    def idle_calls(self, calls: int) -> int:
        """Called by every rank before its first ``generate`` with how many it will make: how
        many one-token ``idle_call()``s it must add after them (collective over
        ``groups.dp``; 0 except for engines whose data-parallel replicas step together)."""

    def idle_call(self) -> None:
        """A one-token call that keeps this replica in step with the others."""

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig
    ) -> GenerationOutput:
        """Responses of this rank's rows (collective over ``self.groups``)."""


class _OurDecode:
    """Our engines' ``RolloutEngine`` parts that do nothing: nothing to release, and data-
    parallel replicas that generate independently (no calls to keep in step)."""

    def close(self) -> None:
        pass

    def idle_calls(self, calls: int) -> int:
        return 0

    def idle_call(self) -> None:
        pass


class TrainingLayoutEngine(_OurDecode):
    """The actor generates in its training layout."""

    sync_bytes_per_rank = sync_remote_bytes_per_rank = 0  # no copy

    def __init__(self, actor):
        self.actor, self.groups = actor, actor.pg_collection

    def refresh(self) -> None:
        return None

    def generate(self, prompt_ids, prompt_mask, sampling) -> GenerationOutput:
        return generate(self.actor, prompt_ids, prompt_mask, sampling)


class ReshardedEngine(_OurDecode):
    """A copy of the actor in the rollout layout, refit from the actor before each rollout."""

    def __init__(self, actor, model):
        self.actor, self.model, self.groups = actor, model, model.pg_collection
        self.model.requires_grad_(False)
        self.copy_service = refit_copy_service()
        # the refit writes every parameter of this rank's copy (its tp x pp shard); how much
        # of it crosses ranks is Megatron-Core's reshard plan's business (not counted: None)
        self.sync_bytes_per_rank = sum(
            p.numel() * p.element_size() for p in self.model.parameters()
        )
        self.sync_remote_bytes_per_rank = None

    def refresh(self) -> float:
        from megatron.core.resharding import swap_model_weights

        start = time.perf_counter()
        with torch.no_grad():
            swap_model_weights(self.actor, self.model, self.copy_service)
        return time.perf_counter() - start

    def generate(self, prompt_ids, prompt_mask, sampling) -> GenerationOutput:
        return generate(self.model, prompt_ids, prompt_mask, sampling)


class VLLMRolloutEngine:
    """vLLM generates; the actor's weights reach it in memory before each rollout.

    The rollout layout must be PP = 1 (vLLM's external launcher has no pipeline parallelism)
    with its TP groups on consecutive ranks (Megatron's rank order puts TP first), which is how
    vLLM groups the ranks: one vLLM TP group per rollout TP group, one vLLM data-parallel
    replica per rollout DP rank.

    The sync is shard-to-shard (``generation/shard_sync.py``): each rank receives only its
    vLLM TP shard of every tensor (1/TP of the model, plus the replicated norms and biases),
    from itself where its actor shard holds it (actor TP = rollout TP: nothing moves but
    vocabulary rows the two pad differently), else point-to-point from one actor rank that
    does, in buckets of ``sync_bucket_mb``, written into vLLM's parameters (in place, except
    what vLLM's CPU backend packs: ``vllm_engine._load_shards``). The plan is built at the
    first sync. Fallback, decided there by every rank together: a vLLM whose BLOOM is not
    sharded as the plan assumes (``VLLMGenerator.check_shards``) gets the full stream of
    every HF tensor to every rank (``checkpoint/hf_stream.py``, vLLM's ``reload_weights``),
    with a warning."""

    def __init__(
        self,
        actor,
        groups,
        *,
        max_model_len: int,
        max_rows: int,
        seed: int,
        sync_bucket_mb: float = 256,
    ):
        from megatron_rlhf.generation.vllm_engine import VLLMGenerator

        self.actor, self.groups = actor, groups
        self.bucket_bytes = int(sync_bucket_mb * 2**20)
        self._plan, self.full_stream = None, False
        self.sync_bytes_per_rank: int | None = None
        self.sync_remote_bytes_per_rank: int | None = None
        check_vllm_layout(groups)
        self.generator = VLLMGenerator(
            actor.arch,
            tp=groups.tp.size(),
            world_size=dist.get_world_size(),
            dtype=actor.config.params_dtype,
            max_model_len=max_model_len,
            max_rows=max_rows,
            seed=seed,
        )

    def refresh(self) -> float:
        from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
        from megatron_rlhf.generation.shard_sync import actor_sources

        if self._plan is None and not self.full_stream:
            self._build_plan()
        if self.full_stream:
            with torch.no_grad():
                return self.generator.load_weights(hf_tensor_stream(self.actor))
        return self.generator.load_shards(self._plan, actor_sources(self.actor))

    def _build_plan(self) -> None:
        """The shard-to-shard plan (collective: one all-gather of every rank's layout), or
        the full stream when any rank's vLLM cannot take it."""
        from megatron_rlhf.checkpoint.hf_names import full_hf_name, hf_names
        from megatron_rlhf.generation.vllm_layout import vllm_plan

        order = [full_hf_name(name) for name in hf_names(self.actor.arch.num_layers, "lm")]
        try:  # every rank reaches the vote below, whatever fails here
            plan, _ = vllm_plan(self.actor, self.groups.tp, self.bucket_bytes, order)
            reason = self.generator.check_shards(plan)
        except ValueError as err:  # e.g. a vocabulary vLLM's TP does not split
            plan, reason = None, str(err)
        if world_max(0 if reason is None else 1):
            warnings.warn(
                f"vLLM's BLOOM is not sharded as the shard-to-shard sync assumes "
                f"({reason or 'on another rank'}): every sync streams every full tensor",
                stacklevel=2,
            )
            self.full_stream = True
            self.sync_bytes_per_rank = _full_model_bytes(self.actor)
            self.sync_remote_bytes_per_rank = self.sync_bytes_per_rank
            return
        self._plan = plan
        self.sync_bytes_per_rank = plan.received_bytes
        self.sync_remote_bytes_per_rank = plan.remote_bytes

    def close(self) -> None:
        self.generator.close()

    def idle_calls(self, calls: int) -> int:
        """vLLM's data-parallel replicas step in lockstep (a replica with nothing to do runs
        dummy steps while another still generates), so every rank must call ``generate`` as
        often as the rank with the most calls: agreed before the first call (an all-reduce
        between two calls would wait on a replica that waits on vLLM's own all-reduce)."""
        return group_max(calls, self.groups.dp) - calls

    def idle_call(self) -> None:
        one = torch.ones((1, 1), dtype=torch.long)
        self.generator.generate(one, one, SamplingConfig(max_new_tokens=1, greedy=True))

    def generate(self, prompt_ids, prompt_mask, sampling) -> GenerationOutput:
        out = self.generator.generate(prompt_ids, prompt_mask, sampling, self.groups.dp.rank())
        self.generator.sleep()  # GPUs: free weights and KV cache for the update
        return out


def _full_model_bytes(model) -> int:
    """Bytes of every HF tensor of ``model`` (what the full stream hands each rank)."""
    from megatron_rlhf.planning.shapes import model_params

    return model_params(model.arch) * model.config.params_dtype.itemsize


def check_vllm_layout(groups) -> None:
    """vLLM's external launcher puts ranks ``[i * tp, (i + 1) * tp)`` in one TP group and has
    no pipeline stages: the rollout layout must agree."""
    if groups.pp.size() != 1:
        raise InputError(
            f"rollout.engine=vllm needs a rollout layout without pipeline stages (it has "
            f"{groups.pp.size()}); set parallel.rollout.pp=1 (vLLM's TP and data parallelism "
            "serve the model instead)"
        )
    tp = groups.tp.size()
    members = [dist.get_global_rank(groups.tp, i) for i in range(tp)]
    if members != list(range(members[0], members[0] + tp)) or members[0] % tp:
        raise InputError(
            f"rollout.engine=vllm needs the rollout's TP groups on consecutive ranks; this "
            f"rank's group is {members}"
        )


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
    actor,
    actor_groups: LayoutGroups,
    rollout_groups: LayoutGroups,
    build_copy,
    engine: str = "megatron",
    vllm_settings: dict | None = None,
) -> RolloutEngine:
    """``engine="vllm"``: vLLM in the rollout layout (``vllm_settings``: max_model_len,
    max_rows, seed). Else the training-layout engine when the layouts agree, or a resharded
    copy of the actor (a model); ``build_copy(rollout_groups)`` builds an unloaded actor model
    on those groups."""
    if engine == "vllm":
        return VLLMRolloutEngine(actor, rollout_groups.pg_collection, **(vllm_settings or {}))
    if rollout_groups is actor_groups:
        return TrainingLayoutEngine(actor)
    return ReshardedEngine(actor, build_copy(rollout_groups))
