"""The parts of a generation step that the plain loop (``decode_loop.py``) and the pipelined one
(``pipelined.py``) share: the sampling settings and the output, a micro-batch's buffers
(``DecodeRows``, which also drops the rows that ended), this stage's forward of it, the token
choice on the last stage from one uniform number per (step, row), and the joining of the
micro-batches. How tokens are chosen and why the cut of the batch changes none of them:
``decode_loop.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_rlhf.kernels import cpu_logprobs


@dataclass(kw_only=True)
class SamplingConfig:
    """How tokens are generated and chosen."""

    max_new_tokens: int = 64
    """Most tokens generated per prompt (EOS included)."""
    greedy: bool = False
    """Take the argmax token (temperature and top_p are then ignored)."""
    temperature: float = 1.0
    """Divide logits by this before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    """Seed of the sampling generator (offset by the data-parallel rank)."""
    row_seeds: tuple[int, ...] | None = None
    """One seed per prompt row instead of ``seed``: each row samples from its own generator,
    so a row draws the same tokens whatever batch, rank or layout it is generated in."""
    eos_id: int = 2
    """End-of-sequence token (BLOOM: 2)."""
    pad_id: int = 3
    """Padding token written after EOS (BLOOM: 3)."""
    use_kv_cache: bool = True
    """Reuse the keys/values of earlier positions (False recomputes the prefix each step)."""
    drop_ended_rows: bool = True
    """Take rows that emitted EOS out of the decode batch (their KV cache compacted away), so
    later steps compute only the rows still going; False keeps the batch shape fixed (every
    step computes every row, as static-shape decoding, e.g. a CUDA graph, needs). Tokens do
    not depend on it."""
    unpadded_prefill: bool = True
    """Compute the prompts without their left padding: rows are sorted by prompt length
    (longest first) and prefilled in groups, each as wide as its own longest prompt
    (``prefill_groups``; pipelined, each micro-batch as wide as its longest), instead of the
    whole batch as wide as the longest prompt. False: one prefill of the left-padded batch.
    Tokens do not depend on it."""
    pipeline_micro_batches: int = 0
    """At PP > 1, split the batch into this many micro-batches that flow through the stages
    together, so every stage works at every decode step (0: one per stage; 1: the whole batch
    goes stage after stage while the others wait). Ignored at PP = 1. Tokens do not depend
    on it."""
    decode_batch: int | None = None
    """Decode slots: at most this many rows decode at once; when a row ends, a waiting prompt
    is prefilled into its slot (continuous batching, ``refill.py``). None (or 0): every
    prompt of the call decodes at once (``decode_loop.py``'s loop). Needs the KV cache and PP = 1;
    prompts are then always prefilled by length (``unpadded_prefill`` ignored), and
    ``drop_ended_rows=False`` keeps ended rows' slots in the batch until refilled. Tokens and
    log-probs per row do not depend on it (log-probs up to float rounding of a different
    batch)."""


@dataclass
class GenerationOutput:
    response_ids: torch.Tensor  # (B, N) generated tokens, pad_id after EOS
    response_mask: torch.Tensor  # (B, N) 1 on generated tokens (EOS included), 0 after
    response_logprobs: torch.Tensor  # (B, N) log mu(token): see sampled_logprobs; 0 on padding


def _sampler_probs(logits: torch.Tensor, sampling: SamplingConfig):
    """(probs, order): softmax(logits / T) (B, V), at top_p < 1 sorted in descending order
    (``order``: their token ids) with the tokens outside the nucleus at 0, not renormalised
    (their sum is the nucleus's mass Z); ``order`` None at top_p = 1."""
    probs = _at_temperature(logits, sampling.temperature).softmax(dim=-1)
    if sampling.top_p >= 1.0:
        return probs, None
    probs, order = probs.sort(dim=-1, descending=True)
    return _nucleus(probs, sampling.top_p), order


