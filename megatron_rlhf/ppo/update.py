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

from megatron_rlhf.distributed.handoff import dp_rows
from megatron_rlhf.distributed.parallel import compute_device, is_last_stage, vocab_group
from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.losses import masked_mean, policy_loss, ppo_sr_loss, sft_nll, value_loss
from megatron_rlhf.ppo.scoring import response_logprobs


def right_pad(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)


def actor_microbatch(experience: Experience, rehearsal: dict | None, pad_id: int) -> dict:
    """PPO rows, then (optionally) rehearsal rows from ``collate_sft``, in one batch."""
    sequences, mask = experience.sequences, experience.attention_mask
    microbatch = {
        "num_ppo_rows": sequences.shape[0],
        "prompt_length": experience.prompt_length,
        "old_logprobs": experience.logprobs,
        "is_weights": experience.is_weights,
        "advantages": experience.advantages,
        "response_mask": experience.response_mask,
    }
    if rehearsal is not None:
        rehearsal = {key: value.to(sequences.device) for key, value in rehearsal.items()}
        width = max(sequences.shape[1], rehearsal["input_ids"].shape[1])
        sequences = torch.cat(
            [right_pad(sequences, width, pad_id), right_pad(rehearsal["input_ids"], width, pad_id)]
        )
        mask = torch.cat(
            [right_pad(mask, width, 0), right_pad(rehearsal["attention_mask"], width, 0)]
        )
        microbatch["rehearsal_loss_mask"] = right_pad(rehearsal["loss_mask"], width, 0)
    microbatch["input_ids"], microbatch["padding_mask"] = sequences, mask
    return microbatch


def actor_loss(
    clip_ratio: float,
    rehearsal_gamma: float,
    temperature: float,
    logits: torch.Tensor,
    mb: dict,
    rehearsal_nll_reduction: str = "sum",
    *,
    tp_group,
):
    """The actor's loss on one microbatch from its vocab-sharded logits (B, S, V/tp), split over
    ``tp_group`` (``vocab_group`` of the actor's groups).

    Token sums divided by the global minibatch's token counts (``mb["tokens"]``, and
    ``mb["rehearsal_rows"]`` or ``mb["rehearsal_tokens"]`` by the NLL's reduction): the microbatches of every DP rank add up to the global token
    means. The returned loss is multiplied by ``mb["loss_scale"]`` (microbatches x DP ranks) to
    undo the schedule's and DDP's averaging; the metrics are each microbatch's share.
    """
    if "predicting" in mb:  # packed: the logits of mb["output_positions"] only
        logprobs, entropy = packed_response_logprobs(logits, mb, temperature, tp_group)
    else:
        ppo_rows = mb["num_ppo_rows"]
        logprobs, entropy = response_logprobs(
            logits[:ppo_rows],
            mb["input_ids"][:ppo_rows],
            mb["prompt_length"],
            mb["response_mask"].shape[1],
            temperature,
            return_entropy=True,
            tp_group=tp_group,
        )
    loss_ppo, metrics = policy_loss(
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        clip_ratio,
        count=mb["tokens"],
        weights=mb.get("is_weights"),
    )
    metrics["policy_loss"] = loss_ppo.detach()
    metrics["entropy"] = masked_mean(entropy, mb["response_mask"], mb["tokens"]).detach()
    nll = None
    if "rehearsal_loss_mask" in mb or "rehearsal_positions" in mb:
        if "rehearsal_positions" in mb:  # packed: the positions predicting a target token
            positions = mb["rehearsal_positions"]
            first = logits.shape[1] - positions.shape[0]  # (1, R, V/tp) follow the PPO's M
            rehearsal_logits = logits[:, first:]
            targets = mb["input_ids"][:, positions + 1]  # (1, R)
            target_mask = torch.ones_like(targets)
        else:
            rehearsal_logits = logits[ppo_rows:, :-1]  # (R, S - 1, V/tp)
            targets = mb["input_ids"][ppo_rows:, 1:]  # (R, S - 1)
            target_mask = mb["rehearsal_loss_mask"][:, 1:]
        rehearsal_logprobs = token_logprobs(rehearsal_logits, targets, 1.0, tp_group)
        nll = sft_nll(
            rehearsal_logprobs,
            target_mask,
            rehearsal_nll_reduction,
            count=mb["rehearsal_rows" if rehearsal_nll_reduction == "sum" else "rehearsal_tokens"],
        )
        metrics["rehearsal_nll"] = nll.detach()
    return ppo_sr_loss(loss_ppo, nll, rehearsal_gamma) * mb["loss_scale"], metrics


