"""Pipelined generation at PP > 1: micro-batches circle through the stages (issue 11, item 3).

With one batch, a decode step runs stage after stage and PP - 1 stages wait at every token.
Here the batch is cut into M micro-batches (default M = PP) that travel a ring: the first stage
embeds micro-batch m and runs its layers, each stage passes the hidden states on, the last stage
picks m's next tokens and sends them straight back to the first stage, which by then has
started micro-batch m + 1. With M >= PP every stage holds a different micro-batch at every
moment. Each micro-batch stops on its own once its rows have all ended (it leaves the ring).

Messages, all point-to-point between the ranks of this rank's pipeline (same TP rank), sent
with ``isend`` so no stage waits for a receiver:
- stage s -> s+1: a header ``[m, step, alive_0 .. alive_{b-1}, finished_0 .. finished_{b-1}]``
  (the new mask column of the micro-batch and which rows have ended, which later stages cannot
  derive without the tokens; ``m = -1`` ends the loop), then the (Sq, k, H) hidden states of
  the k rows still decoding (every stage drops ended rows after the same step);
- last -> first stage: the chosen tokens (k,) of micro-batch m.
Stages keep their own copy of every micro-batch's mask and of Megatron-Core's
``StaticInferenceContext`` (their layers' KV cache), addressed per micro-batch. At the end the
last stage broadcasts ids, mask and log-probs (one collective) so every stage returns the same
``GenerationOutput``. Cost at scale: M in-flight (Sq, b, H) activations per stage link and the
same KV cache as the unpipelined batch (it is the same rows).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.parallel import (
    compute_device,
    is_first_stage,
    is_last_stage,
    model_groups,
    stage_rank,
)
from megatron_rlhf.generation.decode import (
    DecodeRows,
    GenerationOutput,
    choose_for,
    collect,
    split_rows,
    stage_forward,
    trim_left_padding,
)

_END = -1


class _Links:
    """Non-blocking sends to the next stage / the first stage, blocking receives."""

    def __init__(self, max_rows: int, groups):
        self.max_rows, self.device = max_rows, compute_device()
        stage = groups.pp.rank()
        self.next, self.prev = stage_rank(groups, stage + 1), stage_rank(groups, stage - 1)
        self.first, self.last = stage_rank(groups, 0), stage_rank(groups, -1)
        self.pending = deque()

    def _isend(self, tensor, dst: int) -> None:
        self.pending.append(dist.isend(tensor.contiguous(), dst=dst))
        while self.pending and self.pending[0].is_completed():
            self.pending.popleft()

    def send_header(self, index: int, step: int = 0, alive=None, finished=None) -> None:
        width = self.max_rows
        header = torch.zeros(2 + 2 * width, dtype=torch.long, device=self.device)
        header[0], header[1] = index, step
        if alive is not None:
            header[2 : 2 + alive.shape[0]] = alive.long()
            header[2 + width : 2 + width + finished.shape[0]] = finished.long()
        self._isend(header, self.next)

    def recv_header(self) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        width = self.max_rows
        header = torch.empty(2 + 2 * width, dtype=torch.long, device=self.device)
        dist.recv(header, src=self.prev)
        return (
            int(header[0]),
            int(header[1]),
            header[2 : 2 + width].bool(),
            header[2 + width :].bool(),
        )

    def send_hidden(self, hidden) -> None:
        self._isend(hidden, self.next)

    def recv_hidden(self, shape, dtype) -> torch.Tensor:
        hidden = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(hidden, src=self.prev)
        return hidden

    def send_tokens(self, tokens) -> None:
        self._isend(tokens, self.first)

    def recv_tokens(self, rows: int) -> torch.Tensor:
        tokens = torch.empty(rows, dtype=torch.long, device=self.device)
        dist.recv(tokens, src=self.last)
        return tokens

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().wait()


def generate_pipelined(
    model, prompt_ids, prompt_mask, sampling, context, uniforms
) -> GenerationOutput:
    """Every stage of the pipeline calls this with the same prompts and the (steps, B) sampling
    uniforms of their rows (None: greedy); see the module docstring. With
    ``sampling.unpadded_prefill`` the rows come sorted by length and each micro-batch drops the
    padding columns all its rows share (its own prompt width and cache columns)."""
    device, groups = compute_device(), model_groups(model)
    parts = sampling.pipeline_micro_batches or groups.pp.size()
    micro_batches = []
    for rows in split_rows(prompt_ids.shape[0], parts):
        ids, mask = prompt_ids[rows], prompt_mask[rows]
        if sampling.unpadded_prefill:
            ids, mask = trim_left_padding(ids, mask)
        micro_batches.append(DecodeRows(rows, ids, mask, sampling, device))
    links = _Links(max(mb.rows.stop - mb.rows.start for mb in micro_batches), groups)
    if is_first_stage(groups):
        _first_stage(model, micro_batches, context, links)
    else:
        _later_stage(model, micro_batches, context, links, uniforms)
    links.drain()
    return _broadcast_from_last_stage(micro_batches, sampling, groups)


def _first_stage(model, micro_batches, context, links: _Links) -> None:
    """Embed and run every micro-batch's prompt, then loop: take a micro-batch's tokens from
    the last stage, record them, and send its next step down unless it has ended."""
    for index, micro_batch in enumerate(micro_batches):
        links.send_header(index)
        links.send_hidden(stage_forward(model, micro_batch, context))
    ring = deque(range(len(micro_batches)))
    while ring:
        index = ring.popleft()
        micro_batch = micro_batches[index]
        alive = micro_batch.append(chosen=links.recv_tokens(micro_batch.size))
        if micro_batch.done:
            continue
        micro_batch.compact(context)
        links.send_header(index, micro_batch.step, alive, micro_batch.finished)
        links.send_hidden(stage_forward(model, micro_batch, context))
        ring.append(index)
    links.send_header(_END)


def _later_stage(model, micro_batches, context, links: _Links, uniforms) -> None:
    """Receive (micro-batch, step, hidden), run this stage's layers, pass it on; the last
    stage picks the tokens and returns them to the first stage."""
    config, groups = model.config, model_groups(model)
    last = is_last_stage(groups)
    while True:
        index, step, alive, finished = links.recv_header()
        if index == _END:
            if not last:
                links.send_header(_END)
            return
        micro_batch = micro_batches[index]
        rows = micro_batch.rows.stop - micro_batch.rows.start
        if step > 0 and not last:  # the last stage appends when it picks the tokens
            micro_batch.append(alive=alive[:rows], finished=finished[:rows])
            micro_batch.compact(context)
        input_ids, _ = micro_batch.inputs()
        seq = input_ids.shape[1]
        if config.sequence_parallel:
            seq //= groups.tp.size()
        hidden = links.recv_hidden((seq, micro_batch.size, config.hidden_size), config.params_dtype)
        output = stage_forward(model, micro_batch, context, hidden)
        if not last:
            if step > 0:
                links.send_header(index, step, alive[:rows], finished[:rows])
            else:
                links.send_header(index, step)
            links.send_hidden(output)
            continue
        chosen, logprob = choose_for(micro_batch, output, uniforms)
        micro_batch.append(chosen=chosen, logprob=logprob)
        links.send_tokens(chosen)
        if not micro_batch.done:
            micro_batch.compact(context)


def _broadcast_from_last_stage(micro_batches, sampling, groups) -> GenerationOutput:
    """The last stage's (ids, mask, log-probs), packed in one float64 tensor, on every stage."""
    out = collect(micro_batches)
    batch = out.response_ids.shape[0]
    packed = torch.zeros((3, batch, sampling.max_new_tokens), dtype=torch.float64)
    packed = packed.to(compute_device())
    if is_last_stage(groups):
        steps = out.response_ids.shape[1]
        packed[0, :, :steps] = out.response_ids.double()
        packed[1, :, :steps] = out.response_mask.double()
        packed[2, :, :steps] = out.response_logprobs.double()
    dist.broadcast(packed, src=stage_rank(groups, -1), group=groups.pp)
    steps = int(packed[1].any(dim=0).nonzero().max()) + 1
    return GenerationOutput(
        response_ids=packed[0, :, :steps].long(),
        response_mask=packed[1, :, :steps].long(),
        response_logprobs=packed[2, :, :steps].float(),
    )
