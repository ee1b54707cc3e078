"""What the single-model training commands (``train-sft``, ``train-reward``) share besides
their loop (training/loop.py).

The ``model``, ``parallel``, ``data`` and ``train`` sections of their configs and their
checks, the command-line wrapper, building (or resuming) the engine, the held-out split, the
bf16 choice, averaging step metrics over the reporting ranks, and the run log: a tqdm bar,
TensorBoard scalars and ``metrics.jsonl`` (one JSON line per logged step; a resumed run first
drops the lines after its checkpoint, so the file reads like one uninterrupted run).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch

from megatron_rlhf.utils import InputError, atomic_output, is_rank0


@dataclass(kw_only=True)
class ModelConfig:
    """Where the model comes from and how it is built (its layout: the ``parallel`` section)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "tp": "parallel.tp",
        "pp": "parallel.pp",
        "sequence_parallel": "parallel.sequence_parallel",
    }
    """Layout keys this section once had, and where they are now (train-ppo's dialect)."""

    load: str
    """Hugging Face BLOOM directory or megatron-rlhf checkpoint with the same head."""
    bf16: bool | Literal["auto"] = "auto"
    """bf16 parameters; "auto" = bf16 on GPU, fp32 on CPU (bf16 needs a GPU)."""
    recompute_activations: bool = False
    """Recompute each layer's activations in the backward pass (saves memory)."""
    seed: int = 1234
    """Model-parallel RNG seed."""


@dataclass(kw_only=True)
class LayoutConfig:
    """The ``parallel`` section: how the one trained model is split over the launch's ranks
    (``train-ppo``'s ``parallel.tp/pp/sequence_parallel``, without per-role layouts)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Sequence parallelism over the TP group (tp > 1)."""


