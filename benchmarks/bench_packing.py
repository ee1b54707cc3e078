"""Padding that is not computed (issue 21): a rollout whose rows end early, PPO scoring of
ragged rows, and SFT / reward training steps on HH-RLHF-like lengths, each against the padded
way, side by side.

    python benchmarks/bench_packing.py [--reps 3 --seeds 0 1 --threads 2 --sizes tiny real \\
        --parts rollout scoring sft reward]

One process, ``--threads`` torch threads; the two ways alternate inside every repetition; each
seed is a fresh random model and batch. Sizes: ``tiny`` 4 layers x 128, vocab 1,024; ``real``
BLOOM-560m's width and vocabulary (hidden 1,024, 16 heads, vocab 250,880) with 4 layers, where
the LM head is most of the work.

rollout: B=16 (``--rollout-batch``) left-padded prompts whose lengths are HH-RLHF dialogue
histories (:func:`hh_rlhf_lengths`: the transcript less its last reply; x1/4 and clipped to 256
at the real width, as the training steps), temperature-1 sampling with per-row seeds,
``--new-tokens`` at most, three ways interleaved: "not padded" (the defaults: prompts prefilled
without their padding, ``unpadded_prefill``, and a row that emits EOS leaving the batch, its
KV cache compacted away, ``drop_ended_rows``), ended rows leaving only (a padded prefill), and
"padded" (neither: the whole batch prefilled as wide as its longest prompt and every step
computing every row until the last one ends, the engine before). Tokens are compared row by
row (log-probs on the identical rows): a smaller batch changes the matmuls' rounding, and at
BLOOM's vocabulary with near-uniform sampling a 1e-7 change in a logit can move the sampled
token (as pipelined micro-batches can); each way's tokens/s counts its own tokens.
Lengths follow a known distribution instead of a trained model's: the random BLOOM's final
LayerNorm is scaled down (logits near 0, tokens near uniform) and its bias points along the EOS
token's embedding, which gets a logit ``alpha`` above the rest, so each step ends a row with
probability ``p`` (geometric lengths), set so that ``--early-fraction`` (default 40 %, the
issue's 30-50 %) of the rows end before ``--new-tokens``. tokens/s = generated tokens / s.

scoring: ``ppo/scoring.score`` of the reference policy and a 2-output Advantage Model over one
step's experience (B=8 at real width, 16 tiny), padded micro-batches of 4 rows against packed
micro-batches of at most 4 x the padded width tokens (``train.packing``). Prompt lengths are
log-normal (median 16 tokens, clipped to 1..48), response lengths geometric with mean 24,
clipped to 1..64: a stand-in for a preference dataset's skew (not fitted to one). Log-probs and
scores are compared (rel 1e-5). tokens/s = real (prompt + response) tokens / s.

sft / reward: one optimizer step (forward, backward, Adam at lr 0 so every repetition computes
the same loss) of the ``train-sft`` / ``train-reward`` (AM) engine over one global batch (32
examples tiny, 8 real), built by the commands' own batchers: packed (``train.packing``,
first-fit into packs of 4 x the longest example's tokens, each sequence's attention alone)
against padded micro-batches of 4 examples, all as wide as the step's longest. Lengths follow
:func:`hh_rlhf_lengths` (Anthropic HH-RLHF's split sizes; scaled by 1/4 at the real width to fit
a CPU, clipped to 512 / 256 tokens). The two losses are compared (max diff column, relative).
tokens/s = real tokens / s.

min / median / max over reps x seeds, ratio of medians; a claim holds only if every seed shows
it. Measured (defaults; idle 2-core VM; rollout rows on 2026-12-02, load 1.2 -> 2.1 for the
real rows, the tiny row while the load average of an ended test run still decayed (vmstat:
idle); the rest on 2026-12-01 at load 1.5 -> 2.1):

    | part    | size | batch                                          | not padded            | padded               | ratio (per seed)     |
    | rollout | tiny | 41 % end early, prompts 38 % real, 32/32 rows identical | 953 / 1313 / 1682 | 665 / 951 / 1416 | 1.38x (1.43x, 1.47x) |
    | rollout | real | B=64, HH-RLHF prompts (mean 156, longest 632; 26 % real), 40 % end early, 128/128 identical | 40.4 / 44.6 / 49.6 | 25.9 / 29.6 / 31.0 | 1.51x (1.45x, 1.57x) |
    | rollout | real | B=64, prompts x1/4 (mean 39, longest 158; 26 % real), 40 % end early, 128/128 identical | 57.9 / 67.8 / 93.6 | 50.7 / 54.4 / 61.8 | 1.25x (1.15x, 1.28x) |
    | scoring | tiny | B=16, 34 % of the padded batch real | 6763 / 8252 / 9602   | 3458 / 4270 / 4593   | 1.93x (1.90x, 2.37x) |
    | scoring | real | B=8, 50 % of the padded batch real  | 134 / 141 / 155      | 59 / 72 / 97         | 1.95x (2.32x, 1.48x) |
    | update  | tiny | B=32, 39 % real                      | 3605 / 4705 / 5319   | 912 / 953 / 1056     | 4.94x (4.21x, 5.23x) |
    | update  | real | B=8, 36 % real                       | 29.6 / 32.0 / 34.9   | 10.8 / 13.2 / 15.7   | 2.42x (2.86x, 2.15x) |
    | sft     | tiny | 32 sequences, 47 % real              | 4561 / 6287 / 8646   | 1983 / 2397 / 3391   | 2.62x (2.51x, 3.23x) |
    | sft     | real | 8 sequences, 39 % real               | 39.9 / 40.6 / 48.3   | 12.2 / 15.9 / 21.0   | 2.55x (3.69x, 2.02x) |
    | reward  | tiny | 32 pairs, 38 % real                  | 8379 / 9241 / 10108  | 1858 / 1982 / 2093   | 4.66x (4.11x, 5.13x) |
    | reward  | real | 8 pairs, 40 % real                   | 85.5 / 123.3 / 229.3 | 58.1 / 65.0 / 75.4   | 1.90x (1.79x, 2.90x) |

Rollout rows (2026-12-02; `--rollout-batch 64`, the first with `--rollout-prompt-scale 1`):
most of the gain is the prompts' padding not computed. Ended rows leaving the batch alone give
1.07x tiny, 1.10x (1.07x, 1.13x) at the real width with x1/4 prompts and 0.99x (0.97x, 0.93x)
with full-length prompts: a CPU decode step costs ~0.09 s whatever its rows (reading the 1 GB
LM head) plus ~5 ms a row, and each compaction copies the live rows' KV cache up to the filled
length (~1.5 GB at 700 columns), as much as it saves there. Packed scoring gains about the padding it skips; packed training at the real
width about the padding too, more at the tiny width, where padded attention dominates.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    "real": dict(vocab_size=250_880, hidden_size=1024, num_layers=4, num_heads=16),
}
PAD, EOS = 3, 2


def prompts(seed: int, vocab: int, lengths: list[int]):
    """Random prompts of these lengths, left-padded to the longest."""
    from megatron_rlhf.generation.prompts import left_pad

    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    return left_pad(rows, PAD)


def eos_model(directory: Path, size: str | dict, seed: int, stop_probability: float) -> None:
    """A random BLOOM (a ``SIZES`` name or ``BloomArchitecture`` fields) whose every step emits
    EOS with about ``stop_probability``."""
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    arch = BloomArchitecture(**(SIZES[size] if isinstance(size, str) else size))
    model = random_hf_bloom(arch, seed=seed)
    vocab = arch.vocab_size
    alpha = math.log(stop_probability * (vocab - 1) / (1 - stop_probability))
    with torch.no_grad():
        ln_f = model.transformer.ln_f
        ln_f.weight.mul_(1e-3)  # every logit near 0: tokens near uniform
        direction = torch.randn(arch.hidden_size, generator=torch.Generator().manual_seed(seed))
        direction /= direction.norm()
        ln_f.bias.copy_(direction)
        embeddings = model.transformer.word_embeddings.weight
        embeddings[EOS] = alpha * direction  # logit(EOS) ~ alpha, the rest ~ 0
    model.save_pretrained(directory, safe_serialization=True)


def stop_probability(early_fraction: float, new_tokens: int) -> float:
    """Per-step EOS probability that ends ``early_fraction`` of rows within ``new_tokens``."""
    return 1 - (1 - early_fraction) ** (1 / new_tokens)


ROLLOUT_WAYS = {  # name: (unpadded_prefill, drop_ended_rows)
    "not padded": (True, True),
    "ended rows leave only": (False, True),
    "padded": (False, False),
}


def rollout_part(size: str, args) -> dict:
    """``generate`` three ways, interleaved: prompts prefilled without their padding and ended
    rows leaving the batch (today's default), ended rows leaving only, and neither (the engine
    before issue 21)."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate

    scale, longest = (0.25, 256) if size == "real" else (1.0, 512)
    if args.rollout_prompt_scale is not None:
        scale, longest = args.rollout_prompt_scale, int(1024 * args.rollout_prompt_scale)
    rates = {way: [] for way in ROLLOUT_WAYS}
    lengths, prompt_lengths, per_seed, identical = [], [], {}, 0
    p = stop_probability(args.early_fraction, args.new_tokens)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            eos_model(Path(tmp), size, seed, p)
            model = load_bloom(tmp, init_weights=False).eval()
        rows = [prompt for prompt, _ in hh_rlhf_lengths(seed, args.rollout_batch, scale, longest)]
        prompt_lengths += rows
        ids, mask = prompts(seed, SIZES[size]["vocab_size"], rows)
        row_seeds = tuple(seed * 1000 + row for row in range(args.rollout_batch))
        seconds = {way: [] for way in ROLLOUT_WAYS}
        outputs = {}
        for _ in range(args.reps):
            for way, (unpadded, drop) in ROLLOUT_WAYS.items():
                sampling = SamplingConfig(
                    max_new_tokens=args.new_tokens, row_seeds=row_seeds, eos_id=EOS,
                    pad_id=PAD, drop_ended_rows=drop, unpadded_prefill=unpadded,
                )  # fmt: skip
                start = time.perf_counter()
                outputs[way] = generate(model, ids, mask, sampling)
                seconds[way].append(time.perf_counter() - start)
        a, b = outputs["not padded"], outputs["padded"]
        same = [torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids)]
        identical += sum(same)
        lengths += a.response_mask.sum(dim=1).tolist()
        for way, out in outputs.items():  # each way's own generated tokens
            rates[way] += [int(out.response_mask.sum()) / t for t in seconds[way]]
        same = torch.tensor(same)
        padded = statistics.median(seconds["padded"])
        per_seed[seed] = {
            "ratio": padded / statistics.median(seconds["not padded"]),
            "drop_only": padded / statistics.median(seconds["ended rows leave only"]),
            "diff": float((a.response_logprobs - b.response_logprobs)[same].abs().max())
            if same.any()
            else float("nan"),
        }
        del model
    early = sum(n < args.new_tokens for n in lengths) / len(lengths)
    real = sum(prompt_lengths)
    padded_prompts = sum(max(prompt_lengths[i : i + args.rollout_batch]) * args.rollout_batch
                         for i in range(0, len(prompt_lengths), args.rollout_batch))  # fmt: skip
    shape = (
        f"B={args.rollout_batch}, prompts {100 * real / padded_prompts:.0f} % of the padded "
        f"prompt batch real (mean {statistics.mean(prompt_lengths):.0f}, longest "
        f"{max(prompt_lengths)}), {100 * early:.0f} % end early, mean length "
        f"{statistics.mean(lengths):.1f} of {args.new_tokens}, {identical}/{len(lengths)} rows "
        "token-identical"
    )
    drop_only = ", ".join(f"{r['drop_only']:.2f}x" for r in per_seed.values())
    extra = (
        f"ended rows leave only (padded prefill): {stats(rates['ended rows leave only'])} tok/s, "
        f"{statistics.median(rates['ended rows leave only']) / statistics.median(rates['padded']):.2f}x "
        f"the padded medians (per seed {drop_only})"
    )
    return {
        "rates": {True: rates["not padded"], False: rates["padded"]},
        "per_seed": per_seed, "shape": shape, "extra": extra,
    }  # fmt: skip


