"""The one training loop of the single-model commands (``train-sft``, ``train-reward``).

:func:`train` sets a run up (config checks, the ``parallel`` layout, data, the step count, the
memory check, the engine, fresh or resumed), then takes optimizer steps: each one's metrics
averaged over the reporting ranks, with throughput, through the non-finite guard
(training/guards.py) into the run log; the held-out evaluation every ``train.eval_interval``
steps and at the end; a checkpoint every ``train.save_interval`` steps and at the end; and, on
an exit signal all ranks agree on (training/signals.py), a checkpoint and a stop. The run
directory, resume, log, guard and save on a signal are training/run.py's :class:`Run`, shared
with ``train-ppo``.

What differs between the commands is a :class:`Task`'s: the config checks, the data and how
it is batched, the loss, the evaluation, and (``train-reward``'s DeepSpeed backend) the engine
and checkpoint format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rlhf.training import command
from megatron_rlhf.utils import InputError


@dataclass
class Data:
    """A run's examples, opened and checked by :meth:`Task.open_data`."""

    dataset: object
    """The training dataset as opened (its tokenizer and pad id)."""
    train_set: object
    """The training examples (``dataset`` less any held-out split)."""
    eval_set: object | None
    """The held-out examples (None: no evaluation)."""


@dataclass
class Batches:
    """How this rank cuts examples into microbatches: ``micro_batch_size`` examples each,
    ``num_microbatches`` per optimizer step, its share of the data-parallel stream. A task's
    batcher adds ``train_steps`` (collated microbatches per step) on :meth:`step_chunks`."""

    micro_batch_size: int
    num_microbatches: int
    dp_rank: int
    dp_size: int
    width_multiple: int
    """Microbatch widths are multiples of this (the TP size under sequence parallelism)."""
    pad_id: int
    max_tokens: int | None = field(default=None, kw_only=True)
    """Packing (``train.packing``): the token budget of a packed micro-batch; None: padded
    micro-batches of ``micro_batch_size`` examples."""
    pipelined: bool = field(default=False, kw_only=True)
    """pp > 1: every micro-batch of a step must have one width (one activation shape)."""

    @classmethod
    def of(cls, config, groups, num_microbatches: int, pad_id: int | None, **extra):
        """The batcher of ``config`` (``train`` and ``parallel`` sections) on the model's
        ``groups``; ``pad_id`` None pads with 0."""
        return cls(
            micro_batch_size=config.train.micro_batch_size,
            num_microbatches=num_microbatches,
            dp_rank=groups.dp.rank(),
            dp_size=groups.dp.size(),
            width_multiple=groups.tp.size() if config.parallel.sequence_parallel else 1,
            pad_id=pad_id if pad_id is not None else 0,
            pipelined=groups.pp.size() > 1,
            **extra,
        )

    def example_lengths(self, train_set, indices: list[int]) -> list[int]:
        """Tokens each example of ``train_set`` at ``indices`` takes in a pack (read from the
        index, not the data); a packing batcher implements it."""
        raise NotImplementedError

    def packed_step_chunks(self, train_set, seed: int, consumed: int):
        """Endless iterator of this rank's examples per optimizer step, one list per packed
        micro-batch: the step's global batch (the same examples as :meth:`step_chunks`'s,
        from global position ``consumed``) balanced by tokens over the data-parallel ranks,
        then packed first-fit into micro-batches of at most ``max_tokens`` tokens. The number
        of micro-batches varies by step and rank; losses are token (or pair) means over the
        global batch, so they do not depend on it."""
        from megatron_rlhf.data import ShardedSampler
        from megatron_rlhf.data.packing import balance_by_tokens, pack_first_fit

        stream = ShardedSampler(len(train_set), 0, 1, seed)
        per_step = self.micro_batch_size * self.num_microbatches * self.dp_size
        while True:
            indices = [stream.global_index(p) for p in range(consumed, consumed + per_step)]
            consumed += per_step
            lengths = self.example_lengths(train_set, indices)
            mine = balance_by_tokens(lengths, self.dp_size)[self.dp_rank]
            packs = pack_first_fit([lengths[i] for i in mine], self.max_tokens)
            yield [[train_set[indices[mine[j]]] for j in pack] for pack in packs]

    def pack_width(self, widths: list[int]) -> int:
        """The one width of a step's micro-batches, a multiple of ``width_multiple``."""
        return -(-max(widths) // self.width_multiple) * self.width_multiple

    def pack_widths(self, widths: list[int]) -> list[int]:
        """The widths of a step's packed micro-batches: one (:meth:`pack_width`) when pipelined
        (schedules send one activation shape), else each its own, rounded up to
        ``width_multiple`` (no padding computed)."""
        if self.pipelined:
            return [self.pack_width(widths)] * len(widths)
        return [self.pack_width([width]) for width in widths]

    def step_chunks(self, dataset, seed: int, consumed: int):
        """Endless iterator of this rank's examples, ``num_microbatches`` lists per optimizer
        step. They follow :class:`~megatron_rlhf.data.ShardedSampler`'s stream from global
        position ``consumed``, so a resumed run sees exactly what an uninterrupted one would."""
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
            yield [
                [dataset[next(positions)] for _ in range(self.micro_batch_size)]
                for _ in range(self.num_microbatches)
            ]

    def eval_chunks(self, dataset):
        """This rank's share of ``dataset``, ``micro_batch_size`` examples at a time (padded,
        packing or not: an evaluation's micro-batches need no equal token counts)."""
        mine = list(range(self.dp_rank, len(dataset), self.dp_size))
        for start in range(0, len(mine), self.micro_batch_size):
            yield [dataset[i] for i in mine[start : start + self.micro_batch_size]]


class Task:
    """What one command brings to :func:`train`. Subclasses set the class attributes and
    implement the methods that raise NotImplementedError; the others have the Megatron-Core
    defaults."""

    name: str
    """The command's name (messages, the run log)."""
    examples: str
    """What its examples are called, plural ("sequences", "pairs")."""
    rows_per_example: int
    """Sequences per example (2 for a preference pair), for the memory check."""
    head: str
    """The model's head: "lm" or "scalar"."""

    def __init__(self, config):
        self.config = config

    def config_problems(self) -> list[str]:
        """What is wrong with the config, before anything is opened or launched."""
        raise NotImplementedError

    def open_data(self, arch) -> Data:
        """The training and held-out examples, checked against the model ``arch``."""
        raise NotImplementedError

    def batches(
        self, groups, data: Data, num_microbatches: int, max_length: int, max_tokens: int | None
    ) -> Batches:
        """This rank's batcher, whose ``train_steps(train_set, seed, consumed)`` yields each
        step's microbatches; ``groups``: the model's process groups; ``max_tokens``: the
        packing budget (None: padded microbatches)."""
        raise NotImplementedError

    def packs(self) -> bool:
        """Whether training micro-batches are packed (``train.packing``)."""
        return self.config.train.packing

    def token_budget(self, max_length: int) -> int | None:
        """Tokens per packed micro-batch (None: not packing): ``train.max_tokens_per_micro_batch``,
        else ``micro_batch_size`` examples of the longest length allowed."""
        if not self.packs():
            return None
        return self.config.train.token_budget(self.rows_per_example * max_length)

    def loss_fn(self, groups):
        """``loss_fn(output, microbatch) -> (loss, metrics)`` for ``engine.step``."""
        raise NotImplementedError

    def evaluate(self, engine, eval_set, batches) -> dict:
        """The held-out evaluation (collective over every rank)."""
        raise NotImplementedError

    def sharded_optimizer(self) -> bool:
        """Whether the optimizer state is sharded over data-parallel ranks (memory check)."""
        return torch.cuda.is_available()

    def build_train_engine(self, arch, total_steps, num_microbatches, run):
        """(engine, consumed samples): fresh, or resumed from ``run.resume_from`` (training/
        run.py; ``run.restore`` or ``run.resumed`` sets the step and the guard's count)."""
        return command.build_train_engine(self.config, arch, total_steps, run, head=self.head)

    def step_metrics(self, metrics: dict, batches) -> dict:
        """A step's metrics as logged (given: averaged over the reporting ranks)."""
        return metrics

    def progress(self, metrics: dict) -> dict:
        """What the progress bar shows after a step."""
        return {"loss": metrics["loss"]}

    def eval_scalars(self, result: dict) -> dict:
        """The scalars of an :meth:`evaluate` result for the run log."""
        return result

    def metadata(self) -> dict:
        """What every checkpoint's ``megatron_rlhf.json`` holds besides the step and the last
        evaluation."""
        from megatron_rlhf.config import to_dict

        return {"config": to_dict(self.config)}

    def save(self, engine, output_dir: Path, metadata: dict, trainer_state: dict, tokenizer):
        """Write ``output_dir/step_N`` (collective); return its path."""
        from megatron_rlhf.checkpoint.dist import model_metadata
        from megatron_rlhf.training.checkpointing import save_training_checkpoint

        return save_training_checkpoint(
            output_dir,
            metadata["step"],
            {"model": engine},
            model_metadata(engine.module, **metadata),
            trainer_state,
            tokenizer_dir=tokenizer,
        )


def train(
    task: Task,
    overwrite: bool = False,
    force_config_change: bool = False,
    skip_memory_check: bool = False,
) -> dict:
    """Run (or resume) ``task``'s run; returns ``{"step", "history" (per-step metrics), "eval"
    (the last evaluation or None), "checkpoint", "seconds", "stopped_by" (the exit signal's
    name or None)}``. ``overwrite`` / ``force_config_change``: see training/run_dir.py;
    ``skip_memory_check``: see training/memory_check.py. Collective over every rank."""
    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.distributed.parallel import model_groups
    from megatron_rlhf.training.memory_check import check_trainer
    from megatron_rlhf.training.run import Run
    from megatron_rlhf.training.signals import ExitSignals
    from megatron_rlhf.training.throughput import train_step_throughput

    start_time, config = time.time(), task.config
    problems = task.config_problems()
    if problems:
        raise InputError(f"invalid {task.name} config: " + "; ".join(problems))
    arch = checkpoint_architecture(config.model.load)
    parallel = config.parallel
    layout = initialize(
        parallel.tp,
        parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        arch=arch,
        seed=config.train.seed,
    )
    num_microbatches = microbatches_per_step(config.train, layout.dp)
    data = task.open_data(arch)
    total_steps = steps_to_run(config, len(data.train_set), task.examples)
    max_length = min(config.data.max_length or arch.max_sequence_length, arch.max_sequence_length)
    max_tokens = task.token_budget(max_length)
    check_trainer(
        arch, config, layout, max_length, task.rows_per_example, task.head,
        command.element_bytes(command.use_bf16(config.train.bf16)), task.sharded_optimizer(),
        skip_memory_check,
        max_tokens=max_tokens,
    )  # fmt: skip
    run = Run(task.name, config, overwrite=overwrite, force_config_change=force_config_change)
    engine, consumed = task.build_train_engine(arch, total_steps, num_microbatches, run)
    output_dir, step = run.output_dir, run.step

    groups = model_groups(engine.module)
    batches = task.batches(groups, data, num_microbatches, max_length, max_tokens)
    loss_fn = task.loss_fn(groups)
    steps = batches.train_steps(data.train_set, config.train.seed, consumed)
    metadata = task.metadata()
    tokenizer_source = command.tokenizer_dir(data.dataset, config.model.load)
    logger = run.start(total_steps)
    history, last_eval = [], None

    def save(step: int) -> Path:
        return task.save(
            engine,
            output_dir,
            {**metadata, "step": step, "eval": last_eval},
            {"step": step, "consumed_samples": consumed, "nonfinite": run.guard.state_dict()},
            tokenizer_source,
        )

    exit_signals = ExitSignals(config.train.exit_signals, task.name)
    try:
        while step < total_steps:
            microbatches, started = next(steps), time.time()
            metrics = command.reduce_metrics(engine.step(microbatches, loss_fn))
            metrics |= train_step_throughput(
                engine.module.arch, microbatches, time.time() - started, groups
            )
            metrics = task.step_metrics(metrics, batches)
            step += 1
            consumed += config.train.global_batch_size
            run.check(step, metrics)
            history.append(metrics)
            logger.advance(**task.progress(metrics))
            run.write(step, metrics, "train")
            if data.eval_set is not None and run.due("eval", step):
                last_eval = task.evaluate(engine, data.eval_set, batches)
                logger.write(step, task.eval_scalars(last_eval), "eval")
            if run.end_step(step, save, exit_signals) is not None:
                break
    finally:
        exit_signals.restore()
        run.close()
    return {
        "step": step,
        "history": history,
        "eval": last_eval,
        "checkpoint": str(run.checkpoint),
        "seconds": time.time() - start_time,
        "stopped_by": run.stopped_by.name if run.stopped_by is not None else None,
    }


def microbatches_per_step(train, dp_size: int) -> int:
    """Microbatches per rank per optimizer step (gradient accumulation); refuses a global batch
    that does not split into whole microbatches over the data-parallel ranks."""
    if train.global_batch_size % (train.micro_batch_size * dp_size):
        raise InputError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={train.micro_batch_size} × data-parallel size "
            f"{dp_size} (= world size / (tp·pp)); change one of them"
        )
    return train.global_batch_size // (train.micro_batch_size * dp_size)


def steps_to_run(config, num_examples: int, examples: str) -> int:
    """``train.steps``, else the whole global batches in ``train.epochs`` passes (at least 1)."""
    train = config.train
    total_steps = train.steps or int(train.epochs * num_examples // train.global_batch_size)
    if total_steps < 1:
        raise InputError(
            f"{config.data.train}: {num_examples} training {examples} make no whole global "
            f"batch of train.global_batch_size={train.global_batch_size} in "
            f"train.epochs={train.epochs}; lower the batch size or set train.steps"
        )
    return total_steps
