"""What the single-model training commands (``train-sft``, ``train-reward``) share besides
their loop (training/loop.py).

The command-line wrapper, building (or resuming) the engine, the held-out split, the bf16
choice, averaging step metrics over the reporting ranks, and the run log: a tqdm bar,
TensorBoard scalars and ``metrics.jsonl`` (one JSON line per logged step; a resumed run first
drops the lines after its checkpoint, so the file reads like one uninterrupted run). Their
config sections and checks are in training/config.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.training.config import RESUMABLE_CHANGES
from megatron_rlhf.utils import InputError, atomic_output, is_rank0


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
        attention_backend=config.model.attention_backend,
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