@dataclass(kw_only=True)
class DataConfig:
    """Training and held-out examples: ``tools/preprocess_data.py`` output prefixes (each
    command's subclass adds ``max_length``)."""

    train: str
    """Training examples."""
    eval: str | None = None
    """Held-out examples; None holds out ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.0
    """Share of ``train`` held out for evaluation when ``eval`` is None (0: no evaluation)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Batching, evaluation, checkpointing and logging. An example is a preference pair for
    ``train-reward`` (two sequences) and a sequence for ``train-sft``."""

    output_dir: str
    """Checkpoints, TensorBoard logs, metrics.jsonl and the resolved config go here."""
    global_batch_size: int = 64
    """Examples per optimizer step."""
    micro_batch_size: int = 1
    """Examples per forward pass; global = micro × microbatches × dp."""
    packing: bool = True
    """Pack the real tokens of several examples back to back into each micro-batch (no
    padding computed; attention stays within each example, data/packing.py) instead of padding
    ``micro_batch_size`` examples to the longest. The global batch is the same examples either
    way, balanced by tokens over the data-parallel ranks, and the loss the same token (pair)
    mean, so losses, gradients and weights equal the padded path's up to rounding. The number
    of micro-batches then varies by step. ``train-reward``'s DeepSpeed backend always pads."""
    max_tokens_per_micro_batch: int | None = None
    """Packing's token budget per micro-batch (None: ``micro_batch_size`` × the longest an
    example may be, so a pack is never longer than the padded micro-batch's worst case). The
    PyTorch attention path runs each packed sequence's attention alone; with TE layers or
    sequence parallelism a pack falls back to one T×T mask, so there keep it near
    ``data.max_length`` (one BLOOM context) with ``micro_batch_size: 1``."""
    epochs: float = 1.0
    """Passes over the training examples; ignored when ``steps`` is set."""
    steps: int | None = None
    """Optimizer steps (None: from ``epochs``)."""
    eval_interval: int = 100
    """Evaluate every this many steps and at the end (0: only at the end)."""
    save_interval: int = 500
    """Checkpoint every this many steps and at the end (0: only at the end)."""
    log_interval: int = 10
    """Print, write TensorBoard scalars and metrics.jsonl every this many steps."""
    seed: int = 1234
    """Data order and held-out split."""
    resume: bool = True
    """Continue from ``output_dir``'s latest checkpoint when there is one."""
    max_nonfinite_skips: int = 0
    """Steps with a non-finite loss or gradient norm skipped (no update) before the run stops
    with an error; 0: the first one stops it (training/guards.py)."""
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make the run finish its step, save a checkpoint and exit with code 75
    (training/signals.py); ask Slurm for one ahead of the time limit (``--signal``)."""


RESUMABLE_CHANGES = tuple(
    f"train.{key}"
    for key in (
        "steps", "epochs", "eval_interval", "save_interval", "log_interval", "resume",
        "max_nonfinite_skips", "output_dir", "exit_signals",
    )
)  # fmt: skip
"""Config keys that may differ when a run resumes (training/run_dir.py)."""


def command_main(command: str, config_cls, run, argv: list[str], summary) -> int:
    """``--config FILE [key=value ...]`` → ``run(config)`` → ``summary(config, result)`` (the
    fields of the one-line summary). Bad input exits 2 with one line (``utils.run_command``);
    the process group is torn down however it ends."""
    from megatron_rlhf.config import config_parser, describe_config, load_config
    from megatron_rlhf.training.signals import EXIT_SAVED_ON_SIGNAL
    from megatron_rlhf.utils import print_summary, run_command

    parser = config_parser(
        f"python -m megatron_rlhf {command}",
        sys.modules[run.__module__].__doc__.split("\n\n")[0],
        "examples/",
    )
    args = parser.parse_args(argv)
    if args.print_config:
        print(describe_config(config_cls))
        return 0

    def body() -> int:
        config = load_config(config_cls, args.config, args.overrides)
        result = run(
            config,
            overwrite=args.overwrite,
            force_config_change=args.force_config_change,
            skip_memory_check=args.skip_memory_check,
        )
        stopped_by = result.get("stopped_by")
        print_summary(
            command, **summary(config, result), **({"stopped_by": stopped_by} if stopped_by else {})
        )
        return EXIT_SAVED_ON_SIGNAL if stopped_by else 0

    return run_command(command, body, distributed=True)


def config_problems(train: TrainConfig, data) -> list[str]:
    """What is wrong with the ``train`` section and the held-out choice of ``data``."""
    problems = [
        f"train.{key}={getattr(train, key)} must be >= {least}"
        for key, least in (
            ("global_batch_size", 1),
            ("micro_batch_size", 1),
            ("log_interval", 1),
            ("eval_interval", 0),
            ("save_interval", 0),
            ("steps", 1),
            ("max_tokens_per_micro_batch", 1),
        )
        if getattr(train, key) is not None and getattr(train, key) < least
    ]
    if not 0.0 <= data.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction={data.eval_fraction} must be in [0, 1)")
    if data.eval is not None and data.eval_fraction > 0:
        problems.append("give data.eval or data.eval_fraction, not both")
    return problems


def held_out_split(dataset, fraction: float, seed: int):
    """(training subset, held-out subset): ``fraction`` of ``dataset`` held out, seeded."""
    order = np.random.default_rng([seed, 1]).permutation(len(dataset))
    held_out = max(1, int(round(fraction * len(dataset))))
    eval_indices, train_indices = np.sort(order[:held_out]), np.sort(order[held_out:])
    if len(train_indices) == 0:
        raise InputError(f"data.eval_fraction={fraction} leaves no training examples")
    subset = torch.utils.data.Subset
    return subset(dataset, train_indices.tolist()), subset(dataset, eval_indices.tolist())


def build_engine(
    command: str,
    config,
    arch,
    total_steps: int,
    check_saved=None,
    guard=None,
    overwrite: bool = False,
    force_config_change: bool = False,
    **model_kwargs,
):
    """(engine, step, consumed samples, checkpoint resumed from or None): the model from
    ``config.model.load``, or everything from the checkpoint ``training/run_dir.open_run``
    picks in ``config.train.output_dir`` (``check_saved(metadata, directory)`` may refuse it
    first; ``guard``, a NonFiniteGuard, gets its saved count). ``model_kwargs``: the head."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.checkpointing import load_training_checkpoint

    resume_from = resume_point(config, overwrite, force_config_change)
    model_kwargs.update(
        params_dtype=torch.bfloat16 if use_bf16(config.model.bf16) else torch.float32,
        sequence_parallel=config.parallel.sequence_parallel,
        recompute_activations=config.model.recompute_activations,
    )
    if resume_from is None:
        model = load_bloom(config.model.load, **model_kwargs)
        return TrainEngine(model, config.optim, total_steps), 0, 0, None
    if check_saved is not None:
        check_saved(read_metadata(resume_from), resume_from)
    model = BloomModel(arch, init_weights=False, **model_kwargs)  # weights from the checkpoint
    engine = TrainEngine(model, config.optim, total_steps)
    state = load_training_checkpoint(resume_from, {"model": engine})
    if guard is not None:
        guard.load_state_dict(state.get("nonfinite", {}))
    log(command, f"resumed from {resume_from} at step {state.get('step', 0)}")
    return engine, state.get("step", 0), state.get("consumed_samples", 0), resume_from


