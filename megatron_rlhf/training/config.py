"""The configuration schemas of training: the optimizer (``OptimConfig``, every trainer's), the
run (``RunConfig``: the ``train`` section of every command, train-ppo's included, and the one
place for how the run builds and executes its models) and the ``model``, ``data`` and ``train``
sections the single-model commands (``train-sft``, ``train-reward``) share, with the checks of
their values. Their ``parallel`` section is ``distributed.layouts.LayoutConfig``, beside
train-ppo's and the layout validator.

Pure dataclasses: nothing here imports torch or megatron-core, so a command's config (and
``--help``, and the planner that writes a ``train-ppo`` config) loads in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

OPTIMIZER_CHECKPOINT_SHARDINGS = ("fully_reshardable", "dp_reshardable")


@dataclass(kw_only=True)
class OptimConfig:
    """Adam with warm-up and cosine decay; grads clipped by global norm."""

    lr: float = 5e-6
    """Peak learning rate (paper: 5e-6 for the AM, 5e-7 for the PPO actor)."""
    min_lr_ratio: float = 0.1
    """The cosine decays to this fraction of the peak lr."""
    warmup_fraction: float = 0.1
    """Share of the steps spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon (added to the root of the second moment)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over TP/PP/DP) to this; 0 disables clipping."""
    checkpoint_sharding: str = "fully_reshardable"
    """How the distributed optimizer (GPUs) lays out its state in a checkpoint.
    ``fully_reshardable``: model-space tensors, so a run resumes at any TP/PP/DP; at save each
    rank gathers its model-parallel shard's fp32 state (12 bytes a parameter: ~26 GB a rank for
    a 176B actor at TP 8 x PP 10). ``dp_reshardable`` (Megatron-LM's default):
    each rank writes its own buffers with no gather; a resume may change the DP size only.
    Megatron-Core's own default, ``fully_sharded_model_space``, is refused by its checkpoint
    validation in 0.16.1 (``flattened_range``), so it is not offered. The CPU's plain optimizer
    saves model-space state whatever this says. A checkpoint records its format and is read back
    in that format."""


def optim_problems(optim: OptimConfig, section: str) -> list[str]:
    """What is wrong with ``optim`` (config section ``section``), one ``key=value ...`` each."""
    rules = (
        ("lr", optim.lr > 0, "must be a finite number > 0"),
        ("min_lr_ratio", 0 <= optim.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("warmup_fraction", 0 <= optim.warmup_fraction < 1, "must be in [0, 1)"),
        ("weight_decay", optim.weight_decay >= 0, "must be >= 0"),
        ("adam_beta1", 0 <= optim.adam_beta1 < 1, "must be in [0, 1)"),
        ("adam_beta2", 0 <= optim.adam_beta2 < 1, "must be in [0, 1)"),
        ("adam_eps", optim.adam_eps > 0, "must be > 0"),
        ("clip_grad", optim.clip_grad >= 0, "must be >= 0 (0: no clipping)"),
    )
    problems = []
    if optim.checkpoint_sharding not in OPTIMIZER_CHECKPOINT_SHARDINGS:
        problems.append(
            f"{section}.checkpoint_sharding={optim.checkpoint_sharding!r} must be one of "
            f"{', '.join(OPTIMIZER_CHECKPOINT_SHARDINGS)}"
        )
    return problems + [
        f"{section}.{key}={getattr(optim, key)} {rule}"
        for key, ok, rule in rules
        if not (ok and math.isfinite(getattr(optim, key)))
    ]


@dataclass(kw_only=True)
class ModelConfig:
    """Where the model comes from (how it is built: ``train``; its layout: ``parallel``)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "tp": "parallel.tp",
        "pp": "parallel.pp",
        "sequence_parallel": "parallel.sequence_parallel",
        "bf16": "train.bf16",
        "recompute_activations": "train.recompute_activations",
        "attention_backend": "train.attention_backend",
        "seed": "train.seed",
    }
    """Keys this section once had, and where they are now: an old key loads at its new place
    with a warning (megatron_rlhf/config.py)."""

    load: str
    """Hugging Face BLOOM directory or megatron-rlhf checkpoint with the same head."""


