"""Stage 2, score: old/reference log-probs, values and the reward/advantage score.

Four forward passes over the same (prompt + response) sequences, run across the pipeline and
broadcast from its last stage so every rank holds the full :class:`Experience`. With a token
budget (``train.packing``) the rows' real tokens are packed back to back into micro-batches of at
most that many tokens (``data/packing.py``: no padding computed; every value equals the padded
pass's on the response tokens, 0 on padding), else ``micro_batch_size`` padded rows at a time:
one :class:`~megatron_rlhf.ppo.microbatch.MicroBatch` type, read once whatever its layout.
Log-probs come from this rank's vocabulary shard of the logits through the fused
``token_logprobs`` kernel (one all-reduce over the TP group; full logits are never gathered),
except for the top-p nucleus of pi_old (``rollout.top_p < 1``): the actor's scoring pass then
also gives log pi_old under the sampler's transform (:func:`nucleus_log_mass`), which needs the
whole vocabulary of a position, gathered a few hundred positions at a time.
"""

from __future__ import annotations

import torch

from megatron_rlhf.data.packing import pack_by_budget
from megatron_rlhf.distributed.handoff import for_each_dp_shard
from megatron_rlhf.distributed.parallel import is_last_stage, model_groups, vocab_group
from megatron_rlhf.distributed.pipeline import (
    broadcast_from_last_stage,
    gather_vocab_shards,
    pipeline_forward,
)
from megatron_rlhf.generation import decode
from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.microbatch import (
    Batching,
    MicroBatch,
    microbatch,
    response_logprobs_of,
    values_of,
)
from megatron_rlhf.reward.model import NUM_OUTPUTS, advantage_scores, read_packed_scalars


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


NUCLEUS_CHUNK_ELEMENTS = 1 << 23
"""Logits (positions x vocabulary) gathered and sorted at once by :func:`nucleus_log_mass`:
~30 bytes an element at the peak (the gathered logits, their probabilities, the sort's values
and int64 indices, cumulative sums), so ~250 MB whatever the vocabulary: 32 positions of
BLOOM's 250,880."""


def nucleus_log_mass(
    logits_shard: torch.Tensor,  # (K, V/tp)
    temperature: float,
    top_p: float,
    tp_group,
) -> torch.Tensor:
    """log Z (K,) of the top-p nucleus at each position (``generation.decode.nucleus_log_mass``,
    the sampler's own definition), from this rank's vocabulary shard of the logits: the nucleus
    is a property of the whole sorted distribution, so the shards of a chunk of positions are
    gathered over ``tp_group`` (rank r holds ids ``[r*V/tp, (r+1)*V/tp)``) and every rank
    computes the same values."""
    tp = 1 if tp_group is None else tp_group.size()
    step = max(NUCLEUS_CHUNK_ELEMENTS // (logits_shard.shape[-1] * tp), 1)
    parts = []
    for start in range(0, logits_shard.shape[0], step):
        chunk = logits_shard[start : start + step]
        if tp > 1:
            chunk = gather_vocab_shards(chunk, tp_group)
        parts.append(decode.nucleus_log_mass(chunk, temperature, top_p))
    if not parts:
        return logits_shard.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def sequence_scores(mb: MicroBatch, output: torch.Tensor, reward_kind: str) -> torch.Tensor:
    """The score (k,) of each response from a reward/advantage head's full-grid output
    (R, S, outputs): r at its last token (RM), or ``a = r - e_tau(x)`` with e_tau read at the
    last prompt token (AM; K = 0 at PPO time: Eq. 8 with no behaviour policies)."""
    if output.shape[-1] != NUM_OUTPUTS[reward_kind]:
        raise ValueError(f"a {reward_kind} scores with {NUM_OUTPUTS[reward_kind]} outputs")
    k = mb.last.shape[0]
    read = mb.at(output, torch.cat([mb.last, mb.prompt_end]))[None]  # (1, 2k, outputs)
    rows = torch.arange(k, device=read.device)
    return advantage_scores(*read_packed_scalars(read, rows, k + rows))


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
    sampling,
    batching: Batching,
    reward_fn=None,
) -> Experience:
    """Fill the Experience fields the given models provide, ``batching.micro_batch_size``
    padded rows at a time, or, with ``batching.max_tokens``, packed micro-batches of at most
    that many real tokens (each row's real tokens back to back; every value equals the padded
    pass's on the response tokens, 0 elsewhere).

    ``models`` maps the field each fills to its model; what a model gives is read by its head
    (:func:`reading`): an LM head log-probs (``logprobs``, ``ref_logprobs``) at
    ``sampling.temperature`` (``sampling``: the run's ``rollout`` section,
    :class:`~megatron_rlhf.ppo.config.RolloutConfig`), a scalar head values (``values``) or the
    ``reward_kind`` score (``scores``). With ``reward_fn`` (a callable ``(prompt_ids,
    response_ids) -> float``) scores come from it instead. With ``sampling.top_p`` < 1 the
    model filling ``logprobs`` (pi_old) also fills ``old_sampler_logprobs`` from the same
    forward: pi_old under the rollout sampler's transform, the numerator of the importance
    weight pi_old/mu.
    """
    temperature, max_tokens = sampling.temperature, batching.max_tokens
    parts: dict[str, list[torch.Tensor]] = {}
    n = experience.response_mask.shape[1]
    for rows in _micro_batch_rows(experience, batching):
        mb = microbatch(experience.select(rows), max_tokens is not None, None, batching.pad_id)
        for field, model in models.items():
            read, per_token = reading(model, field, reward_kind, sampling.top_p)
            pg = model_groups(model)
            output = pipeline_forward(model, **mb.forward_inputs(lm_head=model.head == "lm"))
            value = None
            if is_last_stage(pg):
                value = read(mb, output, temperature, vocab_group(pg)).float()
            shape = (rows.shape[0], n) if per_token else (rows.shape[0],)
            shape += (per_token,) if per_token > 1 else ()
            parts.setdefault(field, []).append(
                broadcast_from_last_stage(value, shape, torch.float32, pg)
            )
    for field, chunks in parts.items():
        value = torch.cat(chunks)
        if value.dim() == 3:  # pi_old and pi_old under the sampler's transform
            experience.old_sampler_logprobs = value[..., 1]
            value = value[..., 0]
        setattr(experience, field, value)
    if reward_fn is not None:
        experience.scores = function_scores(reward_fn, experience)
    return experience


