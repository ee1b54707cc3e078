"""Stage 4, update: PPO epochs over minibatches, actor and critic, with Selective Rehearsal.

Each minibatch is one optimizer step of each engine (Megatron's forward-backward schedule over
its microbatches). With rehearsal on, every actor microbatch carries extra rows from D_R: one
forward pass computes the PPO rows' clipped loss and the rehearsal rows' NLL, and
``L_PPO + gamma * NLL`` (Eq. 9) goes through the same backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.handoff import dp_shard
from megatron_rlhf.distributed.parallel import (
    compute_device,
    is_last_stage,
    layout_group,
    vocab_group,
)
from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.losses import masked_mean, policy_loss, ppo_sr_loss, sft_nll, value_loss
from megatron_rlhf.ppo.microbatch import (
    Batching,
    MicroBatch,
    microbatch,
    response_logprobs_of,
    train_step,
    values_of,
)


def actor_loss(
    clip_ratio: float,
    rehearsal_gamma: float,
    temperature: float,
    logits: torch.Tensor,
    mb: MicroBatch,
    rehearsal_nll_reduction: str = "sum",
    *,
    tp_group,
):
    """The actor's loss on one microbatch from its vocab-sharded logits, split over
    ``tp_group`` (``vocab_group(actor.pg)``), normalised as :class:`MicroBatch`
    states; the metrics are each microbatch's share."""
    logits = mb.lm_outputs(logits)  # (1, K, V/tp): the response positions, then rehearsal's
    logprobs, entropy = response_logprobs_of(mb, logits, temperature, tp_group, True)
    loss_ppo, metrics = policy_loss(
        logprobs,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        clip_ratio,
        count=mb.tokens,
        weights=mb.is_weights,
    )
    metrics["policy_loss"] = loss_ppo.detach()
    metrics["entropy"] = masked_mean(entropy, mb.response_mask, mb.tokens).detach()
    nll = None
    if mb.rehearsal_positions is not None:
        positions = mb.rehearsal_positions
        rehearsal_logits = logits[:, logits.shape[1] - positions.shape[0] :]  # (1, T_R, V/tp)
        targets = mb.targets(positions)  # (1, T_R)
        rehearsal_logprobs = token_logprobs(rehearsal_logits, targets, 1.0, tp_group)
        nll = sft_nll(
            rehearsal_logprobs,
            torch.ones_like(targets),
            rehearsal_nll_reduction,
            count=mb.rehearsal_rows if rehearsal_nll_reduction == "sum" else mb.rehearsal_tokens,
        )
        metrics["rehearsal_nll"] = nll.detach()
    return ppo_sr_loss(loss_ppo, nll, rehearsal_gamma) * mb.loss_scale, metrics


def critic_loss(value_clip: float, values: torch.Tensor, mb: MicroBatch):
    """The critic's clipped value loss from its (R, S, 1) outputs, normalised as
    :class:`MicroBatch` states; weighted by ``mb.value_weights`` where the critic's targets
    come with weights (``async.value_targets=suffix_is``)."""
    loss, metrics = value_loss(
        values_of(mb, values),  # (k, N) V(s_t)
        mb.old_values,
        mb.returns,
        mb.response_mask,
        value_clip,
        count=mb.tokens,
        weights=mb.value_weights,
    )
    metrics["value_loss"] = loss.detach()
    return loss * mb.loss_scale, metrics


ACTOR_METRICS = ("policy_loss", "clip_fraction", "approx_kl", "entropy")
CRITIC_METRICS = ("value_loss", "value_clip_fraction")


