"""Continuous batching: more prompts than decode slots (``SamplingConfig.decode_batch``; issue
35, item 3).

The KV cache (Megatron-Core's ``StaticInferenceContext``) holds ``decode_batch`` slots. The
longest prompts fill them first; when a row ends (EOS or ``max_new_tokens``) a waiting prompt
takes its slot, so every decode step computes up to ``decode_batch`` rows until the queue is
empty, instead of one wide batch that thins out as its rows end.

Where a row sits. All slots write the same cache column per decode step (the context has one
``sequence_len_offset``): after ``c`` columns are filled, every live row's next token goes to
column ``c``. A newcomer's prompt therefore ends at column ``c``: its keys and values occupy
columns ``c - L .. c`` of its slot and its key mask is 1 there only. ALiBi positions come from
the key mask (counted over the row's own real tokens) and the key/value projections carry no
position, so a row's keys, values and attention are those it has in the all-at-once batch,
whatever its slot, its neighbours or the column it entered at; the stale keys of the slot's
earlier row are masked (probability exactly 0; the cache never holds NaN: unwritten memory is
zeroed once).

Refill. The newcomers of a step (rows sorted longest first, taken in queue order) are
prefilled together into a second, prompt-wide context (``prefill_sorted``: groups by length),
their first tokens chosen from that prefill's logits, and their prompt keys/values copied into
their slots (``L`` columns a row: a small fraction of the prefill's compute, which happens
anyway). A freed slot need not be contiguous with the others, which Megatron-Core's
``batch_size_offset`` addressing would otherwise need.

Sampling. A row's k-th token uses the uniform ``uniforms[k, row]`` (its own step count, not the
loop's), from ``row_seeds`` or from the call's seed; so every row's tokens are those of the
all-at-once path, and its log-probs too up to the float rounding of a different batch (matmul
blocking over other rows and key lengths: ~1e-7 in fp32).

Columns. The cache is ``P + 2 * max_new_tokens`` columns wide (P: the longest prompt; ``P +
max_new_tokens`` when every prompt has a slot, as today's loop). When the write column reaches
the end, the occupied columns of the live rows move to the front (``_rebase``: the columns
left of every live row's first real token are dropped, keeping at least P filled so that a
newcomer's prompt fits left of the write column). A live row occupies at most ``P +
max_new_tokens - 1`` columns, so a rebase frees at least ``max_new_tokens + 1`` and happens at
most once per ``max_new_tokens`` steps (one copy of the live rows' cache each time).

Compaction and its cost model. A slot whose row ended and that no waiting prompt can take
(the queue is empty) is *carried*: each decode step computes every slot up to the highest live
one. Compacting moves only the live rows above the new top (``k`` live rows: those in slots
``>= k``) into the free slots below it: ``moved <= carried`` rows, each copying its occupied
columns (``occ`` <= ``c``) of keys and values. Per rank, in bytes moved:

    saved = carried * horizon * (c * kv_bytes + row_flops / COMPUTE_PER_COPIED_BYTE)
    cost  = moved * occ * 2 * kv_bytes

``kv_bytes``: one column of one row's keys and values over this rank's layers; a carried row
costs a decode step its attention's read of ``c`` such columns plus its share of the GEMMs
(``row_flops`` = 2 x the weights of one token, priced in copied bytes); ``horizon``: the steps
the slots may still be carried, bounded by the live row with the most tokens left
(``max_new_tokens`` minus its count). Compact when ``saved > cost``. Because ``moved <=
carried`` and ``occ <= c``, this holds whenever two or more steps may remain: the copy that
made compaction expensive before (``DecodeRows.compact`` copies every live row to close any
gap) is gone, and the model keeps it from copying at the last step. ``drop_ended_rows=False``
never compacts (static shapes); ``decode_batch=None`` is the all-at-once loop of
``decode_loop.py`` (every row's end compacts every live row).
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_rlhf.distributed.parallel import model_groups
from megatron_rlhf.generation.decode import (
    GenerationOutput,
    SamplingConfig,
    choose_tokens,
    prefill_sorted,
    trim_left_padding,
)

COMPUTE_PER_COPIED_BYTE = 10.0
"""FLOPs of a carried row's decode GEMMs that cost as much time as copying one byte of KV
cache: a 2-core AVX-512 CPU does ~100 GFLOP/s of fp32 GEMM and copies ~10 GB/s. On GPUs a
small decode batch is memory-bound (its GEMM FLOPs nearly free): the ``c * kv_bytes`` read
term then dominates, and the decision is the same (compact unless at most one step remains)."""


def compaction_pays(
    carried: int, moved: int, horizon: int, filled: int, occupied: int, *, kv_bytes, row_flops
) -> bool:
    """The module docstring's cost model: ``moved`` rows copying ``occupied`` columns of keys
    and values cost less than carrying ``carried`` ended slots for ``horizon`` more steps over
    a ``filled``-column cache (all per rank, in bytes moved)."""
    row_step = filled * kv_bytes + row_flops / COMPUTE_PER_COPIED_BYTE
    return carried * horizon * row_step > moved * occupied * 2 * kv_bytes


@torch.no_grad()
def generate_refill(model, prompt_ids, prompt_mask, sampling: SamplingConfig, uniforms):
    """Responses of prompts sorted longest first and trimmed (``sort_prompts``), (B, P)
    left-padded, decoded ``sampling.decode_batch`` at a time; ``uniforms`` (max_new, B) of those
    rows, or None (greedy). Single-stage models (PP = 1), any TP: every TP rank takes the same
    decisions from the same tokens."""
    return _Refill(model, prompt_ids, prompt_mask, sampling, uniforms).run()


class _Refill:
    def __init__(self, model, prompt_ids, prompt_mask, sampling: SamplingConfig, uniforms):
        self.model, self.sampling, self.uniforms = model, sampling, uniforms
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        device = prompt_ids.device
        batch, self.prompt_width = prompt_ids.shape
        steps = sampling.max_new_tokens
        self.slots = min(sampling.decode_batch, batch)
        room = steps if self.slots == batch else 2 * steps  # no newcomer: no rebase either
        self.width = self.prompt_width + room
        self.context = StaticInferenceContext(self.slots, self.width)
        self.scratch = None  # the newcomers' prefill context, made at the first refill
        self.ids = torch.full((batch, steps), sampling.pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, steps), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch, steps), device=device)
        self.steps = [0] * batch  # tokens each row has generated
        self.slot_row = [-1] * self.slots  # the row in each slot, -1: free
        self.key_mask = torch.zeros((self.slots, self.width), dtype=torch.long, device=device)
        self.pending = torch.full((self.slots,), sampling.pad_id, dtype=torch.long, device=device)
        self.filled = self.prompt_width  # cache columns written; the next token goes here
        self.waiting = self.slots  # the next row to take a slot
        hidden, layers = model.config.hidden_size, model.config.num_layers
        weights = layers * 12 * hidden**2 + model.vocab_size * hidden  # of one token
        self.row_flops = 2.0 * weights / model_groups(model).tp.size()
        self.kv_bytes = 0  # one column of one slot over this rank's layers, set after prefill
        self.moves = self.rebases = self.carried_steps = 0  # for tests and benchmarks

    def run(self) -> GenerationOutput:
        first = self.prompt_ids[: self.slots], self.prompt_mask[: self.slots]
        logits = prefill_sorted(self.model, *first, self.context)
        memories = self._memories()
        for memory in memories:  # never-written columns hold garbage; masked x NaN is NaN
            memory[self.prompt_width :].zero_()
        self.kv_bytes = sum(m[0, 0].numel() * m.element_size() for m in memories)
        self.key_mask[:, : self.prompt_width] = first[1].ne(0).long()
        slots = list(range(self.slots))
        self.slot_row = list(slots)
        ended = self._record(slots, logits[:, -1], slots)
        while True:
            self._free(ended)
            self._refill()
            live = [s for s, row in enumerate(self.slot_row) if row >= 0]
            if not live:
                break
            if self.waiting == len(self.steps) and self.sampling.drop_ended_rows:
                live = self._maybe_compact(live)
            if self.filled == self.width:
                self._rebase(live)
            ended = self._decode(live)
        used = max(self.steps)
        return GenerationOutput(
            response_ids=self.ids[:, :used],
            response_mask=self.mask[:, :used],
            response_logprobs=self.logprobs[:, :used],
        )

    def _memories(self, context=None) -> list[torch.Tensor]:
        context = context or self.context
        return [m for pair in context.key_value_memory_dict.values() for m in pair]

    def _record(self, rows: list[int], last_logits, slots: list[int]) -> list[int]:
        """Choose and store the next token of ``rows`` from their (k, V) logits; the slots
        (same order) get it as their next input. Returns the slots whose row ended."""
        device = self.ids.device
        steps = torch.tensor([self.steps[r] for r in rows], device=device)
        index = torch.tensor(rows, device=device)
        uniforms = None if self.uniforms is None else self.uniforms[steps, index]
        chosen, logprob = choose_tokens(last_logits, self.sampling, uniforms)
        self.ids[index, steps] = chosen
        self.mask[index, steps] = 1
        self.logprobs[index, steps] = logprob
        self.pending[torch.tensor(slots, device=device)] = chosen
        eos = (chosen == self.sampling.eos_id).tolist()
        ended = []
        for row, slot, is_eos in zip(rows, slots, eos):
            self.steps[row] += 1
            if is_eos or self.steps[row] == self.sampling.max_new_tokens:
                ended.append(slot)
        return ended

    def _free(self, slots: list[int]) -> None:
        for slot in slots:
            self.slot_row[slot] = -1
        if slots:  # a carried slot attends to its own column only (finite, unread)
            self.key_mask[torch.tensor(slots, device=self.key_mask.device)] = 0

    def _refill(self) -> None:
        """Waiting prompts into the free slots, lowest first, until either runs out (a
        newcomer whose first token ends it frees its slot again)."""
        while self.waiting < len(self.steps):
            free = [s for s, row in enumerate(self.slot_row) if row < 0]
            if not free:
                return
            rows = list(range(self.waiting, min(self.waiting + len(free), len(self.steps))))
            self.waiting = rows[-1] + 1
            free = free[: len(rows)]
            ids, mask = trim_left_padding(self.prompt_ids[rows], self.prompt_mask[rows])
            if self.scratch is None:
                room = min(self.slots, len(self.steps) - self.slots)
                self.scratch = StaticInferenceContext(room, self.prompt_width)
            logits = prefill_sorted(self.model, ids, mask, self.scratch)
            width, end = ids.shape[1], self.filled
            slots = torch.tensor(free, device=ids.device)
            for target, source in zip(self._memories(), self._memories(self.scratch)):
                target[end - width : end, slots] = source[:width, : len(rows)]
            self.key_mask[slots] = 0
            self.key_mask[slots, end - width : end] = mask.ne(0).long()
            for row, slot in zip(rows, free):
                self.slot_row[slot] = row
            self._free(self._record(rows, logits[:, -1], free))

    def _decode(self, live: list[int]) -> list[int]:
        """One decode step of slots ``0 .. live[-1]`` (carried free slots among them)."""
        top, column = live[-1] + 1, self.filled
        self.carried_steps += top - len(live)
        self.key_mask[:top, column] = 1
        self.context.batch_size_offset = 0
        self.context.sequence_len_offset = column
        self.context.enable_decode_mode()
        logits = self.model(
            self.pending[:top, None],
            self.key_mask[:top, : column + 1],
            inference_context=self.context,
            runtime_gather_output=True,
        )
        self.filled += 1
        index = torch.tensor(live, device=logits.device)
        return self._record([self.slot_row[s] for s in live], logits[index, -1], live)

    def _first_real(self, slots: list[int]) -> int:
        """The leftmost column holding a real token of any of ``slots``."""
        index = torch.tensor(slots, device=self.key_mask.device)
        return int(self.key_mask[index, : self.filled].argmax(dim=1).min())

    def _maybe_compact(self, live: list[int]) -> list[int]:
        """Move the live rows above slot ``k = len(live)`` into the free slots below it when
        the module docstring's cost model says it pays; returns the live slots after."""
        k, top = len(live), live[-1] + 1
        movers = [s for s in live if s >= k]
        if not movers:
            return live
        holes = [s for s in range(k) if self.slot_row[s] < 0]
        c = self.filled
        horizon = max(self.sampling.max_new_tokens - self.steps[self.slot_row[s]] for s in live)
        occupied = c - self._first_real(movers)
        moves = (top - k, len(movers), horizon, c, occupied)
        if not compaction_pays(*moves, kv_bytes=self.kv_bytes, row_flops=self.row_flops):
            return live
        device = self.key_mask.device
        source, target = torch.tensor(movers, device=device), torch.tensor(holes, device=device)
        for memory in self._memories():
            memory[c - occupied : c, target] = memory[c - occupied : c, source]
        self.key_mask[target] = self.key_mask[source]
        self.key_mask[source] = 0
        self.pending[target] = self.pending[source]
        for hole, mover in zip(holes, movers):
            self.slot_row[hole], self.slot_row[mover] = self.slot_row[mover], -1
        self.moves += 1
        return list(range(k))

    def _rebase(self, live: list[int]) -> None:
        """Drop the columns left of every live row's first real token (the cache is full),
        keeping at least the prompt width filled (a newcomer's prompt must fit left of the
        write column)."""
        top, c = live[-1] + 1, self.filled
        shift = min(self._first_real(live), c - self.prompt_width)
        for memory in self._memories():
            memory[: c - shift, :top] = memory[shift:c, :top].clone()
        self.key_mask[:, : c - shift] = self.key_mask[:, shift:c].clone()
        self.key_mask[:, c - shift :] = 0
        self.filled -= shift
        self.rebases += 1