def reading(model, field: str, reward_kind: str, top_p: float = 1.0):
    """(read, values per token): how a model's output on a micro-batch becomes ``field``, by
    what the model is: an LM head gives log-probs (k, N) (1 per token); a scalar head filling
    ``scores`` the ``reward_kind`` score (k,) (0 per token), any other its values (k, N).

    The LM head filling ``logprobs`` (pi_old) at ``top_p`` < 1 gives (k, N, 2) (2 per token):
    log pi_old at the temperature, which the PPO ratio and the KL reward use, and log pi_old
    under the sampler's transform, ``log pi_old - log Z`` with Z pi_old's own nucleus mass
    (:func:`nucleus_log_mass`), which the importance weight toward mu uses. Why two: the
    weight must compare like with like, mu being the rollout sampler's truncated and
    renormalised distribution, so that it is exactly 1 at staleness 0; but pi_theta of the
    update cannot be truncated (a token outside its nucleus would have log-prob -inf, and the
    nucleus is not differentiable), so the ratio pi_theta/pi_old stays on the untruncated
    distribution at the temperature, which makes it 1 at the first minibatch. A token outside
    pi_old's nucleus (a stale sample, or rounding at the nucleus edge) keeps ``log pi_old -
    log Z``, the value a nucleus widened to take it in would give, rather than -inf: weights
    and KL metrics stay finite and continuous in the logits."""
    if model.head == "lm":
        with_sampler = field == "logprobs" and top_p < 1.0

        def read(mb, logits, temperature, tp_group):
            logits = mb.lm_outputs(logits)
            logprobs = response_logprobs_of(mb, logits, temperature, tp_group)
            if not with_sampler:
                return logprobs
            response = logits[0, : mb.response_positions().shape[0]]  # (M, V/tp)
            log_mass = mb.spread(nucleus_log_mass(response, temperature, top_p, tp_group))
            return torch.stack([logprobs, logprobs - log_mass], dim=-1)

        return read, 2 if with_sampler else 1
    if field == "scores":
        return lambda mb, output, *_: sequence_scores(mb, output, reward_kind), 0
    return lambda mb, output, *_: values_of(mb, output), 1


def _micro_batch_rows(experience: Experience, batching: Batching):
    """Row indices of each scoring micro-batch: ``micro_batch_size`` rows, or consecutive rows
    of at most ``max_tokens`` real tokens."""
    device, batch = experience.sequences.device, experience.sequences.shape[0]
    micro_batch_size, max_tokens = batching.micro_batch_size, batching.max_tokens
    if max_tokens is None:
        starts = range(0, batch, micro_batch_size)
        return [torch.arange(s, min(s + micro_batch_size, batch), device=device) for s in starts]
    lengths = experience.attention_mask.sum(dim=1).tolist()
    return [torch.tensor(rows, device=device) for rows in pack_by_budget(lengths, max_tokens)]


def score_in_layouts(
    experience: Experience, roles: dict, config, batching: Batching, reward_fn=None
) -> Experience:
    """:func:`score` with every role in its own layout, on the global batch held by every rank;
    ``config``: the run's (``models.reward_kind``, the ``rollout`` section's temperature and
    top_p), ``batching``: the step's micro-batches, ``reward_fn``: scores from a function.

    ``roles``: {Experience field: :class:`~megatron_rlhf.ppo.roles.Role`}. Each role's DP rank
    scores its rows of the batch and the field is gathered back over the role's DP group
    (:func:`~megatron_rlhf.distributed.handoff.for_each_dp_shard`), so every rank of the world
    ends with the global fields.
    """
    reward_kind, sampling = config.models.reward_kind, config.rollout
    for field, role in roles.items():

        def score_rows(rows, field=field, role=role):
            part = score(
                experience.select(rows), {field: role.model}, reward_kind, sampling, batching
            )
            filled = {field: getattr(part, field)}
            if part.old_sampler_logprobs is not None:
                filled["old_sampler_logprobs"] = part.old_sampler_logprobs
            return filled

        gathered = for_each_dp_shard(role.pg.dp, experience.sequences.shape[0], score_rows)
        for name, value in gathered.items():
            setattr(experience, name, value)
    if reward_fn is not None:
        experience.scores = function_scores(reward_fn, experience)
    return experience