def critic_loss(value_clip: float, values: torch.Tensor, mb: dict):
    """The critic's clipped value loss from its (B, S, 1) outputs (token sums over the global
    minibatch's token count, scaled like :func:`actor_loss`)."""
    if "predicting" in mb:  # packed
        predicted = values[0, mb["predicting"], 0] * mb["response_mask"]  # (k, N)
    else:
        p, n = mb["prompt_length"], mb["response_mask"].shape[1]
        predicted = values[:, p - 1 : p - 1 + n, 0]  # (B, N) V(s_t)
    loss, metrics = value_loss(
        predicted,
        mb["old_values"],
        mb["returns"],
        mb["response_mask"],
        value_clip,
        count=mb["tokens"],
    )
    metrics["value_loss"] = loss.detach()
    return loss * mb["loss_scale"], metrics


def packed_response_logprobs(logits: torch.Tensor, mb: dict, temperature: float, tp_group):
    """:func:`response_logprobs` of a packed row: log pi and entropy (k, N) of each packed PPO
    row's response tokens (0 elsewhere) from the logits (1, K, V/tp) of the microbatch's
    ``output_positions``, whose first M are the positions predicting them."""
    real = mb["response_mask"].bool()  # (k, N)
    positions = mb["predicting"][real]  # (M,)
    logprobs, entropy = token_logprobs(
        logits[:, : positions.shape[0]], mb["input_ids"][:, positions + 1], temperature,
        tp_group, return_entropy=True,
    )  # fmt: skip
    spread = []
    for flat in (logprobs, entropy):
        full = flat.new_zeros(real.shape)
        full[real] = flat[0]
        spread.append(full)
    return spread[0], spread[1]


ACTOR_METRICS = ("policy_loss", "clip_fraction", "approx_kl", "entropy")
CRITIC_METRICS = ("value_loss", "value_clip_fraction")