def ragged_experience(seed: int, batch: int, vocab: int):
    """One step's experience: log-normal prompts (median 16, 1..48), geometric responses (mean
    24, 1..64), left-padded prompts then right-padded responses."""
    from megatron_rlhf.ppo.experience import Experience

    g = torch.Generator().manual_seed(seed)
    prompt = (16 * torch.exp(0.6 * torch.randn(batch, generator=g))).round().clamp(1, 48).long()
    response = (torch.log(torch.rand(batch, generator=g)) / math.log(1 - 1 / 24)).ceil()
    response = response.clamp(1, 64).long()
    p, n = int(prompt.max()), int(response.max())
    sequences = torch.full((batch, p + n), PAD, dtype=torch.long)
    mask = torch.zeros((batch, p + n), dtype=torch.long)
    for row in range(batch):
        first, end = p - int(prompt[row]), p + int(response[row])
        sequences[row, first:end] = torch.randint(4, vocab, (end - first,), generator=g)
        mask[row, first:end] = 1
    return Experience(
        sequences=sequences, attention_mask=mask, response_mask=mask[:, p:].clone(),
        prompt_index=torch.arange(batch), prompt_length=p,
    )  # fmt: skip


def scoring_part(size: str, args) -> dict:
    from dataclasses import replace

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.ppo.config import RolloutConfig
    from megatron_rlhf.ppo.microbatch import Batching
    from megatron_rlhf.ppo.scoring import score

    batch = 8 if size == "real" else 16
    rates = {True: [], False: []}
    per_seed, fill = {}, []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            save_random_hf_bloom(tmp, BloomArchitecture(**SIZES[size]), seed=seed)
            models = {
                "ref_logprobs": load_bloom(tmp, init_weights=False).eval(),
                "scores": load_bloom(tmp, head="scalar", num_scalar_outputs=2).eval(),
            }
        experience = ragged_experience(seed, batch, SIZES[size]["vocab_size"])
        tokens = int(experience.attention_mask.sum())
        fill.append(tokens / experience.attention_mask.numel())
        budget = 4 * experience.sequences.shape[1]
        seconds = {True: [], False: []}
        outputs = {}
        for _ in range(args.reps):
            for packed in (True, False):
                start = time.perf_counter()
                batching = Batching(
                    micro_batch_size=4, max_tokens=budget if packed else None, pad_id=PAD
                )
                outputs[packed] = score(
                    replace(experience), models, "am", RolloutConfig(), batching
                )
                seconds[packed].append(time.perf_counter() - start)
        real = experience.response_mask.bool()
        a, b = outputs[True], outputs[False]
        diff = float((a.ref_logprobs - b.ref_logprobs)[real].abs().max())
        diff = max(diff, float((a.scores - b.scores).abs().max()))
        for packed in (True, False):
            rates[packed] += [tokens / t for t in seconds[packed]]
        per_seed[seed] = {
            "ratio": statistics.median(seconds[False]) / statistics.median(seconds[True]),
            "diff": diff,
        }
        del models
    shape = f"B={batch}, {100 * statistics.mean(fill):.0f} % of the padded batch is real tokens"
    return {"rates": rates, "per_seed": per_seed, "shape": shape}


