"""Stage 2, score: old/reference log-probs, values and the reward/advantage score.

Four forward passes over the same (prompt + response) sequences, run across the pipeline and
broadcast from its last stage so every rank holds the full :class:`Experience`. With a token
budget (``ppo.packing``) the rows' real tokens are packed back to back into micro-batches of at
most that many tokens (``data/packing.py``: no padding computed; every value equals the padded
pass's on the response tokens, 0 on padding), else ``micro_batch_size`` padded rows at a time. Log-probs come
from this rank's vocabulary shard of the logits through the fused ``token_logprobs`` kernel
(one all-reduce over the TP group; full logits are never gathered).
"""

from __future__ import annotations

import torch

from megatron_rlhf.data.packing import pack_by_budget, pack_rows
from megatron_rlhf.distributed.handoff import dp_rows, gather_rows
from megatron_rlhf.distributed.parallel import is_last_stage, model_groups, vocab_group
from megatron_rlhf.distributed.pipeline import broadcast_from_last_stage, pipeline_forward
from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.reward.model import (
    NUM_OUTPUTS,
    advantage_scores,
    read_packed_scalars,
    read_scalars,
)


def response_logprobs(
    logits_shard: torch.Tensor,  # (B, P + N, V/tp)
    sequences: torch.Tensor,  # (B, P + N)
    prompt_length: int,
    response_length: int,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    tp_group,
):
    """log pi(a_t | s_t) (B, N) of the response tokens (and the entropy per position).

    ``tp_group``: the group the model's vocabulary is split over
    (``distributed.parallel.vocab_group(model_groups(model))``; None at tp = 1). Columns past
    ``prompt_length + response_length`` (extra right padding) are ignored.
    """
    end = prompt_length + response_length
    predicting = logits_shard[:, prompt_length - 1 : end - 1]  # (B, N, V/tp)
    targets = sequences[:, prompt_length:end]  # (B, N)
    return token_logprobs(predicting, targets, temperature, tp_group, return_entropy=return_entropy)


def sequence_scores(
    scalars: torch.Tensor,  # (B, P + N, outputs) of the reward/advantage model
    attention_mask: torch.Tensor,  # (B, P + N)
    prompt_length: int,
    reward_kind: str,
) -> torch.Tensor:
    """The score of each response (B,): r at its last token (RM), or ``a = r - e_tau(x)`` with
    e_tau read at the last prompt token (AM; K = 0 at PPO time: Eq. 8 with no behaviour
    policies). Prompts are left-padded to width P, so every prompt ends at column P - 1."""
    if scalars.shape[-1] != NUM_OUTPUTS[reward_kind]:
        raise ValueError(f"a {reward_kind} scores with {NUM_OUTPUTS[reward_kind]} outputs")
    prompt_ends = torch.full((scalars.shape[0],), prompt_length, device=scalars.device)
    return advantage_scores(*read_scalars(scalars, attention_mask, prompt_ends))


def function_scores(reward_fn, experience: Experience) -> torch.Tensor:
    """Scores (B,) of a user function of (prompt ids, response ids), without padding."""
    scores = []
    for row in range(experience.sequences.shape[0]):
        prompt_mask = experience.attention_mask[row, : experience.prompt_length].bool()
        prompt = experience.sequences[row, : experience.prompt_length][prompt_mask].tolist()
        response_mask = experience.response_mask[row].bool()
        response = experience.responses[row][response_mask].tolist()
        scores.append(float(reward_fn(prompt, response)))
    return torch.tensor(scores, dtype=torch.float32, device=experience.sequences.device)


@torch.no_grad()
def score(
    experience: Experience,
    models: dict,
    reward_kind: str,
    temperature: float,
    micro_batch_size: int,
    reward_fn=None,
    max_tokens: int | None = None,
) -> Experience:
    """Fill what the given models provide, ``micro_batch_size`` rows at a time, or, with
    ``max_tokens``, packed micro-batches of at most that many real tokens.

    ``models`` maps roles to models: actor -> ``logprobs``, reference -> ``ref_logprobs``,
    critic -> ``values``, reward -> ``scores``. With ``reward_fn`` (a callable
    ``(prompt_ids, response_ids) -> float``) scores come from it instead of a reward model.
    """
    if max_tokens is not None:
        return _score_packed(experience, models, reward_kind, temperature, max_tokens, reward_fn)
    p, (batch, width) = experience.prompt_length, experience.sequences.shape
    n = width - p
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, batch, micro_batch_size):
        rows = torch.arange(start, min(start + micro_batch_size, batch))
        seq, mask = experience.sequences[rows], experience.attention_mask[rows]
        outputs = {role: pipeline_forward(model, seq, mask) for role, model in models.items()}
        for role, output in outputs.items():
            groups = model_groups(models[role])
            name, value, shape = _from_output(
                role, output, seq, mask, p, n, temperature, reward_kind, groups
            )
            parts.setdefault(name, []).append(
                broadcast_from_last_stage(value, shape, torch.float32, groups)
            )
        if reward_fn is not None:
            parts.setdefault("scores", []).append(
                function_scores(reward_fn, experience.select(rows))
            )
    for name, chunks in parts.items():
        setattr(experience, name, torch.cat(chunks))
    if experience.values is not None:
        experience.values = experience.values * experience.response_mask
    return experience


