"""The micro-batch of scoring and the update: a token grid, and where each PPO row's tokens sit.

One type, two layouts. Padded: one sequence per row, (R, S), mask 0/1. Packed: the sequences'
real tokens back to back in one row, (1, T), the mask holding each sequence's id
(``data/packing.py``). Every index map is a flat position into the grid (``row * S + column``),
so the padded layout is the special case of rows of one width and the readers
(``ppo/scoring.py``, ``ppo/update.py``) never ask which layout they read. The layout decides
only how the forward is called: a packed row gives the LM head the positions it reads
(``BloomModel.forward(output_positions=...)``), a padded grid computes every position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_rlhf.data.packing import pack_sequences
from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.reward.model import last_token_positions


@dataclass(kw_only=True)
class MicroBatch:
    """k PPO rows (and, in an actor's update, rehearsal rows after them) in one token grid.

    Loss normalisation (the update's contract): every loss is a token sum divided by the
    *global minibatch's* count (``tokens``; ``rehearsal_rows`` or ``rehearsal_tokens`` for the
    NLL), then multiplied by ``loss_scale`` = microbatches x DP ranks, which undoes Megatron's
    mean over microbatches and DDP's average over replicas: the gradients summed over every DP
    rank's microbatches are those of the global minibatch's token mean, in any layout.
    """

    input_ids: torch.Tensor  # (R, S) token grid
    padding_mask: torch.Tensor  # (R, S) 0/1 (padded) or each sequence's id 1..k (packed)
    packed: bool  # the layout: R = 1 row of sequences back to back
    predicting: torch.Tensor  # (k, N) flat position predicting response token t (0 if not real)
    response_mask: torch.Tensor  # (k, N) 1 on real response tokens
    last: torch.Tensor  # (k,) flat position of each PPO row's last token
    prompt_end: torch.Tensor  # (k,) flat position of each PPO row's last prompt token
    rehearsal_positions: torch.Tensor | None = None  # (T_R,) flat positions predicting a D_R target
    # the update's per-token fields (k, N), aligned with response_mask
    old_logprobs: torch.Tensor | None = None  # log pi_old(a_t|s_t)
    is_weights: torch.Tensor | None = None  # truncated pi_old / mu (None: no correction)
    advantages: torch.Tensor | None = None
    old_values: torch.Tensor | None = None  # V_old(s_t)
    returns: torch.Tensor | None = None
    value_weights: torch.Tensor | None = None  # the critic targets' weights (None: unweighted)
    tokens: float = 1.0  # response tokens of the global minibatch
    rehearsal_tokens: float = 0.0  # rehearsal target tokens of the global minibatch
    rehearsal_rows: int = 0  # rehearsal rows of the global minibatch
    loss_scale: int = 1  # microbatches x DP ranks

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def response_positions(self) -> torch.Tensor:
        """(M,) the flat positions predicting the real response tokens, row by row."""
        return self.predicting[self.response_mask.bool()]

    def lm_positions(self) -> torch.Tensor:
        """What an LM head reads: the response positions, then the rehearsal ones."""
        response = self.response_positions()
        rehearsal = self.rehearsal_positions
        return response if rehearsal is None else torch.cat([response, rehearsal])

    def forward_inputs(self, lm_head: bool) -> dict:
        """The forward's arguments: the grid, and for a packed row's LM head the positions it
        reads (its vocabulary projection, most of the actor's FLOPs, then skips the rest)."""
        inputs = {"input_ids": self.input_ids, "padding_mask": self.padding_mask}
        if lm_head and self.packed:
            inputs["output_positions"] = self.lm_positions()
        return inputs

    def lm_outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, K, V/tp) the logits at :meth:`lm_positions` from the output of a forward given
        :meth:`forward_inputs` (``lm_head=True``)."""
        return logits if self.packed else self.at(logits, self.lm_positions())[None]

    def at(self, output: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(*positions.shape, ...) a full-grid output (R, S, ...) at flat positions (only those
        are copied: a layer's output need not be contiguous)."""
        positions = positions.to(output.device)
        return output[positions // self.width, positions % self.width]

    def targets(self, positions: torch.Tensor) -> torch.Tensor:
        """(1, K) the token each flat position predicts (the next one in its row)."""
        return self.input_ids.flatten()[positions + 1][None]

    def spread(self, per_token: torch.Tensor) -> torch.Tensor:
        """(k, N) from one value per real response token (M,); 0 elsewhere."""
        real = self.response_mask.bool()
        return per_token.new_zeros(real.shape).masked_scatter(real, per_token)

    def padded_to(self, width: int, pad_id: int) -> MicroBatch:
        """The grid right-padded to ``width`` columns (Megatron's schedules send fixed-shape
        activations), its flat positions moved with their rows."""
        old = self.width

        def move(positions):
            return None if positions is None else positions // old * width + positions % old

        return replace(
            self,
            input_ids=_right_pad(self.input_ids, width, pad_id),
            padding_mask=_right_pad(self.padding_mask, width, 0),
            predicting=torch.where(self.response_mask.bool(), move(self.predicting), 0),
            last=move(self.last),
            prompt_end=move(self.prompt_end),
            rehearsal_positions=move(self.rehearsal_positions),
        )


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a stage cuts its rows into micro-batches: the ``train`` section's keys at one
    step's row width, and the tokenizer's pad id."""

    micro_batch_size: int  # rows of a padded micro-batch
    max_tokens: int | None  # tokens of a packed micro-batch (``train.packing``); None: padded
    pad_id: int  # fills a padded grid's columns past a row's end (attention never sees them)

    @classmethod
    def of(cls, train, width: int, pad_id: int) -> Batching:
        """``train`` (a ``RunConfig``)'s micro-batches of rows at most ``width`` tokens long."""
        return cls(
            micro_batch_size=train.micro_batch_size,
            max_tokens=train.token_budget(width),
            pad_id=pad_id,
        )


def microbatch(
    experience: Experience, packed: bool, rehearsal: list[tuple] | None, pad_id: int
) -> MicroBatch:
    """The micro-batch of ``experience``'s rows (padded or packed), then ``rehearsal``'s
    (token ids, loss mask) rows (1-D, real tokens only; an empty list: rehearsal on, no row
    here; None: rehearsal off), with the update's fields; ``pad_id`` (the tokenizer's) fills
    a padded grid's rows past their end."""
    k, p = experience.sequences.shape[0], experience.prompt_length
    real = experience.attention_mask.bool()  # (k, P + N)
    device = experience.sequences.device
    if packed:
        rows = [experience.sequences[r][real[r]] for r in range(k)]
        pack = pack_sequences(rows + [ids for ids, _ in rehearsal or []])
        input_ids, padding_mask = pack.input_ids, pack.segments
        starts = pack.starts  # each sequence's first token
        prompt_end = starts[:k] + real[:, :p].sum(dim=1) - 1
        last = starts[:k] + pack.lengths[:k] - 1
    else:
        mask = experience.attention_mask
        rows = list(zip(experience.sequences, mask))
        rows += [(ids, torch.ones_like(ids, dtype=mask.dtype)) for ids, _ in rehearsal or []]
        width = max(ids.shape[0] for ids, _ in rows)
        input_ids = torch.stack([_right_pad(ids[None], width, pad_id)[0] for ids, _ in rows])
        padding_mask = torch.stack([_right_pad(m[None], width, 0)[0] for _, m in rows])
        starts = torch.arange(len(rows), device=device) * width  # each row's column 0
        prompt_end = starts[:k] + p - 1
        last = starts[:k] + last_token_positions(experience.attention_mask)
    response = experience.response_mask.bool()
    steps = torch.arange(response.shape[1], device=device)
    rehearsal_positions = None
    if rehearsal is not None:
        target = torch.zeros_like(input_ids.flatten())  # 1 where a rehearsal target sits
        for (_, loss_mask), start in zip(rehearsal, starts[k:].tolist()):
            target[start + 1 : start + len(loss_mask)] = loss_mask[1:]
        rehearsal_positions = target[1:].nonzero()[:, 0]
    return MicroBatch(
        input_ids=input_ids,
        padding_mask=padding_mask,
        packed=packed,
        predicting=torch.where(response, prompt_end[:, None] + steps[None, :], 0),
        response_mask=experience.response_mask,
        last=last,
        prompt_end=prompt_end,
        rehearsal_positions=rehearsal_positions,
        old_logprobs=experience.logprobs,
        is_weights=experience.is_weights,
        advantages=experience.advantages,
        old_values=experience.values,
        returns=experience.returns,
        value_weights=experience.value_weights,
    )


def response_logprobs_of(
    mb: MicroBatch, logits: torch.Tensor, temperature: float, tp_group, return_entropy=False
):
    """log pi (k, N) of each PPO row's response tokens (and the entropy), 0 off the response,
    from the logits (1, K, V/tp) at ``mb.lm_positions()`` (:meth:`MicroBatch.lm_outputs`)."""
    positions = mb.response_positions()
    out = token_logprobs(
        logits[:, : positions.shape[0]], mb.targets(positions), temperature, tp_group,
        return_entropy=return_entropy,
    )  # fmt: skip
    if return_entropy:
        return mb.spread(out[0][0]), mb.spread(out[1][0])
    return mb.spread(out[0])


def values_of(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """V(s_t) (k, N) of each response token from a value head's full-grid output (R, S, 1)."""
    return mb.at(output, mb.predicting)[..., 0] * mb.response_mask


def train_step(engine, microbatches: list[MicroBatch], loss_fn, lm_head: bool = False) -> dict:
    """One optimizer step of a TrainEngine over typed microbatches: the engine takes each
    forward's arguments (:meth:`MicroBatch.forward_inputs`), ``loss_fn(output, mb)`` reads the
    :class:`MicroBatch`."""
    inputs = [mb.forward_inputs(lm_head) | {"microbatch": mb} for mb in microbatches]
    return engine.step(inputs, lambda output, given: loss_fn(output, given["microbatch"]))


def _right_pad(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)