def say_if_finished(command: str, checkpoint, step: int, total_steps: int) -> None:
    """A resumed run that has nothing left to do says so (its summary shows no loss)."""
    if checkpoint is not None and step >= total_steps:
        log(
            command,
            f"nothing left to do: {checkpoint} is at step {step} of {total_steps}; raise "
            "train.steps (or train.epochs) to train further",
        )


def resume_point(config, overwrite: bool = False, force_config_change: bool = False):
    """The checkpoint ``training/run_dir.open_run`` picks in ``config.train.output_dir`` to
    resume from, or None for a fresh run."""
    from megatron_rlhf.config import to_dict
    from megatron_rlhf.training.run_dir import open_run

    return open_run(
        config.train.output_dir,
        to_dict(config),
        resume=config.train.resume,
        overwrite=overwrite,
        force_config_change=force_config_change,
        allowed=RESUMABLE_CHANGES,
    )


def use_bf16(setting, key: str = "model.bf16") -> bool:
    """A ``bf16`` setting (true, false or "auto") resolved for this machine."""
    if setting == "auto":
        return torch.cuda.is_available()
    if setting and not torch.cuda.is_available():
        raise InputError(f"{key}=true needs a GPU; use {key}=auto (fp32 on CPU)")
    return bool(setting)


def reduce_metrics(metrics: dict) -> dict:
    """Average the step metrics of the last-stage ranks of every data-parallel replica."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    reporting = [m for m in gathered if "loss" in m]
    return {key: float(np.mean([m[key] for m in reporting])) for key in reporting[0]}


def every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def log(command: str, message: str) -> None:
    """One line on rank 0's stderr, prefixed with the command."""
    if is_rank0():
        print(f"[{command}] {message}", file=sys.stderr, flush=True)


class RunLog:
    """Rank 0's progress bar, TensorBoard scalars and ``metrics.jsonl`` (other ranks: nothing)."""

    def __init__(self, command: str, output_dir: Path, step: int, total_steps: int):
        self.enabled = is_rank0()
        self.metrics_file = output_dir / "metrics.jsonl"
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter
            from tqdm import tqdm

            output_dir.mkdir(parents=True, exist_ok=True)
            self._drop_lines_after(step)
            self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=step + 1)
            self.bar = tqdm(total=total_steps, initial=step, desc=command)

    def advance(self, **postfix: float) -> None:
        """One optimizer step done: move the bar, show ``postfix``."""
        if self.enabled:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()})

    def write(self, prefix: str, step: int, scalars: dict) -> None:
        """``prefix/key`` scalars to TensorBoard, a ``metrics.jsonl`` line and a log line."""
        if not self.enabled:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        record = {"step": step, **{f"{prefix}/{k}": v for k, v in scalars.items()}}
        with open(self.metrics_file, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        self.bar.write(
            f"{prefix} @ step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in scalars.items())
        )

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.writer.close()

    def _drop_lines_after(self, step: int) -> None:
        if not self.metrics_file.exists():
            return
        lines = self.metrics_file.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        with atomic_output(self.metrics_file) as tmp:
            Path(tmp).write_text("".join(kept), encoding="utf-8")


def check_data_fits_model(dataset, key: str, model_dir: str, model_vocab: int) -> None:
    """The dataset's tokenizer is the model's: ids inside its vocabulary, same fingerprint."""
    from megatron_rlhf.checkpoint.dist import tokenizer_of
    from megatron_rlhf.data.tokenizer import check_same_tokenizer

    if dataset.vocab_size > model_vocab:
        raise InputError(
            f"{key}: {dataset.prefix} was tokenized with a {dataset.vocab_size}-token vocabulary, "
            f"larger than the model's {model_vocab} ({model_dir}); preprocess it with the "
            "model's tokenizer"
        )
    check_same_tokenizer(
        dataset.sidecar.get("tokenizer"), f"{key} ({dataset.prefix})",
        tokenizer_of(model_dir), f"the model {model_dir}",
    )  # fmt: skip


def tokenizer_dir(dataset, load: str) -> str | None:
    """The tokenizer to save beside checkpoints: the data's, else the loaded model's, else None."""
    path = dataset.sidecar.get("tokenizer", {}).get("path")
    if path and Path(path).is_dir():
        return path
    return load if (Path(load) / "tokenizer.json").exists() else None


def to_device(rows: dict) -> dict:
    """A collated batch on this rank's GPU (unchanged on CPU)."""
    if not torch.cuda.is_available():
        return rows
    return {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in rows.items()}