HH_RLHF = {  # config: (train examples, bytes per example) from the dataset card's split sizes
    "helpful-base": (43_835, 67_080_738 / 43_835),
    "helpful-online": (22_007, 81_565_233 / 22_007),
    "helpful-rejection-sampled": (52_421, 103_629_758 / 52_421),
    "harmless-base": (42_537, 56_295_642 / 42_537),
}
BYTES_PER_TOKEN = 4.0  # BLOOM's tokenizer on English text, about


def hh_rlhf_lengths(seed: int, count: int, scale: float, longest: int) -> list[tuple[int, int]]:
    """(prompt, response) token lengths of ``count`` examples drawn like Anthropic HH-RLHF's.

    The published figures are the dataset card's split sizes: per config, train examples and
    bytes, each example a chosen and a rejected transcript (dialogue history + last reply), so
    a transcript averages bytes / 2 / ``BYTES_PER_TOKEN`` tokens: helpful-base 191,
    helpful-online 463, helpful-rejection-sampled 247, harmless-base 165. A config is drawn by
    its share of the examples, a length log-normally around its mean (sigma 0.7: the card
    gives no spread, this is our assumption), the last reply a uniform 10-50 % of it; lengths
    times ``scale`` (to fit CPU runs), clipped to 4..``longest``.
    """
    g = torch.Generator().manual_seed(seed)
    names = list(HH_RLHF)
    weights = torch.tensor([HH_RLHF[name][0] for name in names], dtype=torch.float64)
    sigma = 0.7
    lengths = []
    for config in torch.multinomial(weights, count, replacement=True, generator=g).tolist():
        mean = HH_RLHF[names[config]][1] / 2 / BYTES_PER_TOKEN * scale
        mu = math.log(mean) - sigma**2 / 2
        total = int(min(max(math.exp(mu + sigma * float(torch.randn(1, generator=g))), 4), longest))
        response = max(1, int(total * (0.1 + 0.4 * float(torch.rand(1, generator=g)))))
        lengths.append((total - response, response))
    return lengths


