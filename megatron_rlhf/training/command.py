"""What the single-model training commands (``train-sft``, ``train-reward``) share besides
their loop (training/loop.py).

The command-line wrapper, building (or resuming) the engine, the held-out split, the bf16
choice and averaging step metrics over the reporting ranks. The run's lifecycle (run directory,
resume, log, save on a signal, summary) is training/run.py's, shared with ``train-ppo``; the
config sections and checks are in training/config.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.utils import InputError


def command_main(command: str, config_cls, run, argv: list[str], summary) -> int:
    """``--config FILE [key=value ...]`` → ``run(config)`` → ``summary(config, result)`` (the
    fields of the one-line summary). Bad input exits 2 with one line (``utils.run_command``);
    the process group is torn down however it ends."""
    from megatron_rlhf.config import config_parser, describe_config, load_config
    from megatron_rlhf.training.run import finish
    from megatron_rlhf.utils import run_command

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
        return finish(command, summary(config, result), result.get("stopped_by"))

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


def build_train_engine(config, arch, total_steps: int, run, check_saved=None, **model_kwargs):
    """(engine, consumed samples): the model from ``config.model.load``, or everything from the
    checkpoint ``run`` (training/run.py) resumes from (``check_saved(metadata, directory)``
    may refuse it first). ``model_kwargs``: the head."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.precision import mark_cpu_bf16, params_dtype
    from megatron_rlhf.training import TrainEngine

    bf16 = use_bf16(config.train.bf16)
    model_kwargs.update(
        params_dtype=params_dtype(bf16),  # on a CPU fp32 master weights, bf16 products
        sequence_parallel=config.parallel.sequence_parallel,
        recompute_activations=config.train.recompute_activations,
        attention_backend=config.train.attention_backend,
    )
    if run.resume_from is None:
        model = mark_cpu_bf16(load_bloom(config.model.load, **model_kwargs), bf16)
        return TrainEngine(model, config.optim, total_steps), 0
    if check_saved is not None:
        check_saved(read_metadata(run.resume_from), run.resume_from)
    model = BloomModel(arch, init_weights=False, **model_kwargs)  # weights from the checkpoint
    mark_cpu_bf16(model, bf16)
    engine = TrainEngine(model, config.optim, total_steps)
    state = run.restore({"model": engine})
    return engine, state.get("consumed_samples", 0)


def use_bf16(setting) -> bool:
    """A ``bf16`` setting (true, false or "auto") resolved for this machine: "auto" is bf16 on
    a GPU and fp32 on a CPU; true on a CPU is bf16 products with fp32 master weights
    (models/precision.py)."""
    if setting == "auto":
        return torch.cuda.is_available()
    return bool(setting)


def element_bytes(bf16: bool) -> int:
    """Bytes of a trained model's weight and activation element, for the memory check: 2 in
    bf16 on a GPU; 4 on a CPU, bf16 or not (fp32 master weights; the bf16 copies autocast makes
    are not modelled)."""
    return 2 if bf16 and torch.cuda.is_available() else 4


def reduce_metrics(metrics: dict) -> dict:
    """Average the step metrics of the last-stage ranks of every data-parallel replica."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    reporting = [m for m in gathered if "loss" in m]
    return {key: float(np.mean([m[key] for m in reporting])) for key in reporting[0]}


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