def _at_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; at temperature 1 the logits themselves (the same numbers,
    without a pass over the vocabulary: 4 ms a decode step at 8 x 250,880 on a 2-core CPU)."""
    return logits if temperature == 1.0 else logits / temperature


def _draw(probs: torch.Tensor, order, uniforms) -> torch.Tensor:
    """The token (B,) where each row's cumulative ``probs`` (:func:`_sampler_probs`) passes its
    uniform times their sum (the renormalisation)."""
    cdf = probs.cumsum(dim=-1)  # (B, V)
    targets = uniforms.to(cdf)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1)
    return picked.squeeze(-1) if order is None else order.gather(-1, picked).squeeze(-1)


def _nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities sorted in descending order (..., V) with those outside the nucleus set to
    0: a token stays while the mass of the tokens before it is below ``top_p`` (so the first
    always stays, and the last kept one is where the mass reaches ``top_p``). vLLM's
    ``apply_top_k_top_p`` keeps the same set (it drops the tail whose mass is <= 1 - top_p)."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return sorted_probs.masked_fill(mass_before >= top_p, 0.0)


def nucleus_log_mass(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log Z (...,) of full-vocab logits (..., V): the log of the probability mass, at
    ``temperature``, of the top-p nucleus the sampler draws from (0 when top_p = 1). The
    sampler's distribution is softmax(logits / T) on the nucleus divided by Z, so
    ``log mu(a) = log softmax(logits / T)(a) - log Z`` for a token a in it. Computed in fp32 by
    the sampler's own steps (:func:`_sampler_probs`), so that a recomputing forward of the same
    logits finds the same nucleus and the same Z."""
    if top_p >= 1.0:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    return _sampler_probs(logits.float(), sampling)[0].sum(dim=-1).log()


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig, log_mass=None
) -> torch.Tensor:
    """log mu (B,) of each row's token under the distribution the sampler drew it from, from
    full-vocab logits (B, V): softmax(logits / temperature), cut to the top-p nucleus and
    renormalised (the behaviour policy of PPO's importance weights; the score stage computes
    pi_old under the same transform, ``ppo/scoring.py``). ``log_mass``: the nucleus's log Z
    (B,) if already known (:func:`nucleus_log_mass`). Greedy: the temperature-1 log-prob (a
    greedy choice has no sampling distribution; nothing trains on it)."""
    logits = logits.float()
    if sampling.greedy:
        return logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = _at_temperature(logits, sampling.temperature).log_softmax(dim=-1)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    if log_mass is None:
        log_mass = nucleus_log_mass(logits, sampling.temperature, sampling.top_p)
    return logprobs - log_mass