@dataclass(kw_only=True)
class TrainEvalDataConfig:
    """Training and held-out examples: ``tools/preprocess_data.py`` output prefixes (each
    command's subclass adds ``max_length``)."""

    train: str
    """Training examples."""
    eval: str | None = None
    """Held-out examples; None holds out ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.0
    """Share of ``train`` held out for evaluation when ``eval`` is None (0: no evaluation)."""


@dataclass(kw_only=True)
class RunConfig:
    """The ``train`` section of every command (train-sft, train-reward, train-ppo): the run.

    One key for one setting, by one rule: ``model`` (``models`` in train-ppo) says only where
    the weights come from and ``parallel`` how they are laid out; everything about how the run
    builds, batches and executes every one of its models (precision, recompute, attention
    kernel, micro-batches, packing, the seed) and its checkpoints and logs is here, under the
    same key in every command. Each command's section adds its own keys (steps, batch sizes,
    intervals) and may change a default."""

    output_dir: str
    """Checkpoints, TensorBoard logs, metrics.jsonl and the resolved config go here."""
    seed: int = 1234
    """The run's one seed: data order and held-out split (train-sft, train-reward), sampling
    and minibatch order (train-ppo), and the model-parallel RNG of every model."""
    bf16: bool | Literal["auto"] = "auto"
    """bf16 parameters of every model of the run; "auto" = bf16 on GPU (what the planner
    assumes), fp32 on CPU (true without a GPU is an error)."""
    recompute_activations: bool = False
    """Recompute each trained model's layers in the backward pass (full, one layer at a time)
    instead of keeping their activations: saves memory (train-ppo: the actor and critic; what
    makes a 176B PPO step fit, see examples/ppo/bloomz_176b_am_ppo_sr.yaml)."""
    attention_backend: Literal["auto", "triton", "te", "torch"] = "auto"
    """Every model's core attention: triton (the fused ALiBi kernel, O(s) memory; CUDA), te
    (TransformerEngine, unfused with ALiBi), torch (O(s^2), every device); auto: triton on a GPU
    where it compiles, else te where it imports, else torch. Decoding with a KV cache always
    takes the PyTorch path."""
    micro_batch_size: int = 1
    """Rows per forward/backward pass of every model (per data-parallel rank): examples for
    train-sft and train-reward (global = micro × microbatches × dp), sequences for train-ppo's
    scoring and update passes."""
    packing: bool = True
    """Pack the real tokens of several rows back to back into each micro-batch (no padding
    computed; attention stays within each row, data/packing.py) instead of padding
    ``micro_batch_size`` rows to the longest; each (mini)batch is balanced by tokens over the
    data-parallel ranks. Exact: losses are the same token (pair) means, so steps equal the
    padded path's up to rounding; the number of micro-batches then varies by step. train-ppo
    packs its scoring (reference/old log-probs, values, rewards) and update (actor, critic,
    rehearsal rows) passes; ``train-reward``'s DeepSpeed backend always pads."""
    max_tokens_per_micro_batch: int | None = None
    """Packing's token budget per micro-batch (None: ``micro_batch_size`` × the longest a row
    may be: ``data.max_length`` examples, or train-ppo's padded row width of the step, so a pack
    is never longer than the padded micro-batch). The PyTorch attention path runs each packed
    sequence's attention alone; with TE layers or sequence parallelism a pack falls back to one
    T×T mask, so there keep it near one BLOOM context with ``micro_batch_size: 1``. train-ppo's
    rehearsal rows ride on the update's packs beyond it."""
    save_interval: int = 500
    """Checkpoint every this many steps and at the end (0: only at the end)."""
    save_at: list[int] = field(default_factory=list)
    """Also checkpoint after each of these steps (e.g. ``[5, 10, 20, 40]``: the study's training
    curves judge the policy there, and an interval would save at every common divisor)."""
    log_interval: int = 10
    """Print, write TensorBoard scalars and metrics.jsonl every this many steps and at the
    end."""
    resume: bool = True
    """Continue from ``output_dir``'s latest checkpoint when there is one."""
    max_nonfinite_skips: int = 0
    """Steps with a non-finite loss or gradient norm skipped (no update; train-ppo also leaves
    its KL controller and reward normaliser unchanged) before the run stops with an error; 0:
    the first one stops it (training/guards.py)."""
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make the run finish its step, save a checkpoint and exit with code 75
    (training/signals.py); ask Slurm for one ahead of the time limit (``--signal``)."""

    def save_at_problems(self) -> list[str]:
        """What is wrong with ``save_at`` (every command checks it with its other keys)."""
        bad = [step for step in self.save_at if step < 1]
        return [f"train.save_at={self.save_at}: steps must be >= 1, got {bad}"] if bad else []

    def token_budget(self, width: int) -> int | None:
        """Tokens per packed micro-batch whose rows are at most ``width`` tokens long (None:
        padded micro-batches)."""
        if not self.packing:
            return None
        return self.max_tokens_per_micro_batch or self.micro_batch_size * width


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """The run of a single-model trainer: batching, evaluation, checkpointing and logging. An
    example is a preference pair for ``train-reward`` (two sequences) and a sequence for
    ``train-sft``."""

    global_batch_size: int = 64
    """Examples per optimizer step."""
    epochs: float = 1.0
    """Passes over the training examples; ignored when ``steps`` is set."""
    steps: int | None = None
    """Optimizer steps (None: from ``epochs``)."""
    eval_interval: int = 100
    """Evaluate every this many steps and at the end (0: only at the end)."""


RESUMABLE_CHANGES = tuple(
    f"train.{key}"
    for key in (
        "steps", "epochs", "eval_interval", "save_interval", "save_at", "log_interval", "resume",
        "max_nonfinite_skips", "output_dir", "exit_signals",
    )
)  # fmt: skip
"""Config keys that may differ when a run resumes (training/run_dir.py)."""


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
    ] + train.save_at_problems()
    if not 0.0 <= data.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction={data.eval_fraction} must be in [0, 1)")
    if data.eval is not None and data.eval_fraction > 0:
        problems.append("give data.eval or data.eval_fraction, not both")
    if Path(train.output_dir).is_file():  # before any data or model is read
        problems.append(f"train.output_dir {train.output_dir}: is a file; give a directory")
    return problems


@dataclass(kw_only=True)
class DeepSpeedConfig:
    """DeepSpeed ZeRO settings (``backend: deepspeed``)."""

    zero_stage: int = 2
    """ZeRO stage: 1 partitions optimizer state, 2 also gradients, 3 also parameters."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and its update) in CPU memory (ZeRO-Offload)."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient reduce-scatter bucket."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """ZeRO-3: elements of parameters gathered ahead of use."""
