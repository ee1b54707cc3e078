"""``torchrun ... -m megatron_rlhf train-sft --config FILE [key=value ...]``: supervised fine-tuning.

    torchrun --nproc-per-node 8 -m megatron_rlhf train-sft \\
        --config examples/sft/tiny_cpu.yaml model.tp=2 model.pp=2 optim.lr=1e-5

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
evaluation and the final checkpoint) or ``main(argv)`` (the command).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.training.command import (
    ModelConfig,
    RunLog,
    TrainConfig,
    build_engine,
    check_data_fits_model,
    command_main,
    config_problems,
    every,
    held_out_split,
    log,
    reduce_metrics,
    say_if_finished,
    to_device,
    tokenizer_dir,
    use_bf16,
)
from megatron_rlhf.training.engine import OptimConfig, optim_problems
from megatron_rlhf.training.throughput import train_step_throughput
from megatron_rlhf.utils import InputError, is_rank0, write_json

COMMAND = "train-sft"


@dataclass(kw_only=True)
class DataConfig:
    """SFT data: prefixes written by ``tools/preprocess_data.py --kind sft``."""

    train: str
    """Training sequences (prompt + response, loss on the response)."""
    eval: str | None = None
    """Held-out sequences; None holds out ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.0
    """Share of ``train`` held out for evaluation when ``eval`` is None (0: no evaluation)."""
    max_length: int | None = None
    """Keep the first this many tokens of a sequence (None: the model's max_sequence_length)."""


@dataclass(kw_only=True)
class SFTConfig:
    """``train-sft``: one supervised fine-tuning run."""

    model: ModelConfig
    """The initial policy (HF BLOOM or LM checkpoint) and its TP/PP layout."""
    data: DataConfig
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


def run(
    config: SFTConfig,
    overwrite: bool = False,
    force_config_change: bool = False,
    skip_memory_check: bool = False,
) -> dict:
    """Run (or resume) one SFT run; returns ``{"step", "history" (per-step metrics), "eval"
    (the last evaluation or None), "checkpoint", "seconds"}``. ``overwrite`` /
    ``force_config_change``: see training/run_dir.py; ``skip_memory_check``: see
    training/memory_check.py. Collective over every rank."""
    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.checkpoint.dist import model_metadata
    from megatron_rlhf.config import to_dict
    from megatron_rlhf.distributed import ParallelConfig, initialize
    from megatron_rlhf.training.checkpointing import save_training_checkpoint
    from megatron_rlhf.training.guards import NonFiniteGuard
    from megatron_rlhf.training.memory_check import check_trainer
    from megatron_rlhf.training.signals import ExitSignals, stopped_message

    start_time = time.time()
    _check_config(config)
    arch = checkpoint_architecture(config.model.load)
    dp_size = initialize(
        ParallelConfig(
            tp=config.model.tp,
            pp=config.model.pp,
            sequence_parallel=config.model.sequence_parallel,
            seed=config.model.seed,
        ),
        num_heads=arch.num_heads,
        num_layers=arch.num_layers,
    )
    dataset, train_set, eval_set = _open_data(config)
    check_data_fits_model(dataset, "data.train", config.model.load, arch.vocab_size)
    max_length = min(config.data.max_length or arch.max_sequence_length, arch.max_sequence_length)
    batches = SequenceBatches.for_layout(config, dp_size, dataset, max_length)
    total_steps = config.train.steps or int(
        config.train.epochs * len(train_set) // config.train.global_batch_size
    )
    if total_steps < 1:
        raise InputError(
            f"{config.data.train}: {len(train_set)} training sequences make no whole global "
            f"batch of train.global_batch_size={config.train.global_batch_size} in "
            f"train.epochs={config.train.epochs}; lower the batch size or set train.steps"
        )
    output_dir = Path(config.train.output_dir)
    check_trainer(
        arch, config, dp_size, max_length, 1, "lm", use_bf16(config.model.bf16),
        torch.cuda.is_available(), skip_memory_check,
    )  # fmt: skip
    guard = NonFiniteGuard(config.train.max_nonfinite_skips)
    engine, step, consumed, checkpoint = build_engine(
        COMMAND, config, arch, total_steps, guard=guard, overwrite=overwrite,
        force_config_change=force_config_change, head="lm",
    )  # fmt: skip
    say_if_finished(COMMAND, checkpoint, step, total_steps)
    if is_rank0():
        write_json(output_dir / "config.json", to_dict(config))
    _note_truncation(train_set, max_length)

    steps = batches.train_steps(train_set, config.train.seed, consumed)
    metadata = {"config": to_dict(config)}
    tokenizer_source = tokenizer_dir(dataset, config.model.load)
    logger = RunLog(COMMAND, output_dir, step, total_steps)
    history, last_eval, saved_step, stopped_by = [], None, step, None

    def save() -> Path:
        meta = model_metadata(engine.module, **metadata, step=step, eval=last_eval)
        return save_training_checkpoint(
            output_dir,
            step,
            {"model": engine},
            meta,
            {"step": step, "consumed_samples": consumed, "nonfinite": guard.state_dict()},
            tokenizer_dir=tokenizer_source,
        )

    exit_signals = ExitSignals(config.train.exit_signals, COMMAND)
    try:
        while step < total_steps:
            microbatches, started = next(steps), time.time()
            metrics = reduce_metrics(engine.step(microbatches, sft_loss))
            metrics |= train_step_throughput(
                engine.module.arch, microbatches, time.time() - started
            )
            del metrics["nll_sum"], metrics["tokens"]  # per-microbatch; the loss says it all
            metrics["response_tokens"] = batches.last_step_tokens
            step += 1
            consumed += config.train.global_batch_size
            guard.check(step, metrics)
            history.append(metrics)
            logger.advance(loss=metrics["loss"])
            if every(step, config.train.log_interval):
                logger.write("train", step, metrics)
            last = step == total_steps
            if eval_set is not None and (last or every(step, config.train.eval_interval)):
                last_eval = evaluate(engine, eval_set, batches)
                logger.write("eval", step, last_eval)
            if last or every(step, config.train.save_interval):
                checkpoint, saved_step = save(), step
            stopped_by = exit_signals.agreed()
            if stopped_by is not None:
                if saved_step != step:
                    checkpoint, saved_step = save(), step
                stopped_message(COMMAND, stopped_by, step, checkpoint)
                break
    finally:
        exit_signals.restore()
        logger.close()
    return {
        "step": step,
        "history": history,
        "eval": last_eval,
        "checkpoint": str(checkpoint),
        "seconds": time.time() - start_time,
        "stopped_by": stopped_by.name if stopped_by is not None else None,
    }