def ppo_update(
    experience: Experience,
    roles,
    config,
    batching: Batching,
    generator: torch.Generator,
    rehearsal: Iterator[list[dict]] | None,
) -> dict:
    """``ppo.epochs`` epochs of ``ppo.num_minibatches`` optimizer steps over the global batch,
    in an order drawn from ``generator``.

    ``experience`` is the global batch (every rank holds it); ``roles`` the run's
    :class:`~megatron_rlhf.ppo.roles.Roles` (its ``actor`` and ``critic`` are trained);
    ``config`` the run's :class:`~megatron_rlhf.ppo.config.TrainPPOConfig` (its ``ppo``
    section, the log-probs' ``rollout.temperature``, and ``rehearsal.gamma`` and
    ``nll_reduction``). Each global minibatch is split over each role's data-parallel ranks
    (``handoff.dp_shard``); losses are token means over the global minibatch, so any mix of
    layouts takes the single-process step. ``rehearsal`` (None: off) yields each global
    minibatch's rehearsal microbatches (one per global actor microbatch). ``batching``: packed
    microbatches of at most ``max_tokens`` tokens (:func:`_packed_rows`) or
    ``micro_batch_size`` padded rows; the losses are the same token means. Returns metrics
    averaged over minibatches, summed over the DP ranks (every rank gets them).
    """
    actor, critic, ppo = roles.actor, roles.critic, config.ppo
    batch = experience.sequences.shape[0]
    minibatch_size = batch // ppo.num_minibatches
    actor_loss_fn = partial(
        actor_loss,
        ppo.clip_ratio,
        config.rehearsal.gamma,
        config.rollout.temperature,
        rehearsal_nll_reduction=config.rehearsal.nll_reduction,
        tp_group=vocab_group(actor.pg),
    )
    totals: dict[str, list[float]] = {}
    for _ in range(ppo.epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, minibatch_size):
            rows = order[start : start + minibatch_size]
            extra = next(rehearsal) if rehearsal else None
            counts = {"tokens": float(experience.response_mask[rows].sum())}
            counts |= _rehearsal_counts(extra)
            actor_mbs = _microbatches(experience, rows, actor.pg, counts, extra, batching)
            actor_metrics = train_step(actor.engine, actor_mbs, actor_loss_fn, lm_head=True)
            critic_mbs = _microbatches(experience, rows, critic.pg, counts, None, batching)
            critic_metrics = train_step(
                critic.engine, critic_mbs, partial(critic_loss, ppo.value_clip)
            )
            actor_keys = ACTOR_METRICS + (("rehearsal_nll",) if extra else ())
            for role, metrics, keys, count in (
                (actor, actor_metrics, actor_keys, len(actor_mbs)),
                (critic, critic_metrics, CRITIC_METRICS, len(critic_mbs)),
            ):
                summed = _sum_over_replicas(role.pg, metrics, keys, count)
                passed = ("lr", "grad_norm", "time/optimizer_s")
                summed |= {k: metrics[k] for k in passed if k in metrics}
                for key, value in summed.items():
                    totals.setdefault(f"{role.name}/{key}", []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


def _microbatches(
    experience, rows, pg, counts: dict, rehearsal, batching: Batching
) -> list[MicroBatch]:
    """This DP rank's (of ``pg``) microbatches of the global minibatch ``rows``, each PPO
    microbatch with its share of this rank's rehearsal rows (``rehearsal``: the global
    minibatch's rehearsal microbatches, or None): ``batching.micro_batch_size`` padded rows
    with one rehearsal microbatch each, or with ``batching.max_tokens`` packed
    (:func:`_packed_rows`)."""
    max_tokens, pad_id = batching.max_tokens, batching.pad_id
    extra = None if rehearsal is None else dp_shard(rehearsal, pg.dp)
    if max_tokens:
        parts = _packed_rows(experience, rows, pg, max_tokens, _real_rows(extra))
    else:
        mine, size = dp_shard(rows, pg.dp), batching.micro_batch_size
        parts = [
            (mine[i : i + size], _real_rows(extra and extra[j : j + 1]))
            for j, i in enumerate(range(0, mine.shape[0], size))
        ]
    mbs = [
        microbatch(experience.select(part), max_tokens is not None, extra_rows, pad_id)
        for part, extra_rows in parts
    ]
    if not max_tokens or pg.pp.size() > 1:  # one activation shape through the pipeline
        width = max(mb.width for mb in mbs)
        mbs = [mb.padded_to(width, pad_id) for mb in mbs]
    for mb in mbs:
        mb.tokens = counts["tokens"]
        mb.rehearsal_tokens = counts["rehearsal_tokens"]
        mb.rehearsal_rows = counts["rehearsal_rows"]
        mb.loss_scale = len(mbs) * pg.dp.size()
    return mbs


def _packed_rows(experience, rows, pg, max_tokens: int, extra: list[tuple] | None) -> list:
    """(PPO rows, rehearsal rows) of each of this DP rank's packed microbatches of the global
    minibatch ``rows``: the rows balanced by tokens over the DP ranks and this rank's packed
    first-fit into at most ``max_tokens`` tokens; this rank's rehearsal rows ``extra`` spread
    over the packs by tokens, after the PPO rows (a pack may pass the budget by them)."""
    from megatron_rlhf.data.packing import balance_by_tokens, pack_first_fit

    lengths = experience.attention_mask[rows].sum(dim=1).tolist()
    share = balance_by_tokens(lengths, pg.dp.size())[pg.dp.rank()]
    packs = pack_first_fit([lengths[i] for i in share], max_tokens)
    loads = [sum(lengths[share[j]] for j in pack) for pack in packs]
    lengths_extra = [len(ids) for ids, _ in extra or []]
    extra_of_pack = balance_by_tokens(lengths_extra, len(packs), loads)
    return [
        (rows[[share[j] for j in pack]], extra and [extra[r] for r in extra_rows])
        for pack, extra_rows in zip(packs, extra_of_pack)
    ]


def _rehearsal_counts(rehearsal: list[dict] | None) -> dict:
    """The global minibatch's rehearsal target tokens and rows (the NLL's denominators)."""
    return {
        "rehearsal_tokens": sum(float(r["loss_mask"][:, 1:].sum()) for r in rehearsal or []),
        "rehearsal_rows": sum(r["loss_mask"].shape[0] for r in rehearsal or []),
    }


def _real_rows(rehearsal: list[dict] | None) -> list[tuple] | None:
    """The rows of rehearsal microbatches (``collate_sft``) as (token ids, loss mask) pairs of
    each row's real tokens, on the compute device (None: rehearsal off)."""
    if rehearsal is None:
        return None
    device = compute_device()
    sequences = []
    for microbatch_ in rehearsal:
        for ids, mask, loss_mask in zip(
            microbatch_["input_ids"], microbatch_["attention_mask"], microbatch_["loss_mask"]
        ):
            real = mask.bool()
            sequences.append((ids[real].to(device), loss_mask[real].to(device)))
    return sequences


def _sum_over_replicas(pg, metrics: dict, keys, num_microbatches: int) -> dict:
    """Each metric summed over microbatches and DP replicas (one contribution per replica:
    its last pipeline stage, TP rank 0, of ``pg``), then handed to every rank of the
    layout (the world, or the training ranks of the disaggregated placement)."""
    contributes = is_last_stage(pg) and pg.tp.rank() == 0
    values = torch.tensor(
        [metrics[k] * num_microbatches if contributes else 0.0 for k in keys],
        dtype=torch.float64,
        device=compute_device(),
    )
    if dist.is_initialized():
        dist.all_reduce(values, group=layout_group(pg))
    return dict(zip(keys, values.tolist()))
