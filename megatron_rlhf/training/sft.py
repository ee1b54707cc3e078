"""``torchrun ... -m megatron_rlhf train-sft --config FILE [key=value ...]``: supervised fine-tuning.

    torchrun --nproc-per-node 8 -m megatron_rlhf train-sft \\
        --config examples/sft/tiny_cpu.yaml parallel.tp=2 parallel.pp=2 optim.lr=1e-5

The SFT policy of the paper's pipeline (the initial policy of PPO, the reference model, the
source of D_R's responses). The model comes from a Hugging Face BLOOM directory or an LM
checkpoint of megatron-rlhf; the data is ``tools/preprocess_data.py --kind sft`` output. The
loss is the negative log-likelihood of the response tokens (``loss_mask``), averaged over every
response token of the global batch (not per microbatch or per rank), computed on this rank's
vocabulary shard of the logits with the fused ``token_logprobs`` kernel, so any tp/pp/dp gives
the single-process loss. Sequences longer than ``data.max_length`` keep their first tokens.

Like ``train-reward``: Megatron-Core's DDP and optimizer, linear warm-up over
``optim.warmup_fraction`` of the steps then cosine to ``optim.min_lr_ratio`` of the peak lr;
every ``train.eval_interval`` steps the held-out NLL; every ``train.save_interval`` steps and at
the end a checkpoint ``train.output_dir/step_N`` that resumes exactly (model, optimizer, LR
schedule, RNG, data position; ``latest_checkpoint.txt`` names the newest), holds the resolved
config in its ``megatron_rlhf.json`` and loads as a policy anywhere (``generate``, ``train-ppo``,
``tools/convert_checkpoint.py megatron-to-hf``). TensorBoard scalars go to
``train.output_dir/tensorboard`` and one JSON line per logged step to ``metrics.jsonl``.

In Python: ``run(config)`` (collective over the launch's ranks; returns the history, the last
evaluation and the final checkpoint) or ``main(argv)`` (the command). The loop is
training/loop.py's, shared with ``train-reward``; this module holds the config, the sequences'
batching, the loss and the held-out evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from megatron_rlhf.distributed.layouts import LayoutConfig
from megatron_rlhf.training import config as shared
from megatron_rlhf.training import loop
from megatron_rlhf.training.command import (
    check_data_fits_model,
    command_main,
    held_out_split,
    to_device,
)
from megatron_rlhf.training.config import (
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_problems,
    optim_problems,
)
from megatron_rlhf.training.run import log
from megatron_rlhf.training.throughput import summed_over

COMMAND = "train-sft"


@dataclass(kw_only=True)
class SFTDataConfig(shared.TrainEvalDataConfig):
    """SFT data: prefixes written by ``tools/preprocess_data.py --kind sft`` (sequences:
    prompt + response, the loss on the response)."""

    max_length: int | None = None
    """Keep the first this many tokens of a sequence (None: the model's max_sequence_length)."""


@dataclass(kw_only=True)
class SFTConfig:
    """``train-sft``: one supervised fine-tuning run."""

    model: ModelConfig
    """The initial policy (HF BLOOM or LM checkpoint)."""
    parallel: LayoutConfig = field(default_factory=LayoutConfig)
    """Its TP/PP layout (data parallel over the rest of the launch)."""
    data: SFTDataConfig
    """Training and held-out SFT sequences."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Adam, warm-up then cosine, gradient clipping."""
    train: TrainConfig
    """Batching, evaluation, checkpoints and logs (an example is one sequence)."""


def main(argv: list[str]) -> int:
    return command_main(COMMAND, SFTConfig, run, argv, _summary)


def _summary(config: SFTConfig, result: dict) -> dict:
    history, final_eval = result["history"], result["eval"] or {}
    return dict(
        steps=result["step"],
        train_loss=history[-1]["loss"] if history else "-",  # a finished run took no step
        eval_loss=final_eval.get("loss", "-"),
        seconds=round(result["seconds"], 1),
        checkpoint=result["checkpoint"],
    )


def run(config: SFTConfig, **options) -> dict:
    """Run (or resume) one SFT run; returns ``{"step", "history" (per-step metrics), "eval"
    (the last evaluation or None), "checkpoint", "seconds", "stopped_by"}``. ``options``:
    training/loop.py ``train``'s (overwrite, force_config_change, skip_memory_check).
    Collective over every rank."""
    return loop.train(SFTTask(config), **options)


class SFTTask(loop.Task):
    """``train-sft`` in the shared loop: SFT sequences, the response tokens' NLL, the held-out
    NLL per token."""

    name, examples, rows_per_example, head = COMMAND, "sequences", 1, "lm"
    config: SFTConfig

    def config_problems(self) -> list[str]:
        problems = config_problems(self.config.train, self.config.data)
        if self.config.data.max_length is not None and self.config.data.max_length < 2:
            problems.append(f"data.max_length={self.config.data.max_length} must be >= 2")
        return problems + optim_problems(self.config.optim, "optim")

    def open_data(self, arch) -> loop.Data:
        data = _open_data(self.config)
        check_data_fits_model(data.dataset, "data.train", self.config.model.load, arch.vocab_size)
        return data

    def batches(self, groups, data: loop.Data, num_microbatches: int, max_length: int, max_tokens):
        _note_truncation(data.train_set, max_length)  # what these batches cut
        return SequenceBatches.of(
            self.config, groups, num_microbatches, data.dataset.pad_id, max_tokens=max_tokens,
            max_length=max_length, dp_group=groups.dp if groups.dp.size() > 1 else None,
        )  # fmt: skip

    def loss_fn(self, groups):
        from megatron_rlhf.distributed.parallel import vocab_group

        return partial(sft_loss, tp_group=vocab_group(groups))

    def evaluate(self, engine, eval_set, batches) -> dict:
        return evaluate(engine, eval_set, batches)

    def step_metrics(self, metrics: dict, batches) -> dict:
        del metrics["nll_sum"], metrics["tokens"]  # per-microbatch; the loss says it all
        metrics["response_tokens"] = batches.last_step_tokens
        return metrics


def sft_loss(logits: torch.Tensor, microbatch: dict, tp_group=None):
    """NLL of ``input_ids[:, 1:]`` over ``loss_mask[:, 1:]`` from the logits (B, S, V/tp),
    summed and multiplied by ``microbatch["nll_scale"]`` (see :class:`SequenceBatches`);
    ``tp_group``: the model's TP group when tp > 1 (the logits are this rank's vocab shard)."""
    from megatron_rlhf.kernels import token_logprobs

    logprobs = token_logprobs(logits[:, :-1], microbatch["input_ids"][:, 1:], 1.0, tp_group)
    mask = microbatch["loss_mask"][:, 1:].to(logprobs.dtype)  # (B, S-1)
    nll_sum = -(logprobs * mask).sum()
    scale = microbatch["nll_scale"].to(nll_sum.dtype)
    return nll_sum * scale, {"nll_sum": nll_sum.detach(), "tokens": mask.sum()}


@dataclass
class SequenceBatches(loop.Batches):
    """How this rank turns SFT sequences into microbatches: padded (``micro_batch_size``
    sequences to the longest) or packed (``max_tokens``: sequences back to back in one row).

    The engine averages the microbatch losses over this rank's microbatches and DDP averages
    gradients over data-parallel ranks; ``nll_scale = microbatches · dp / (response tokens of
    the global batch)`` turns that into the NLL summed over the global batch's response tokens
    divided by their count, whatever the layout, packing or not.
    """

    max_length: int
    """Sequences keep their first this many tokens."""
    dp_group: object = None
    """The model's data-parallel group (None: dp = 1), over which response tokens are counted."""
    last_step_tokens: int = 0
    """Response tokens of the global batch last yielded by :meth:`train_steps`."""

    def train_steps(self, dataset, seed: int, consumed: int):
        """Endless iterator of this rank's microbatches, one list per optimizer step, from
        global stream position ``consumed`` (a resumed run sees what an uninterrupted one would)."""
        chunks_per_step = self.packed_step_chunks if self.max_tokens else self.step_chunks
        for chunks in chunks_per_step(dataset, seed, consumed):
            microbatches = self.collate(chunks)
            tokens = sum(mb["loss_mask"][:, 1:].sum() for mb in microbatches)
            total = int(summed_over(tokens, self.dp_group))
            scale = len(microbatches) * self.dp_size / max(total, 1)
            for mb in microbatches:
                mb["nll_scale"] = torch.tensor(scale, dtype=torch.float32)
            self.last_step_tokens = total
            yield microbatches

    def eval_microbatches(self, dataset):
        """This rank's share of ``dataset``, one padded microbatch (a list of one) at a time."""
        for chunk in self.eval_chunks(dataset):
            microbatches = self.collate_padded([chunk])
            microbatches[0]["nll_scale"] = torch.tensor(0.0)
            yield microbatches

    def example_lengths(self, train_set, indices: list[int]) -> list[int]:
        from megatron_rlhf.data import stream_lengths

        return np.minimum(stream_lengths(train_set, "tokens", indices), self.max_length).tolist()

    def collate(self, chunks: list[list[dict]]) -> list[dict]:
        """One step's microbatches of sequences truncated to ``max_length``: packed when
        packing, else padded."""
        for chunk in chunks:
            for sample in chunk:
                sample["input_ids"] = sample["input_ids"][: self.max_length]
                sample["loss_mask"] = sample["loss_mask"][: self.max_length]
        return self.collate_packed(chunks) if self.max_tokens else self.collate_padded(chunks)

    def collate_padded(self, chunks: list[list[dict]]) -> list[dict]:
        """Right-padded microbatches (B, width), the step's longest sequence wide."""
        from megatron_rlhf.data import collate_sft

        longest = max(len(sample["input_ids"]) for chunk in chunks for sample in chunk)
        width = self.pack_width([longest])
        microbatches = []
        for chunk in chunks:
            batch = collate_sft(chunk, self.pad_id, pad_to_multiple_of=width)  # (B, width)
            microbatch = {
                "input_ids": batch["input_ids"],
                "padding_mask": batch["attention_mask"],
                "loss_mask": batch["loss_mask"],
            }
            microbatches.append(to_device(microbatch))
        return microbatches

    def collate_packed(self, chunks: list[list[dict]]) -> list[dict]:
        """One packed row (1, width) per chunk: ``padding_mask`` holds each sequence's id, and
        ``loss_mask`` is 0 on each sequence's first token (in a padded row that column is never
        a target; in a pack it would be predicted from the sequence before)."""
        from megatron_rlhf.data import collate_sft
        from megatron_rlhf.data.packing import pack_rows, pad_pack

        packs = []
        for chunk in chunks:
            batch = collate_sft(chunk, self.pad_id)
            real = batch["attention_mask"].bool()
            packed = pack_rows(batch["input_ids"], batch["attention_mask"])
            loss_mask = batch["loss_mask"][real][None]  # (1, T)
            loss_mask[0, packed.starts] = 0
            packs.append((packed, loss_mask))
        widths = self.pack_widths([packed.input_ids.shape[1] for packed, _ in packs])
        microbatches = []
        for (packed, loss_mask), width in zip(packs, widths):
            padded = pad_pack(packed, width, self.pad_id)
            extra = width - loss_mask.shape[1]
            microbatch = {
                "input_ids": padded.input_ids,
                "padding_mask": padded.segments,
                "loss_mask": torch.nn.functional.pad(loss_mask, (0, extra), value=0),
            }
            microbatches.append(to_device(microbatch))
        return microbatches


def evaluate(engine, eval_set, batches: SequenceBatches) -> dict:
    """Held-out NLL per response token (and its perplexity) over ``eval_set`` (all ranks)."""
    import torch.distributed as dist

    from megatron_rlhf.distributed.parallel import is_last_stage, model_groups, vocab_group

    groups = model_groups(engine.module)
    tp_group = vocab_group(groups)
    sums = []

    def loss_fn(output, microbatch):
        loss, metrics = sft_loss(output, microbatch, tp_group)
        sums.append((float(metrics["nll_sum"]), float(metrics["tokens"])))
        return loss, metrics

    for microbatches in batches.eval_microbatches(eval_set):
        engine.step(microbatches, loss_fn, forward_only=True)
    reports = is_last_stage(groups) and groups.tp.rank() == 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums if reports else [])
    nll = sum(s for part in gathered for s, _ in part)
    tokens = sum(t for part in gathered for _, t in part)
    loss = nll / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def _open_data(config: SFTConfig) -> loop.Data:
    """The training dataset, training sequences and held-out sequences (or None)."""
    from megatron_rlhf.data import SFTDataset

    dataset = SFTDataset(config.data.train)
    if config.data.eval is not None:
        return loop.Data(dataset, dataset, SFTDataset(config.data.eval))
    if config.data.eval_fraction == 0:
        return loop.Data(dataset, dataset, None)
    return loop.Data(
        dataset, *held_out_split(dataset, config.data.eval_fraction, config.train.seed)
    )


def _note_truncation(train_set, max_length: int) -> None:
    """Say how many training sequences lose tokens to ``max_length`` (and how many lose every
    response token, so they teach nothing)."""
    from megatron_rlhf.data import stream_lengths

    dataset = getattr(train_set, "dataset", train_set)
    indices = np.asarray(getattr(train_set, "indices", range(len(dataset))))
    lengths = stream_lengths(train_set, "tokens")
    if (lengths > max_length).any():
        masks = dataset.streams["loss_mask"]
        empty = sum(
            int(masks[int(i)][1:max_length].sum() == 0) for i in indices[lengths > max_length]
        )
        log(
            COMMAND,
            f"note: {(lengths > max_length).sum()} of {len(indices)} training sequences are "
            f"longer than {max_length} tokens and lose their tail ({empty} of them every "
            "response token); raise data.max_length to keep them whole",
        )