def sft_loss(logits: torch.Tensor, microbatch: dict):
    """NLL of ``input_ids[:, 1:]`` over ``loss_mask[:, 1:]`` from the logits (B, S, V/tp),
    summed and multiplied by ``microbatch["nll_scale"]`` (see :class:`SequenceBatches`)."""
    from megatron.core import parallel_state

    from megatron_rlhf.kernels import token_logprobs

    tp_group = None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    logprobs = token_logprobs(logits[:, :-1], microbatch["input_ids"][:, 1:], 1.0, tp_group)
    mask = microbatch["loss_mask"][:, 1:].to(logprobs.dtype)  # (B, S-1)
    nll_sum = -(logprobs * mask).sum()
    scale = microbatch["nll_scale"].to(nll_sum.dtype)
    return nll_sum * scale, {"nll_sum": nll_sum.detach(), "tokens": mask.sum()}


@dataclass
class SequenceBatches:
    """How this rank turns SFT sequences into microbatches.

    The engine averages the microbatch losses over microbatches and DDP averages gradients over
    data-parallel ranks; ``nll_scale = microbatches · dp / (response tokens of the global
    batch)`` turns that into the NLL summed over the global batch's response tokens divided by
    their count, whatever the layout.
    """

    micro_batch_size: int
    num_microbatches: int
    dp_rank: int
    dp_size: int
    width_multiple: int
    max_length: int
    pad_id: int
    last_step_tokens: int = 0
    """Response tokens of the global batch last yielded by :meth:`train_steps`."""

    @classmethod
    def for_layout(cls, config: SFTConfig, dp_size: int, dataset, max_length: int):
        from megatron.core import parallel_state

        train = config.train
        if train.global_batch_size % (train.micro_batch_size * dp_size):
            raise InputError(
                f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={train.micro_batch_size} × data-parallel size "
                f"{dp_size} (= world size / (tp·pp)); change one of them"
            )
        return cls(
            micro_batch_size=train.micro_batch_size,
            num_microbatches=train.global_batch_size // (train.micro_batch_size * dp_size),
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=dp_size,
            width_multiple=config.model.tp if config.model.sequence_parallel else 1,
            max_length=max_length,
            pad_id=dataset.pad_id if dataset.pad_id is not None else 0,
        )

    def train_steps(self, dataset, seed: int, consumed: int):
        """Endless iterator of this rank's microbatches, one list per optimizer step, from
        global stream position ``consumed`` (a resumed run sees what an uninterrupted one would)."""
        from megatron_rlhf.data import ShardedSampler

        positions = iter(
            ShardedSampler(
                len(dataset),
                self.dp_rank,
                self.dp_size,
                seed,
                consumed_samples=consumed,
                micro_batch_size=self.micro_batch_size,
            )
        )
        while True:
            chunks = [
                [dataset[next(positions)] for _ in range(self.micro_batch_size)]
                for _ in range(self.num_microbatches)
            ]
            microbatches = self.collate(chunks)
            tokens = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in microbatches)
            total = _sum_over_dp(tokens)
            scale = self.num_microbatches * self.dp_size / max(total, 1)
            for mb in microbatches:
                mb["nll_scale"] = torch.tensor(scale, dtype=torch.float32)
            self.last_step_tokens = total
            yield microbatches

    def eval_microbatches(self, dataset):
        """This rank's share of ``dataset``, one microbatch (a list of one) at a time."""
        mine = list(range(self.dp_rank, len(dataset), self.dp_size))
        for start in range(0, len(mine), self.micro_batch_size):
            chunk = [dataset[i] for i in mine[start : start + self.micro_batch_size]]
            microbatches = self.collate([chunk])
            microbatches[0]["nll_scale"] = torch.tensor(0.0)
            yield microbatches

    def collate(self, chunks: list[list[dict]]) -> list[dict]:
        """Truncated, right-padded microbatches, all of the same width (pipeline schedules
        send one activation shape)."""
        from megatron_rlhf.data import collate_sft

        for chunk in chunks:
            for sample in chunk:
                sample["input_ids"] = sample["input_ids"][: self.max_length]
                sample["loss_mask"] = sample["loss_mask"][: self.max_length]
        longest = max(len(sample["input_ids"]) for chunk in chunks for sample in chunk)
        width = -(-longest // self.width_multiple) * self.width_multiple
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


def evaluate(engine, eval_set, batches: SequenceBatches) -> dict:
    """Held-out NLL per response token (and its perplexity) over ``eval_set`` (all ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    sums = []

    def loss_fn(output, microbatch):
        loss, metrics = sft_loss(output, microbatch)
        sums.append((float(metrics["nll_sum"]), float(metrics["tokens"])))
        return loss, metrics

    for microbatches in batches.eval_microbatches(eval_set):
        engine.step(microbatches, loss_fn, forward_only=True)
    reports = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums if reports else [])
    nll = sum(s for part in gathered for s, _ in part)
    tokens = sum(t for part in gathered for _, t in part)
    loss = nll / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def _sum_over_dp(count: int) -> int:
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return count
    total = torch.tensor([count], dtype=torch.int64)
    if torch.cuda.is_available():
        total = total.cuda()
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return int(total.item())


def _check_config(config: SFTConfig) -> None:
    problems = config_problems(config.train, config.data)
    if config.data.max_length is not None and config.data.max_length < 2:
        problems.append(f"data.max_length={config.data.max_length} must be >= 2")
    problems += optim_problems(config.optim, "optim")
    if problems:
        raise InputError(f"invalid {COMMAND} config: " + "; ".join(problems))


def _open_data(config: SFTConfig):
    """(training dataset, training sequences, held-out sequences or None)."""
    from megatron_rlhf.data import SFTDataset

    dataset = SFTDataset(config.data.train)
    if config.data.eval is not None:
        return dataset, dataset, SFTDataset(config.data.eval)
    if config.data.eval_fraction == 0:
        return dataset, dataset, None
    return dataset, *held_out_split(dataset, config.data.eval_fraction, config.train.seed)


def _note_truncation(train_set, max_length: int) -> None:
    """Say how many training sequences lose tokens to ``max_length`` (and how many lose every
    response token, so they teach nothing)."""
    dataset = getattr(train_set, "dataset", train_set)
    indices = np.asarray(getattr(train_set, "indices", range(len(dataset))))
    lengths = dataset.streams["tokens"].sequence_lengths.astype(np.int64)[indices]
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