class DecodeRows:
    """Rows ``rows`` of the batch: prompt plus generated ids and mask in preallocated
    (b, P + max_new) buffers, per-token log-probs and which rows have ended.

    ``live`` (k,) lists the rows still in the decode batch, in the order of their KV-cache slots
    (``rows.start + i`` holds ``live[i]``): a step's inputs, logits and chosen tokens are those
    k rows; ended rows keep pad ids, a 0 mask and 0 log-probs, as the buffers start."""

    def __init__(self, rows: slice, prompt_ids, prompt_mask, sampling: SamplingConfig, device):
        batch, self.prompt_length = prompt_ids.shape
        width = self.prompt_length + sampling.max_new_tokens
        self.rows, self.sampling, self.step = rows, sampling, 0
        self.ids = torch.full((batch, width), sampling.pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, width), dtype=torch.long, device=device)
        self.ids[:, : self.prompt_length] = prompt_ids
        self.mask[:, : self.prompt_length] = prompt_mask
        self.logprobs = torch.zeros((batch, sampling.max_new_tokens), device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.live = torch.arange(batch, device=device)

    @property
    def size(self) -> int:
        """Rows in the decode batch now."""
        return self.live.shape[0]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's input ids of the live rows (the new token with a cache, else all) and
        their key mask (k, Sk)."""
        end = self.prompt_length + self.step
        first = end - 1 if (self.sampling.use_kv_cache and self.step > 0) else 0
        return self.ids[self.live, first:end], self.mask[self.live, :end]

    def point_cache(self, context: StaticInferenceContext | None) -> None:
        """Aim the shared KV cache at these rows and this step's positions."""
        if context is None:
            return
        context.batch_size_offset = self.rows.start
        context.sequence_len_offset = 0 if self.step == 0 else self.prompt_length + self.step - 1
        if self.step == 0:
            context.enable_prefill_mode()
        else:
            context.enable_decode_mode()

    def append(self, chosen=None, logprob=None, alive=None, finished=None) -> torch.Tensor:
        """Record this step's tokens of the live rows (k,) and return the alive column (b,);
        stages that never see tokens pass the ``alive`` and ``finished`` columns (b,) they
        were sent."""
        column = self.prompt_length + self.step
        if alive is None:
            alive = ~self.finished
            live_alive = alive[self.live]  # all True unless a step ran without compact()
            self.ids[self.live, column] = torch.where(live_alive, chosen, self.sampling.pad_id)
            self.finished[self.live] |= live_alive & (chosen == self.sampling.eos_id)
        else:
            self.finished = finished.clone()
        if logprob is not None:
            self.logprobs[self.live, self.step] = torch.where(alive[self.live], logprob, 0.0)
        self.mask[:, column] = alive.long()
        self.step += 1
        return alive

    def compact(self, context: StaticInferenceContext | None) -> None:
        """Drop the rows that have ended from the decode batch: the KV cache of the rows that
        stay moves to the front of this micro-batch's slots (the live rows' cache copied once,
        up to the filled length). Every stage of a pipeline calls it after the same step."""
        if not self.sampling.drop_ended_rows:
            return
        stay = (~self.finished[self.live]).nonzero().squeeze(-1)  # positions in slot order
        if stay.shape[0] == self.live.shape[0] or stay.shape[0] == 0:
            return
        if context is not None:
            start, filled = self.rows.start, self.prompt_length + self.step
            for key, value in context.key_value_memory_dict.values():
                for memory in (key, value):
                    kept = memory[:filled, start + stay]  # a copy: safe to write back over
                    memory[:filled, start : start + stay.shape[0]] = kept
        self.live = self.live[stay]

    @property
    def done(self) -> bool:
        return self.step == self.sampling.max_new_tokens or bool(self.finished.all())


PREFILL_FORWARD_COST_TOKENS = 64
"""What ``prefill_groups`` charges for one more prefill forward, in prompt tokens: a forward
reads every weight once (the LM head too, for its groups' last positions) whatever its rows;
on a CPU at BLOOM-560m's width that read costs about as much as 64-74 prompt tokens of compute,
and at 176B on GPUs (launches of ~70 layers' kernels against ~0.1 ms a token) about 80."""


def sort_prompts(prompt_ids, prompt_mask):
    """Rows ordered by prompt length, longest first (ties in row order), without the leading
    columns that are padding in every row: (ids, mask, order), row ``i`` of the result being
    row ``order[i]`` of the input."""
    lengths = prompt_mask.ne(0).sum(dim=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids[order], prompt_mask[order])
    return prompt_ids, prompt_mask, order


def trim_left_padding(prompt_ids, prompt_mask):
    """Without the leading columns that are padding in every row (left-padded prompts)."""
    real = prompt_mask.ne(0).any(dim=0).nonzero()
    first = int(real[0, 0]) if real.numel() else 0
    return prompt_ids[:, first:], prompt_mask[:, first:]


def prefill_groups(lengths: list[int]) -> list[tuple[slice, int]]:
    """Contiguous groups of rows whose prompt lengths are sorted longest first, each with its
    width (its first row's length), that minimise the tokens computed plus
    ``PREFILL_FORWARD_COST_TOKENS`` per group: ``sum(rows x width + cost)``, an exact dynamic
    program over the starts of runs of equal length (O(runs^2))."""
    if not lengths:
        return []
    starts = [i for i in range(len(lengths)) if i == 0 or lengths[i] != lengths[i - 1]]
    bounds = starts + [len(lengths)]
    best = [0.0] + [float("inf")] * len(starts)  # best[k]: rows before bounds[k] in groups
    cut = [0] * (len(starts) + 1)
    for end in range(1, len(bounds)):
        for begin in range(end):
            rows = bounds[end] - bounds[begin]
            cost = best[begin] + rows * lengths[bounds[begin]] + PREFILL_FORWARD_COST_TOKENS
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    groups, end = [], len(starts)
    while end > 0:
        begin = cut[end]
        groups.append((slice(bounds[begin], bounds[end]), lengths[bounds[begin]]))
        end = begin
    return groups[::-1]


def prefill_by_length(model, micro_batch: DecodeRows, context: StaticInferenceContext):
    """The prompt step of a micro-batch whose rows are sorted longest first, one forward per
    ``prefill_groups`` group (``prefill_sorted``): the same cache columns as the padded
    prefill's, and the (b, 1, V) logits of every row's first token. Single-stage models only."""
    total = micro_batch.prompt_length
    ids, mask = micro_batch.ids[:, :total], micro_batch.mask[:, :total]
    if mask[0].ne(0).sum().clamp(min=1) != total:  # not sorted and trimmed: the padded prefill
        return stage_forward(model, micro_batch, context)
    return prefill_sorted(model, ids, mask, context, micro_batch.rows.start)


def prefill_sorted(model, ids, mask, context: StaticInferenceContext, first_slot: int = 0):
    """Prefill left-padded prompts (b, P) sorted longest first, the first as long as P, into
    cache slots ``first_slot ..`` and columns ``0 .. P``: one forward per ``prefill_groups``
    group over its own last ``width`` columns. Keys and values land in the columns the padded
    prefill would write; the group's padding columns before them are zeroed (never computed;
    masked, but 0 x garbage would be NaN). Returns every row's last-position logits
    (b, 1, V)."""
    total = ids.shape[1]
    lengths = mask.ne(0).sum(dim=1).clamp(min=1).tolist()
    logits = []
    for rows, width in prefill_groups(lengths):
        slots = slice(first_slot + rows.start, first_slot + rows.stop)
        context.batch_size_offset = slots.start
        context.sequence_len_offset = total - width
        context.enable_prefill_mode()
        if logits and width < total:  # the first group (width = total) allocated the cache
            for key, value in context.key_value_memory_dict.values():
                key[: total - width, slots].zero_()
                value[: total - width, slots].zero_()
        input_ids = ids[rows, total - width :]
        logits.append(
            model(input_ids, mask[rows], inference_context=context, runtime_gather_output=True)
        )
    return torch.cat(logits)


def split_rows(batch: int, parts: int) -> list[slice]:
    """``parts`` contiguous row ranges of near-equal size (fewer if the batch is smaller)."""
    bounds = torch.arange(batch).tensor_split(min(max(parts, 1), batch))
    return [slice(int(b[0]), int(b[-1]) + 1) for b in bounds]


def choose_for(micro_batch: DecodeRows, logits, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its log-prob under the sampled distribution (:func:`sampled_logprobs`) per
    live row from the last stage's (k, S, V) logits."""
    rows = None
    if uniforms is not None:
        rows = uniforms[micro_batch.step, micro_batch.rows][micro_batch.live]
    return choose_tokens(logits[:, -1, :], micro_batch.sampling, rows)


def choose_tokens(last, sampling: SamplingConfig, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its log-prob under the distribution it was drawn from (temperature, top-p
    renormalised: :func:`sampled_logprobs`) per row from (k, V) logits and the rows' uniforms
    (k,) (None: greedy)."""
    last = last.float()
    if sampling.greedy:
        chosen = last.argmax(dim=-1)
        return chosen, sampled_logprobs(last, chosen, sampling)
    if sampling.top_p >= 1.0 and cpu_logprobs.applies(last):  # our CPU kernel: one call
        return cpu_logprobs.sample(last, uniforms, sampling.temperature)
    probs, order = _sampler_probs(last, sampling)
    chosen = _draw(probs, order, uniforms)
    log_mass = None if order is None else probs.sum(dim=-1).log()  # one sort for both
    return chosen, sampled_logprobs(last, chosen, sampling, log_mass)


def stage_forward(model, micro_batch: DecodeRows, context, hidden=None):
    """This stage's forward of one micro-batch step (``hidden`` from the previous stage)."""
    micro_batch.point_cache(context)
    if hidden is not None:
        model.set_input_tensor(hidden)
    input_ids, mask = micro_batch.inputs()
    return model(input_ids, mask, inference_context=context, runtime_gather_output=True)


def sampling_uniforms(sampling: SamplingConfig, batch: int, device, dp_rank: int):
    """One uniform per (step, row), (max_new_tokens, B), or None for greedy decoding: from one
    generator seeded ``seed + dp_rank`` (the model's data-parallel rank), or row by row from
    ``row_seeds``."""
    if sampling.greedy:
        return None
    steps = sampling.max_new_tokens
    if sampling.row_seeds is None:
        seed = sampling.seed + dp_rank
        uniforms = torch.rand((steps, batch), generator=torch.Generator().manual_seed(seed))
        return uniforms.to(device)
    if len(sampling.row_seeds) != batch:
        raise ValueError(f"{len(sampling.row_seeds)} row_seeds for a batch of {batch} prompts")
    columns = [
        torch.rand(steps, generator=torch.Generator().manual_seed(seed))
        for seed in sampling.row_seeds
    ]
    return torch.stack(columns, dim=1).to(device)


def collect(micro_batches: list[DecodeRows]) -> GenerationOutput:
    """Concatenate the micro-batches' responses, cut after the last step any row took."""
    steps = max(mb.step for mb in micro_batches)
    ids = torch.cat([mb.ids[:, mb.prompt_length :] for mb in micro_batches])[:, :steps]
    mask = torch.cat([mb.mask[:, mb.prompt_length :] for mb in micro_batches])[:, :steps]
    logprobs = torch.cat([mb.logprobs for mb in micro_batches])[:, :steps]
    return GenerationOutput(response_ids=ids, response_mask=mask, response_logprobs=logprobs)
