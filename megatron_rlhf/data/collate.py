"""Collators: pad the items of the datasets into batches with masks.

Prompts to generate from are left-padded (the last prompt token of every row sits in the last
column, where generation continues); SFT and preference sequences are right-padded. Masks are
int64 0/1. ``pad_to_multiple_of`` rounds the padded length up (e.g. to the tensor-parallel size
for sequence parallelism).
"""

from __future__ import annotations

import torch


def collate_prompts(samples: list[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Left-pad ``input_ids``.

    Returns ``input_ids`` (B, T), ``attention_mask`` (B, T) with 1 on real tokens,
    ``prompt_lengths`` (B,) and ``index`` (B,).
    """
    prompts = [_long(sample["input_ids"]) for sample in samples]
    lengths = torch.tensor([len(ids) for ids in prompts])
    width = _width(int(lengths.max()), pad_to_multiple_of)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = ids
        attention_mask[row, width - len(ids) :] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompt_lengths": lengths,
        "index": _indices(samples),
    }


def collate_sft(samples: list[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad ``input_ids`` and ``loss_mask``.

    Returns ``input_ids``, ``attention_mask``, ``loss_mask`` (all (B, T); the loss mask is 1 on
    response tokens, 0 on prompt and padding) and ``index`` (B,).
    """
    sequences = [_long(sample["input_ids"]) for sample in samples]
    width = _width(max(len(ids) for ids in sequences), pad_to_multiple_of)
    input_ids, attention_mask = _right_pad(sequences, width, pad_id)
    loss_mask, _ = _right_pad([_long(sample["loss_mask"]) for sample in samples], width, 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "index": _indices(samples),
    }


def cut_prompt_to_fit(sample: dict, max_length: int) -> tuple[dict, bool]:
    """An SFT ``sample`` (``input_ids``, ``loss_mask``) cut to ``max_length`` tokens from the
    left of its prompt, so that its response keeps every token it can; returns (sample, cut?).

    At least one prompt token stays (the first response token is predicted from it); a response
    longer than ``max_length - 1`` then keeps its first ``max_length - 1`` tokens. The prompt is
    the tokens before the first 1 of ``loss_mask``.
    """
    input_ids, loss_mask = sample["input_ids"], sample["loss_mask"]
    if len(input_ids) <= max_length:
        return sample, False
    response = torch.as_tensor(loss_mask).nonzero()
    prompt_length = int(response[0, 0]) if len(response) else len(input_ids)
    kept_prompt = min(prompt_length, max(1, max_length - (len(input_ids) - prompt_length)))
    start = prompt_length - kept_prompt
    window = slice(start, start + max_length)
    return {**sample, "input_ids": input_ids[window], "loss_mask": loss_mask[window]}, True


def collate_preference(samples: list[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Concatenate prompt + chosen and prompt + rejected, right-padded to one common width.

    Returns, for ``side`` in chosen/rejected: ``{side}_input_ids``, ``{side}_attention_mask``,
    ``{side}_response_mask`` (1 on the response's tokens), all (B, T) with the same T for both
    sides, so they can be stacked into one (2B, T) forward; ``prompt_lengths`` (B,) (the last
    prompt token of row b is at ``prompt_lengths[b] - 1``, where the Advantage Model reads its
    expected-reward head); ``index`` (B,); and when the items have them ``task_ids`` (B,),
    ``chosen_logprobs`` and ``rejected_logprobs`` (B, K) float32.
    """
    prompts = [_long(sample["prompt_ids"]) for sample in samples]
    prompt_lengths = torch.tensor([len(ids) for ids in prompts])
    sides = {
        side: [_long(sample[f"{side}_ids"]) for sample in samples]
        for side in ("chosen", "rejected")
    }
    longest = max(len(p) + len(r) for side in sides.values() for p, r in zip(prompts, side))
    width = _width(longest, pad_to_multiple_of)
    batch = {"prompt_lengths": prompt_lengths, "index": _indices(samples)}
    for side, responses in sides.items():
        sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        input_ids, attention_mask = _right_pad(sequences, width, pad_id)
        response_mask = attention_mask.clone()  # (B, T)
        for row, length in enumerate(prompt_lengths.tolist()):
            response_mask[row, :length] = 0
        batch[f"{side}_input_ids"] = input_ids
        batch[f"{side}_attention_mask"] = attention_mask
        batch[f"{side}_response_mask"] = response_mask
    if all("task_id" in sample for sample in samples):
        batch["task_ids"] = torch.tensor([int(sample["task_id"]) for sample in samples])
    if all("chosen_logprobs" in sample for sample in samples):
        for name in ("chosen_logprobs", "rejected_logprobs"):
            batch[name] = torch.stack(
                [torch.as_tensor(sample[name], dtype=torch.float32) for sample in samples]
            )  # (B, K)
    return batch


def _long(ids) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long)


def _width(longest: int, multiple: int) -> int:
    return -(-longest // multiple) * multiple


def _right_pad(sequences: list[torch.Tensor], width: int, pad_value: int):
    padded = torch.full((len(sequences), width), pad_value, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    for row, ids in enumerate(sequences):
        padded[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    return padded, mask


def _indices(samples: list[dict]) -> torch.Tensor:
    return torch.tensor([int(sample.get("index", -1)) for sample in samples])