def _score_packed(experience, models, reward_kind, temperature, max_tokens, reward_fn):
    """:func:`score` over packed micro-batches: each row's real tokens (left-padded prompt,
    then the response up to its end) back to back, at most ``max_tokens`` per pack."""
    p, n = experience.prompt_length, experience.responses.shape[1]
    prompt_lengths = experience.attention_mask[:, :p].sum(dim=1)  # (B,)
    response_lengths = experience.response_mask.sum(dim=1)  # (B,)
    lengths = (prompt_lengths + response_lengths).tolist()
    parts: dict[str, list[torch.Tensor]] = {}
    for rows in pack_by_budget(lengths, max_tokens):
        index = torch.tensor(rows, device=experience.sequences.device)
        packed = pack_rows(experience.sequences[index], experience.attention_mask[index])
        prompt = prompt_lengths[index]
        steps = torch.arange(n, device=index.device)
        # the position predicting response token t of each row, and which (row, t) are real
        predicting = (packed.starts + prompt - 1)[:, None] + steps[None, :]  # (k, N)
        real = steps[None, :] < response_lengths[index][:, None]  # (k, N)
        predicting = torch.where(real, predicting, 0)
        last = packed.starts + packed.lengths - 1  # (k,) each row's last token
        for role, model in models.items():
            groups = model_groups(model)
            # log-probs need the logits of the positions predicting a response token only
            select = {"output_positions": predicting[real]} if role in LM_ROLES else {}
            output = pipeline_forward(model, packed.input_ids, packed.segments, **select)
            name, value, shape = _from_packed_output(
                role, output, packed, predicting, real, last, packed.starts + prompt - 1,
                temperature, reward_kind, groups,
            )  # fmt: skip
            parts.setdefault(name, []).append(
                broadcast_from_last_stage(value, shape, torch.float32, groups)
            )
    for name, chunks in parts.items():
        setattr(experience, name, torch.cat(chunks))
    if reward_fn is not None:
        experience.scores = function_scores(reward_fn, experience)
    return experience


def _from_packed_output(
    role, output, packed, predicting, real, last, prompt_ends, temperature, reward_kind, groups
):
    """(field, value on the last stage else None, shape) of one role from a packed forward."""
    rows, n = predicting.shape
    if not is_last_stage(groups):
        return FIELD_OF_ROLE[role], None, (rows,) if role == "reward" else (rows, n)
    if role in LM_ROLES:  # output: the logits (1, M, V/tp) at predicting[real]
        targets = packed.input_ids[:, predicting[real] + 1]
        logprobs = token_logprobs(output, targets, temperature, vocab_group(groups))[0]
        spread = logprobs.new_zeros((rows, n)).masked_scatter(real, logprobs)
        return FIELD_OF_ROLE[role], spread, (rows, n)
    if role == "critic":
        return "values", output[0, :, 0].float()[predicting] * real, (rows, n)
    if output.shape[-1] != NUM_OUTPUTS[reward_kind]:
        raise ValueError(f"a {reward_kind} scores with {NUM_OUTPUTS[reward_kind]} outputs")
    rewards, expected = read_packed_scalars(output.float(), last, prompt_ends)
    return "scores", advantage_scores(rewards, expected), (rows,)


LM_ROLES = ("actor", "reference")
FIELD_OF_ROLE = {
    "actor": "logprobs",
    "reference": "ref_logprobs",
    "critic": "values",
    "reward": "scores",
}


def score_in_layouts(
    experience: Experience,
    roles: list,
    reward_kind: str,
    temperature: float,
    micro_batch_size: int,
    reward_fn=None,
    max_tokens: int | None = None,
) -> Experience:
    """:func:`score` with every role in its own layout, on the global batch held by every rank.

    ``roles``: :class:`~megatron_rlhf.ppo.setup.Role` values (actor, reference, critic,
    reward; any subset). Each role's DP rank scores its rows of the batch
    (``handoff.dp_rows``) on its model's groups; the role's field is then gathered over its DP
    group, so every rank of the world ends with the global ``logprobs``, ``ref_logprobs``,
    ``values`` and ``scores``.
    """
    batch = experience.sequences.shape[0]
    for role in roles:
        dp = role.groups.dp
        rows = dp_rows(batch, dp.size(), dp.rank())
        part = score(
            experience.select(torch.arange(batch)[rows]),
            {role.name: role.model},
            reward_kind,
            temperature,
            micro_batch_size,
            max_tokens=max_tokens,
        )
        name = FIELD_OF_ROLE[role.name]
        setattr(experience, name, gather_rows(getattr(part, name), dp))
    if reward_fn is not None:
        experience.scores = function_scores(reward_fn, experience)
    return experience


def _from_output(role, output, seq, mask, p, n, temperature, reward_kind, groups):
    """(experience field, its value on the model's last stage else None, its shape) for one
    role whose model has ``groups``."""
    rows, last_stage = seq.shape[0], is_last_stage(groups)
    if role in ("actor", "reference"):
        name = "logprobs" if role == "actor" else "ref_logprobs"
        value = None
        if last_stage:
            value = response_logprobs(output, seq, p, n, temperature, tp_group=vocab_group(groups))
        return name, value, (rows, n)
    if role == "critic":
        return "values", output[:, p - 1 : p - 1 + n, 0].float() if last_stage else None, (rows, n)
    value = sequence_scores(output, mask, p, reward_kind).float() if last_stage else None
    return "scores", value, (rows,)