def random_tokens(g: torch.Generator, count: int, vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (count,), generator=g)


def sft_items(seed: int, count: int, vocab: int, scale: float, longest: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 1)
    items = []
    for prompt, response in hh_rlhf_lengths(seed, count, scale, longest):
        loss_mask = torch.cat(
            [torch.zeros(prompt, dtype=torch.long), torch.ones(response, dtype=torch.long)]
        )
        items.append(
            {"input_ids": random_tokens(g, prompt + response, vocab), "loss_mask": loss_mask}
        )
    return items


def pair_items(seed: int, count: int, vocab: int, scale: float, longest: int) -> list[dict]:
    """Pairs: the chosen reply drawn as above, the rejected one as long as another draw's."""
    g = torch.Generator().manual_seed(seed + 1)
    lengths = hh_rlhf_lengths(seed, 2 * count, scale, longest)
    items = []
    for (prompt, chosen), (_, rejected) in zip(lengths[::2], lengths[1::2]):
        rejected = max(1, min(rejected, longest - prompt))
        items.append({
            "prompt_ids": random_tokens(g, prompt, vocab),
            "chosen_ids": random_tokens(g, chosen, vocab),
            "rejected_ids": random_tokens(g, rejected, vocab),
        })  # fmt: skip
    return items


def train_step_part(kind: str, size: str, args) -> dict:
    """One optimizer step of the SFT or reward trainer (``train.packing`` on / off) over the
    same global batch, through the same microbatch builders as the commands; lr 0, so every
    repetition computes the same loss."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.data.packing import pack_first_fit
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.reward.train import PairBatches, make_loss_fn
    from megatron_rlhf.training import OptimConfig, TrainEngine
    from megatron_rlhf.training.sft import SequenceBatches, sft_loss

    batch, scale, longest = (8, 0.25, 256) if size == "real" else (32, 1.0, 512)
    vocab = SIZES[size]["vocab_size"]
    rates = {True: [], False: []}
    per_seed, fill = {}, []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            save_random_hf_bloom(tmp, BloomArchitecture(**SIZES[size]), seed=seed)
            head = dict(head="scalar", num_scalar_outputs=2) if kind == "reward" else {}
            model = load_bloom(tmp, **head)
        engine = TrainEngine(model, OptimConfig(lr=0.0, warmup_fraction=0.0), total_steps=100)
        common = dict(micro_batch_size=4, num_microbatches=batch // 4, dp_rank=0, dp_size=1,
                      width_multiple=1, pad_id=PAD)  # fmt: skip
        if kind == "sft":
            items = sft_items(seed, batch, vocab, scale, longest)
            lengths = [len(item["input_ids"]) for item in items]
            rows, loss_fn = 1, sft_loss
            batcher = SequenceBatches(**common, max_length=longest)
        else:
            items = pair_items(seed, batch, vocab, scale, longest)
            lengths = [2 * len(i["prompt_ids"]) + len(i["chosen_ids"]) + len(i["rejected_ids"])
                       for i in items]  # fmt: skip
            rows = 2
            loss_fn = make_loss_fn(SimpleNamespace(loss="am", am=SimpleNamespace(
                margin=2.5, policy_column=None)))  # fmt: skip
            batcher = PairBatches(**common)
        tokens = sum(lengths)
        budget = 4 * rows * longest  # the commands' default: micro_batch_size x longest example
        packs = [[items[j] for j in pack] for pack in pack_first_fit(lengths, budget)]
        microbatches = {
            True: batcher.collate_packed(packs),
            False: batcher.collate_padded([items[i : i + 4] for i in range(0, batch, 4)]),
        }
        for packed, mbs in microbatches.items():  # the scales train_steps sets
            sizes = [len(pack) for pack in packs] if packed else [4] * len(mbs)
            if kind == "sft":
                total = sum(int(m["loss_mask"][:, 1:].sum()) for m in mbs)
            for mb, size_ in zip(mbs, sizes):
                if kind == "sft":
                    mb["nll_scale"] = torch.tensor(len(mbs) / total)
                else:
                    mb["pair_weight"] = torch.tensor(size_ * len(mbs) / batch)
        fill.append(tokens / sum(mb["input_ids"].numel() for mb in microbatches[False]))
        for packed in (True, False):  # untimed: the first step allocates buffers and state
            engine.step(microbatches[packed], loss_fn)
        seconds, losses = {True: [], False: []}, {}
        for _ in range(args.reps):
            for packed in (True, False):
                start = time.perf_counter()
                metrics = engine.step(microbatches[packed], loss_fn)
                seconds[packed].append(time.perf_counter() - start)
                losses[packed] = metrics["loss"]
        for packed in (True, False):
            rates[packed] += [tokens / t for t in seconds[packed]]
        per_seed[seed] = {
            "ratio": statistics.median(seconds[False]) / statistics.median(seconds[True]),
            "diff": abs(losses[True] - losses[False]) / max(abs(losses[False]), 1e-12),
        }
        del engine, model
    shape = (f"{batch} {'sequences' if kind == 'sft' else 'pairs'}, "
             f"{100 * statistics.mean(fill):.0f} % of the padded batch real")  # fmt: skip
    return {"rates": rates, "per_seed": per_seed, "shape": shape}


def hh_rlhf_experience(seed: int, batch: int, vocab: int, scale: float, longest: int):
    """One PPO step's experience with :func:`hh_rlhf_lengths` prompts and responses (prompts
    left-padded, responses right-padded), random old log-probs, advantages, values, returns."""
    from megatron_rlhf.ppo.experience import Experience

    g = torch.Generator().manual_seed(seed + 2)
    lengths = hh_rlhf_lengths(seed, batch, scale, longest)
    p, n = max(q for q, _ in lengths), max(r for _, r in lengths)
    sequences = torch.full((batch, p + n), PAD, dtype=torch.long)
    mask = torch.zeros((batch, p + n), dtype=torch.long)
    for row, (prompt, response) in enumerate(lengths):
        sequences[row, p - prompt : p + response] = random_tokens(g, prompt + response, vocab)
        mask[row, p - prompt : p + response] = 1
    response_mask = mask[:, p:].clone()

    def per_token(center: float = 0.0):
        return (center + torch.randn(batch, n, generator=g)) * response_mask

    return Experience(
        sequences=sequences, attention_mask=mask, response_mask=response_mask,
        prompt_index=torch.arange(batch), prompt_length=p, logprobs=per_token(-3.0),
        advantages=per_token(), values=per_token(), returns=per_token(),
    )  # fmt: skip


def update_part(size: str, args) -> dict:
    """``ppo/update.ppo_update`` (actor and critic, one minibatch) over one step's experience,
    packed (``train.packing``: budget micro_batch_size 4 x the padded width, as train-ppo's
    default) against padded micro-batches of 4 rows; lr 0, so every repetition computes the
    same losses."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.ppo.config import RehearsalSection, RolloutConfig
    from megatron_rlhf.ppo.microbatch import Batching
    from megatron_rlhf.ppo.roles import Role, Roles
    from megatron_rlhf.ppo.update import ppo_update
    from megatron_rlhf.training import OptimConfig, TrainEngine

    batch, scale, longest = (8, 0.25, 256) if size == "real" else (32, 1.0, 512)
    ppo = SimpleNamespace(epochs=1, num_minibatches=1, clip_ratio=0.2, value_clip=0.2)
    config = SimpleNamespace(ppo=ppo, rollout=RolloutConfig(), rehearsal=RehearsalSection())
    micro_batch_size = 4
    rates = {True: [], False: []}
    per_seed, fill = {}, []
    for seed in args.seeds:
        roles = {}
        with tempfile.TemporaryDirectory() as tmp:
            save_random_hf_bloom(tmp, BloomArchitecture(**SIZES[size]), seed=seed)
            for name, head in (("actor", {}), ("critic", dict(head="scalar"))):
                model = load_bloom(tmp, **head)
                engine = TrainEngine(model, OptimConfig(lr=0.0, warmup_fraction=0.0), 100)
                roles[name] = Role(name, model, model.pg_collection, engine)
        experience = hh_rlhf_experience(seed, batch, SIZES[size]["vocab_size"], scale, longest)
        tokens = int(experience.attention_mask.sum())
        fill.append(tokens / experience.attention_mask.numel())
        budget = micro_batch_size * experience.sequences.shape[1]

        trained = Roles(
            actor=roles["actor"], reference=None, critic=roles["critic"], reward=None,
            rollout=None, world=None,
        )  # fmt: skip
        run = partial(ppo_update, experience, trained, config)
        shapes = {
            packed: Batching(
                micro_batch_size=micro_batch_size, max_tokens=budget if packed else None, pad_id=PAD
            )
            for packed in (True, False)
        }
        for packed in (True, False):  # untimed: the first step allocates buffers and state
            run(shapes[packed], torch.Generator().manual_seed(seed), None)
        seconds, metrics = {True: [], False: []}, {}
        for _ in range(args.reps):
            for packed in (True, False):
                start = time.perf_counter()
                metrics[packed] = run(shapes[packed], torch.Generator().manual_seed(seed), None)
                seconds[packed].append(time.perf_counter() - start)
        for packed in (True, False):
            rates[packed] += [tokens / t for t in seconds[packed]]
        keys = ("actor/policy_loss", "critic/value_loss", "actor/grad_norm", "critic/grad_norm")
        per_seed[seed] = {
            "ratio": statistics.median(seconds[False]) / statistics.median(seconds[True]),
            "diff": max(
                abs(metrics[True][k] - metrics[False][k]) / max(abs(metrics[False][k]), 1e-12)
                for k in keys
            ),
        }
    shape = f"B={batch}, {100 * statistics.mean(fill):.0f} % of the padded batch real"
    return {"rates": rates, "per_seed": per_seed, "shape": shape}