def ppo_update(
    experience: Experience,
    actor,
    critic,
    ppo,
    temperature: float,
    generator: torch.Generator,
    rehearsal_minibatches: Iterator[list[dict]] | None = None,
    rehearsal_gamma: float = 0.0,
    pad_id: int = 3,
    rehearsal_nll_reduction: str = "sum",
    max_tokens: int | None = None,
) -> dict:
    """``ppo.epochs`` epochs of ``ppo.num_minibatches`` optimizer steps over the global batch.

    ``experience`` is the global batch (every rank holds it); ``actor`` and ``critic`` are
    :class:`~megatron_rlhf.ppo.setup.Role` values. Each global minibatch is split over each
    role's data-parallel ranks (``role.groups.dp``); losses are token means over
    the global minibatch, so any mix of layouts takes the single-process step. With
    rehearsal, ``rehearsal_minibatches`` yields the global minibatch's rehearsal microbatches
    (one per global actor microbatch). ``max_tokens``: packed microbatches of at most that
    many tokens (:func:`_packed_microbatches`) instead of ``ppo.micro_batch_size`` padded rows;
    the losses are the same token means. Returns metrics averaged over minibatches, summed over
    the DP ranks (every rank gets them).
    """
    batch = experience.sequences.shape[0]
    minibatch_size = batch // ppo.num_minibatches
    totals: dict[str, list[float]] = {}
    for _ in range(ppo.epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, minibatch_size):
            rows = order[start : start + minibatch_size]
            tokens = float(experience.response_mask[rows].sum())
            rehearsal = next(rehearsal_minibatches) if rehearsal_minibatches else None
            if max_tokens:
                actor_mbs = _packed_microbatches(
                    experience, rows, actor.groups, max_tokens, tokens, rehearsal, pad_id
                )
                for mb in actor_mbs:
                    mb["output_positions"] = _actor_output_positions(mb)
            else:
                actor_mbs = _actor_microbatches(
                    experience, rows, actor.groups, ppo.micro_batch_size, tokens, rehearsal, pad_id
                )
            loss_fn = partial(
                actor_loss,
                ppo.clip_ratio,
                rehearsal_gamma,
                temperature,
                rehearsal_nll_reduction=rehearsal_nll_reduction,
                tp_group=vocab_group(actor.groups),
            )
            actor_metrics = actor.engine.step(actor_mbs, loss_fn)
            critic_mbs = _critic_microbatches(
                experience, rows, critic.groups, ppo.micro_batch_size, tokens, pad_id, max_tokens
            )
            critic_metrics = critic.engine.step(critic_mbs, partial(critic_loss, ppo.value_clip))
            actor_keys = ACTOR_METRICS + (("rehearsal_nll",) if rehearsal else ())
            for role, metrics, keys, count in (
                (actor, actor_metrics, actor_keys, len(actor_mbs)),
                (critic, critic_metrics, CRITIC_METRICS, len(critic_mbs)),
            ):
                summed = _sum_over_replicas(role.groups, metrics, keys, count)
                passed = ("lr", "grad_norm", "time/optimizer_s")
                summed |= {k: metrics[k] for k in passed if k in metrics}
                for key, value in summed.items():
                    totals.setdefault(f"{role.name}/{key}", []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


def _my_microbatches(experience, rows, groups, micro_batch_size: int) -> list[Experience]:
    """This DP rank's (of ``groups``) microbatches of the global minibatch ``rows``."""
    mine = rows[dp_rows(rows.shape[0], groups.dp.size(), groups.dp.rank())]
    return [
        experience.select(mine[i : i + micro_batch_size])
        for i in range(0, mine.shape[0], micro_batch_size)
    ]


def _actor_microbatches(
    experience, rows, groups, micro_batch_size, tokens, rehearsal, pad_id
) -> list[dict]:
    micro = _my_microbatches(experience, rows, groups, micro_batch_size)
    mine = rehearsal
    if rehearsal is not None:  # this rank's share of the global rehearsal microbatches
        mine = rehearsal[dp_rows(len(rehearsal), groups.dp.size(), groups.dp.rank())]
    mbs = [actor_microbatch(m, mine[i] if mine else None, pad_id) for i, m in enumerate(micro)]
    counts = _rehearsal_counts(rehearsal)
    for mb in mbs:
        mb["tokens"] = tokens
        mb.update(counts)
    _pad_to_common_width(mbs, pad_id)
    _set_loss_scale(mbs, groups)
    return mbs


def _critic_microbatches(
    experience, rows, groups, micro_batch_size, tokens, pad_id, max_tokens
) -> list[dict]:
    """This DP rank's critic microbatches of the global minibatch ``rows``: packed when
    ``max_tokens`` is set, else ``micro_batch_size`` padded rows."""
    if max_tokens:
        return _packed_microbatches(experience, rows, groups, max_tokens, tokens, None, pad_id)
    microbatches = [
        {
            "input_ids": m.sequences,
            "padding_mask": m.attention_mask,
            "prompt_length": m.prompt_length,
            "old_values": m.values,
            "returns": m.returns,
            "response_mask": m.response_mask,
            "tokens": tokens,
        }
        for m in _my_microbatches(experience, rows, groups, micro_batch_size)
    ]
    _set_loss_scale(microbatches, groups)
    return microbatches


def _packed_microbatches(
    experience, rows, groups, max_tokens: int, tokens: float, rehearsal, pad_id: int
) -> list[dict]:
    """This DP rank's (of ``groups``) packed microbatches of the global minibatch ``rows``.

    The minibatch's rows are balanced by tokens over the DP ranks and this rank's packed
    first-fit into rows of at most ``max_tokens`` tokens; with rehearsal, this rank's share of
    the rehearsal rows (as the padded path's) is spread over the packs by tokens, after the PPO
    rows (a pack may pass the budget by them). Each microbatch holds the packed ``input_ids``
    and ``padding_mask`` (1, T), ``predicting`` (k, N): the position predicting each response
    token of its k PPO rows (0 where ``response_mask`` is 0), the rows' per-token fields, and
    with rehearsal ``rehearsal_positions``: the positions predicting a rehearsal target.
    """
    from megatron_rlhf.data.packing import balance_by_tokens, pack_first_fit, pack_sequences

    lengths = experience.attention_mask[rows].sum(dim=1).tolist()
    share = balance_by_tokens(lengths, groups.dp.size())[groups.dp.rank()]
    packs = pack_first_fit([lengths[i] for i in share], max_tokens)
    extra = [] if rehearsal is None else _rehearsal_sequences(rehearsal, groups, experience)
    loads = [sum(lengths[share[j]] for j in pack) for pack in packs]
    extra_of_pack = balance_by_tokens([len(ids) for ids, _ in extra], len(packs), loads)
    p, n = experience.prompt_length, experience.response_mask.shape[1]
    steps = torch.arange(n, device=experience.sequences.device)
    counts = _rehearsal_counts(rehearsal)
    microbatches = []
    for pack, extra_rows in zip(packs, extra_of_pack):
        sub = experience.select(rows[[share[j] for j in pack]])
        real = sub.attention_mask.bool()
        sequences = [sub.sequences[r][real[r]] for r in range(real.shape[0])]
        packed = pack_sequences(sequences + [extra[r][0] for r in extra_rows])
        ppo_starts = packed.starts[: len(pack)]
        predicting = (ppo_starts + real[:, :p].sum(dim=1) - 1)[:, None] + steps[None, :]
        microbatch = {
            "input_ids": packed.input_ids,
            "padding_mask": packed.segments,
            "predicting": torch.where(sub.response_mask.bool(), predicting, 0),
            "response_mask": sub.response_mask,
            "old_logprobs": sub.logprobs,
            "is_weights": sub.is_weights,
            "advantages": sub.advantages,
            "old_values": sub.values,
            "returns": sub.returns,
            "tokens": tokens,
        }
        if rehearsal is not None:
            targets = torch.zeros_like(packed.input_ids[0])  # 1 where a rehearsal target sits
            for r, start in zip(extra_rows, packed.starts[len(pack) :].tolist()):
                loss_mask = extra[r][1]
                targets[start + 1 : start + len(loss_mask)] = loss_mask[1:]
            microbatch["rehearsal_positions"] = targets[1:].nonzero()[:, 0]
            microbatch.update(counts)
        microbatches.append(microbatch)
    if groups.pp.size() > 1:  # one activation shape through the pipeline
        _pad_to_common_width(microbatches, pad_id)
    _set_loss_scale(microbatches, groups)
    return microbatches


def _actor_output_positions(microbatch: dict) -> torch.Tensor:
    """The columns of a packed actor microbatch whose logits the loss reads: those predicting a
    response token (in ``predicting`` order), then those predicting a rehearsal target. The
    LM head runs on these alone (``BloomModel.forward(output_positions=...)``): at BLOOM's
    vocabulary it is most of the actor's FLOPs, and prompt positions are most of a row."""
    ppo = microbatch["predicting"][microbatch["response_mask"].bool()]
    return torch.cat([ppo, microbatch.get("rehearsal_positions", ppo[:0])])


def _rehearsal_counts(rehearsal: list[dict] | None) -> dict:
    """The global minibatch's rehearsal target tokens and rows (the NLL's denominators)."""
    return {
        "rehearsal_tokens": sum(float(r["loss_mask"][:, 1:].sum()) for r in rehearsal or []),
        "rehearsal_rows": sum(r["loss_mask"].shape[0] for r in rehearsal or []),
    }


def _rehearsal_sequences(rehearsal: list[dict], groups, experience) -> list[tuple]:
    """This DP rank's share of the global rehearsal microbatches (as the padded path's), as
    (token ids, loss mask) pairs of each row's real tokens, on the experience's device."""
    device = experience.sequences.device
    sequences = []
    for microbatch in rehearsal[dp_rows(len(rehearsal), groups.dp.size(), groups.dp.rank())]:
        for ids, mask, loss_mask in zip(
            microbatch["input_ids"], microbatch["attention_mask"], microbatch["loss_mask"]
        ):
            real = mask.bool()
            sequences.append((ids[real].to(device), loss_mask[real].to(device)))
    return sequences


def _set_loss_scale(microbatches: list[dict], groups) -> None:
    scale = len(microbatches) * groups.dp.size()
    for mb in microbatches:
        mb["loss_scale"] = scale


def _sum_over_replicas(groups, metrics: dict, keys, num_microbatches: int) -> dict:
    """Each metric summed over microbatches and DP replicas (one contribution per replica:
    its last pipeline stage, TP rank 0, of ``groups``), then handed to every rank of the
    world."""
    contributes = is_last_stage(groups) and groups.tp.rank() == 0
    values = torch.tensor(
        [metrics[k] * num_microbatches if contributes else 0.0 for k in keys],
        dtype=torch.float64,
        device=compute_device(),
    )
    if dist.is_initialized():
        dist.all_reduce(values)
    return dict(zip(keys, values.tolist()))


def _pad_to_common_width(microbatches: list[dict], pad_id: int) -> None:
    """Megatron's schedules send fixed-shape activations: pad every microbatch of a step."""
    width = max(mb["input_ids"].shape[1] for mb in microbatches)
    for mb in microbatches:
        mb["input_ids"] = right_pad(mb["input_ids"], width, pad_id)
        mb["padding_mask"] = right_pad(mb["padding_mask"], width, 0)
        if "rehearsal_loss_mask" in mb:
            mb["rehearsal_loss_mask"] = right_pad(mb["rehearsal_loss_mask"], width, 0)