PARTS = {
    "rollout": rollout_part,
    "update": update_part,
    "scoring": scoring_part,
    "sft": lambda size, args: train_step_part("sft", size, args),
    "reward": lambda size, args: train_step_part("reward", size, args),
}


def stats(rates: list[float]) -> str:
    return f"{min(rates):7.1f} / {statistics.median(rates):7.1f} / {max(rates):7.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "real"])
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    parser.add_argument("--new-tokens", type=int, default=64, help="rollout length budget")
    parser.add_argument("--rollout-batch", type=int, default=16, help="rollout prompts")
    parser.add_argument("--early-fraction", type=float, default=0.4)
    parser.add_argument("--rollout-prompt-scale", type=float,
                        help="scale of the rollout's HH-RLHF prompt lengths (default: 1/4 at the "
                             "real width, 1 tiny; transcripts clipped to 1024 x scale tokens)")  # fmt: skip
    args = parser.parse_args()
    if args.reps < 3 or len(args.seeds) < 2:
        parser.error("measure with >= 3 reps and >= 2 seeds")
    torch.set_num_threads(args.threads)
    from megatron_rlhf.distributed import destroy, initialize

    initialize()
    print(f"machine: {os.cpu_count()} CPUs, {args.threads} threads, load {os.getloadavg()}")
    print(f"{args.reps} reps x seeds {args.seeds}; tokens/s min / median / max")
    print("| part | size | batch | not padded | padded | ratio of medians | per seed | max diff |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    try:
        for part in args.parts:
            for size in args.sizes:
                result = PARTS[part](size, args)
                rates = result["rates"]
                ratio = statistics.median(rates[True]) / statistics.median(rates[False])
                seeds = ", ".join(f"{r['ratio']:.2f}x" for r in result["per_seed"].values())
                diff = max(r["diff"] for r in result["per_seed"].values())
                print(
                    f"| {part} | {size} | {result['shape']} | {stats(rates[True])} | "
                    f"{stats(rates[False])} | {ratio:.2f}x | {seeds} | {diff:.1e} |",
                    flush=True,
                )
                if "extra" in result:
                    print(f"|   {part} | {size} | {result['extra']} |", flush=True)
    finally:
        destroy()
    print(f"load at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
