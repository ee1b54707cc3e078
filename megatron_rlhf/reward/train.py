"""``torchrun ... -m megatron_rlhf train-reward --config FILE [key=value ...]``: RM or AM training.

    torchrun --nproc-per-node 8 -m megatron_rlhf train-reward \\
        --config examples/reward/bloomz_7b1_am.yaml model.tp=2 optim.lr=5e-6

``loss: rm`` trains a Reward Model (Eq. 1) with a 1-output scalar head r(x, y); ``loss: am`` an
Advantage Model (Eqs. 5-8) with a 2-output head, r(x, y) and e_τ(x) (see reward/model.py). The
trunk comes from a Hugging Face BLOOM directory (a fresh head is initialised) or a megatron-rlhf
checkpoint of the same head. Any tp/pp/dp; Megatron-Core's DDP and optimizer (the distributed
optimizer on GPU), linear warm-up over the first ``optim.warmup_fraction`` of the steps then
cosine to ``optim.min_lr_ratio`` of the peak lr (the paper's 10 % / 10 %), the global batch of
``train.global_batch_size`` pairs via gradient accumulation over microbatches, bf16 on GPU and
fp32 on CPU. Every ``train.eval_interval`` steps the held-out split is scored (loss, accuracy,
ECE, per-task score means); every ``train.save_interval`` steps and at the end a checkpoint is
written to ``train.output_dir/step_N`` that resumes exactly (model, optimizer, LR schedule, RNG,
data position) and is also a model checkpoint for ``score`` and PPO; its ``megatron_rlhf.json``
holds the resolved config. TensorBoard scalars go to ``train.output_dir/tensorboard``.

``backend: deepspeed`` trains the same model the DeepSpeed-Chat way instead: transformers'
BLOOM trunk with the same scalar head under DeepSpeed ZeRO stage ``deepspeed.zero_stage``
(1-3, optional ``deepspeed.offload_optimizer``), data parallel only, with everything above
shared; its checkpoints are read wherever a reward checkpoint is (reward/train_deepspeed.py).

Importance weights (Eq. 8): with ``am.policy_column: k``, column k of the preference data's
behaviour log-probs is taken as π_φ(y|x), the policy whose expected reward e_τ models (e.g. the
SFT model that sampled the comparisons), and all K columns are the collecting policies π'_k;
each w_k is clipped at ``am.max_importance_weight`` (1 by default) so that Σ_k w_k / N < 1.
Without it (the default) the log-probs are ignored and a = r - e_τ(x) (K = 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from megatron_rlhf.reward.losses import DEFAULT_MARGIN
from megatron_rlhf.training import command
from megatron_rlhf.training.command import (
    ModelConfig,
    RunLog,
    every,
    log,
    reduce_metrics,
    to_device,
    tokenizer_dir,
)
from megatron_rlhf.training.deepspeed_engine import DeepSpeedConfig
from megatron_rlhf.training.engine import OptimConfig, optim_problems
from megatron_rlhf.training.throughput import train_step_throughput
from megatron_rlhf.utils import InputError, is_rank0, write_json


@dataclass(kw_only=True)
class DataConfig:
    """Preference data: prefixes written by ``tools/preprocess_data.py --kind preference``."""

    train: str
    """Training pairs."""
    eval: str | None = None
    """Held-out pairs; None holds out ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.0
    """Share of ``train`` held out for evaluation when ``eval`` is None (0: no evaluation)."""
    max_length: int | None = None
    """Longest prompt + response allowed (None: the model's max_sequence_length)."""


@dataclass(kw_only=True)
class AMConfig:
    """Advantage Model settings (ignored for ``loss: rm``)."""

    margin: float = DEFAULT_MARGIN
    """m(x) of Eq. 6 (the paper: 2.5)."""
    policy_column: int | None = None
    """Behaviour log-prob column holding π_φ(y|x) (see the module docstring); None: K = 0."""
    num_policies: float | None = None
    """N of Eq. 8 (default K + 1)."""
    max_importance_weight: float = 1.0
    """Clip of each importance weight w_k of Eq. 8; K × this must stay below N, so that
    Σ_k w_k / N < 1 and a rises with r (see reward/losses.py)."""


@dataclass(kw_only=True)
class TrainConfig(command.TrainConfig):
    """Batching, evaluation, checkpointing and logging (an example is a preference pair)."""

    global_batch_size: int = 180
    """Pairs per optimizer step (paper: 180 English, 480 Chinese)."""


@dataclass(kw_only=True)
class RewardTrainConfig:
    """``train-reward``: one Reward Model or Advantage Model run."""

    loss: Literal["am", "rm"] = "am"
    """am: Advantage Model (Eq. 6); rm: Reward Model (Eq. 1)."""
    backend: Literal["megatron", "deepspeed"] = "megatron"
    """megatron: Megatron-Core BLOOM, any TP/PP/DP; deepspeed: transformers' BLOOM under
    DeepSpeed ZeRO, data parallel only (reward/train_deepspeed.py)."""
    model: ModelConfig
    data: DataConfig
    am: AMConfig = field(default_factory=AMConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO settings (``backend: deepspeed`` only)."""


def main(argv: list[str]) -> int:
    return command.command_main("train-reward", RewardTrainConfig, train, argv, _summary)


def _summary(config: RewardTrainConfig, result: dict) -> dict:
    final_eval = result["eval"] or {}
    return dict(
        loss=config.loss,
        steps=result["step"],
        train_loss=result["history"][-1]["loss"] if result["history"] else "-",  # finished run
        eval_accuracy=final_eval.get("accuracy", "-"),
        eval_ece=final_eval.get("ece", "-"),
        seconds=round(result["seconds"], 1),
        checkpoint=result["checkpoint"],
    )


def train(
    config: RewardTrainConfig,
    overwrite: bool = False,
    force_config_change: bool = False,
    skip_memory_check: bool = False,
) -> dict:
    """Run (or resume) the training run; returns per-step metrics, the last evaluation and the
    final checkpoint. ``overwrite`` / ``force_config_change``: see training/run_dir.py;
    ``skip_memory_check``: see training/memory_check.py. Collective over every rank."""
    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.config import to_dict
    from megatron_rlhf.distributed import ParallelConfig, initialize
    from megatron_rlhf.training.guards import NonFiniteGuard

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
    batches = PairBatches.for_layout(config.train, dp_size, config.model)
    dataset, train_set, eval_set = _open_data(config, arch.max_sequence_length, arch.vocab_size)
    batches.pad_id = dataset.pad_id if dataset.pad_id is not None else 0
    total_steps = config.train.steps or int(
        config.train.epochs * len(train_set) // config.train.global_batch_size
    )
    if total_steps < 1:
        raise InputError(
            f"{config.data.train}: {len(train_set)} training pairs make no whole global batch "
            f"of train.global_batch_size={config.train.global_batch_size} in train.epochs="
            f"{config.train.epochs}; lower the batch size or set train.steps"
        )
    output_dir = Path(config.train.output_dir)
    import torch

    from megatron_rlhf.reward.model import NUM_OUTPUTS
    from megatron_rlhf.training.memory_check import check_trainer
    from megatron_rlhf.training.signals import ExitSignals, stopped_message

    sharded_optimizer = config.backend == "deepspeed" or torch.cuda.is_available()
    max_length = min(config.data.max_length or arch.max_sequence_length, arch.max_sequence_length)
    check_trainer(
        arch, config, dp_size, max_length, 2, "scalar",
        command.use_bf16(config.model.bf16), sharded_optimizer, skip_memory_check,
    )  # fmt: skip

    guard = NonFiniteGuard(config.train.max_nonfinite_skips)
    if config.backend == "deepspeed":
        from megatron_rlhf.reward import train_deepspeed

        engine, step, consumed, checkpoint = train_deepspeed.build_engine(
            config, total_steps, batches.num_microbatches, guard, overwrite, force_config_change
        )
    else:
        engine, step, consumed, checkpoint = command.build_engine(
            "train-reward",
            config,
            arch,
            total_steps,
            check_saved=_check_saved_loss(config),
            guard=guard,
            overwrite=overwrite,
            force_config_change=force_config_change,
            head="scalar",
            num_scalar_outputs=NUM_OUTPUTS[config.loss],
        )
    command.say_if_finished("train-reward", checkpoint, step, total_steps)
    if is_rank0():
        write_json(output_dir / "config.json", to_dict(config))

    loss_fn = make_loss_fn(config)
    steps = batches.train_steps(train_set, config.train.seed, consumed)
    metadata = {"loss": config.loss, "config": to_dict(config)}
    tokenizer_source = tokenizer_dir(dataset, config.model.load)
    logger = RunLog("train-reward", output_dir, step, total_steps)
    history, last_eval, saved_step, stopped_by = [], None, step, None

    def save() -> Path:
        return _save(
            config,
            engine,
            output_dir,
            {**metadata, "step": step, "eval": last_eval},
            {"step": step, "consumed_samples": consumed, "nonfinite": guard.state_dict()},
            tokenizer_source,
        )

    exit_signals = ExitSignals(config.train.exit_signals, "train-reward")
    try:
        while step < total_steps:
            microbatches, started = next(steps), time.time()
            metrics = reduce_metrics(engine.step(microbatches, loss_fn))
            metrics |= train_step_throughput(
                engine.module.arch, microbatches, time.time() - started
            )
            step += 1
            consumed += config.train.global_batch_size
            guard.check(step, metrics)
            history.append(metrics)
            logger.advance(loss=metrics["loss"], acc=metrics["accuracy"])
            if every(step, config.train.log_interval):
                logger.write("train", step, metrics)
            last = step == total_steps
            if eval_set is not None and (last or every(step, config.train.eval_interval)):
                last_eval = evaluate(engine, eval_set, config, batches)
                logger.write("eval", step, eval_scalars(last_eval))
            if last or every(step, config.train.save_interval):
                checkpoint, saved_step = save(), step
            stopped_by = exit_signals.agreed()
            if stopped_by is not None:
                if saved_step != step:
                    checkpoint, saved_step = save(), step
                stopped_message("train-reward", stopped_by, step, checkpoint)
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


def make_loss_fn(config: RewardTrainConfig, sink: list | None = None):
    """``loss_fn(output, microbatch)`` for the engine: Eq. 1 or Eq. 6 on one microbatch of pairs.

    ``sink`` (a list) receives (chosen scores, rejected scores, task ids) lists per microbatch.
    """
    from megatron_rlhf.reward import losses
    from megatron_rlhf.reward.model import read_scalars, split_pairs

    def loss_fn(output, microbatch):
        rewards, expected = read_scalars(
            output, microbatch["padding_mask"], microbatch["prompt_lengths"]
        )  # (2P,), (2P,) or None
        chosen_r, rejected_r = split_pairs(rewards)
        if config.loss == "rm":
            loss, metrics = losses.bradley_terry_loss(chosen_r, rejected_r)
            chosen, rejected = chosen_r, rejected_r
        else:
            chosen_e, rejected_e = split_pairs(expected)
            chosen = _advantage(chosen_r, chosen_e, microbatch.get("chosen_logprobs"), config.am)
            rejected = _advantage(
                rejected_r, rejected_e, microbatch.get("rejected_logprobs"), config.am
            )
            loss, metrics = losses.advantage_model_loss(chosen, rejected, config.am.margin)
            metrics["expected_reward_mean"] = expected.detach().mean()
        if sink is not None:
            task_ids = microbatch.get("task_ids")
            tasks = [None] * len(chosen) if task_ids is None else task_ids.tolist()
            sink.append((chosen.detach().tolist(), rejected.detach().tolist(), tasks))
        return loss, metrics

    return loss_fn


def _advantage(rewards, expected, logprobs, am: AMConfig):
    """Eq. 8 for one side of the pairs; logprobs (P, K) are the behaviour log-probs or None."""
    from megatron_rlhf.reward.losses import advantage

    if am.policy_column is None or logprobs is None:
        return advantage(rewards, expected)
    logprobs = logprobs.to(rewards.dtype)
    return advantage(
        rewards,
        expected,
        policy_logprobs=logprobs[:, am.policy_column],
        behaviour_logprobs=logprobs,
        num_policies=am.num_policies,
        max_weight=am.max_importance_weight,
    )


def check_pairs(dataset, max_length: int) -> None:
    """Refuse pairs whose chosen and rejected tokens are identical, and over-long pairs."""
    prompt = dataset.streams["prompt"].sequence_lengths.astype(np.int64)
    chosen = dataset.streams["chosen"].sequence_lengths.astype(np.int64)
    rejected = dataset.streams["rejected"].sequence_lengths.astype(np.int64)
    sources = ", ".join(str(s.get("path")) for s in dataset.sidecar.get("inputs", [])) or "-"
    for index in np.flatnonzero(chosen == rejected):
        if np.array_equal(dataset.streams["chosen"][index], dataset.streams["rejected"][index]):
            raise InputError(
                f"{dataset.prefix}: pair {index} (0-based record; sources: {sources}) has "
                "identical chosen and rejected responses, which is no comparison; remove it "
                "from the input and preprocess again"
            )
    longest = prompt + np.maximum(chosen, rejected)
    if longest.max() > max_length:
        index = int(longest.argmax())
        raise InputError(
            f"{dataset.prefix}: pair {index} (0-based record; sources: {sources}) is "
            f"{longest[index]} tokens long, more than data.max_length={max_length}; preprocess "
            "with --max-length to truncate, or raise data.max_length"
        )


@dataclass
class PairBatches:
    """How this rank turns preference pairs into microbatches of (2P, S) rows."""

    micro_batch_size: int
    num_microbatches: int
    dp_rank: int
    dp_size: int
    width_multiple: int
    pad_id: int = 0

    @classmethod
    def for_layout(cls, train: TrainConfig, dp_size: int, model: ModelConfig) -> PairBatches:
        from megatron.core import parallel_state

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
            width_multiple=model.tp if model.sequence_parallel else 1,
        )

    def train_steps(self, dataset, seed: int, consumed: int):
        """Endless iterator of this rank's microbatches, one list per optimizer step.

        The pairs follow :class:`~megatron_rlhf.data.ShardedSampler`'s stream from global
        position ``consumed``, so a resumed run sees exactly what an uninterrupted one would.
        """
        from megatron_rlhf.data import ShardedSampler

        sampler = ShardedSampler(
            len(dataset),
            self.dp_rank,
            self.dp_size,
            seed,
            consumed_samples=consumed,
            micro_batch_size=self.micro_batch_size,
        )
        positions = iter(sampler)
        while True:
            chunks = [
                [dataset[next(positions)] for _ in range(self.micro_batch_size)]
                for _ in range(self.num_microbatches)
            ]
            yield self.collate(chunks)

    def eval_microbatches(self, dataset):
        """This rank's share of ``dataset``, one microbatch (a list of one) at a time."""
        mine = list(range(self.dp_rank, len(dataset), self.dp_size))
        for start in range(0, len(mine), self.micro_batch_size):
            chunk = [dataset[i] for i in mine[start : start + self.micro_batch_size]]
            yield self.collate([chunk]), len(chunk)

    def collate(self, chunks: list[list[dict]]) -> list[dict]:
        from megatron_rlhf.reward.model import collate_pairs

        return [to_device(rows) for rows in collate_pairs(chunks, self.pad_id, self.width_multiple)]


def evaluate(engine, eval_set, config: RewardTrainConfig, batches: PairBatches) -> dict:
    """Loss, accuracy, ECE and per-task score statistics on the held-out pairs (all ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rlhf.reward import calibration

    sink: list = []
    loss_fn = make_loss_fn(config, sink)
    loss_sum = 0.0
    for microbatches, pairs in batches.eval_microbatches(eval_set):
        loss_sum += engine.step(microbatches, loss_fn, forward_only=True).get("loss", 0.0) * pairs
    reports = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sink, loss_sum) if reports else ([], 0.0))
    chosen, rejected, task_ids = [], [], []
    for part, _ in gathered:
        for c, r, t in part:
            chosen += c
            rejected += r
            task_ids += t
    names = getattr(eval_set, "task_names", None) or getattr(
        getattr(eval_set, "dataset", None), "task_names", None
    )
    tasks = [names[t] if names and t is not None else "untagged" for t in task_ids]
    per_task = calibration.per_task_stats(chosen, rejected, tasks)
    means = [row["mean"] for row in per_task.values()]
    return {
        "pairs": len(chosen),
        "loss": sum(loss for _, loss in gathered) / len(chosen),
        "accuracy": calibration.ranking_accuracy(chosen, rejected),
        "ece": calibration.expected_calibration_error(chosen, rejected),
        "outside_margin": float(np.mean(np.abs(np.array(chosen + rejected)) > config.am.margin)),
        "per_task": per_task,
        "task_mean_spread": max(means) - min(means),
    }


def eval_scalars(result: dict) -> dict:
    """The scalars of an :func:`evaluate` result (per-task means flattened) for the run log."""
    scalars = {k: v for k, v in result.items() if k not in ("pairs", "per_task")}
    scalars.update({f"task_mean/{t}": row["mean"] for t, row in result["per_task"].items()})
    return scalars


def _check_saved_loss(config: RewardTrainConfig):
    """Refuse to resume a run of the other loss (its head has another number of outputs)."""
    from megatron_rlhf.reward.model import NUM_OUTPUTS

    def check(saved: dict, directory: Path) -> None:
        if saved.get("num_scalar_outputs") != NUM_OUTPUTS[config.loss]:
            raise InputError(
                f"{directory}: was trained with loss={saved.get('loss')!r}, but loss="
                f"{config.loss!r} was asked for; choose another train.output_dir"
            )
        if saved.get("backend", "megatron") != config.backend:
            raise InputError(
                f"{directory}: was written by backend={saved.get('backend', 'megatron')!r}, "
                f"which backend={config.backend} cannot resume; choose another train.output_dir"
            )

    return check


def _save(config, engine, output_dir: Path, metadata: dict, trainer_state: dict, tokenizer):
    """``output_dir/step_N`` written by the configured backend; returns its path."""
    if config.backend == "deepspeed":
        from megatron_rlhf.reward import train_deepspeed

        return train_deepspeed.save_checkpoint(
            engine, output_dir, metadata, trainer_state, tokenizer
        )
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


def _check_config(config: RewardTrainConfig) -> None:
    problems = command.config_problems(config.train, config.data)
    if config.am.margin <= 0:
        problems.append(f"am.margin={config.am.margin} must be > 0")
    problems += optim_problems(config.optim, "optim")
    if config.backend == "deepspeed":
        from megatron_rlhf.reward.train_deepspeed import config_problems

        problems += config_problems(config)
    if problems:
        raise InputError("invalid train-reward config: " + "; ".join(problems))


def _check_policy_column(config: RewardTrainConfig, dataset) -> None:
    column, count = config.am.policy_column, dataset.num_behaviour_policies
    if config.loss != "am" or column is None:
        if count and config.loss == "am":
            log(
                "train-reward",
                f"note: {dataset.prefix} has {count} behaviour log-probs per "
                "response, unused without am.policy_column (a = r - e_τ)",
            )
        return
    if not 0 <= column < count:
        raise InputError(
            f"am.policy_column={column}: {dataset.prefix} has {count} behaviour log-prob "
            f"columns; choose one in [0, {count}) or leave am.policy_column unset"
        )
    num_policies = config.am.num_policies or count + 1
    if not 0 < config.am.max_importance_weight < num_policies / count:
        raise InputError(
            f"am.max_importance_weight={config.am.max_importance_weight} with K={count} "
            f"behaviour policies and N={num_policies}: need 0 < K × max_importance_weight < N, "
            "or Σ_k w_k / N can reach 1 and Eq. 8 ranks against r; lower it or raise "
            "am.num_policies"
        )


def _open_data(config: RewardTrainConfig, model_max_length: int, model_vocab: int):
    """(training dataset, training pairs, held-out pairs or None), every pair checked."""
    from megatron_rlhf.data import PreferenceDataset

    max_length = config.data.max_length or model_max_length
    dataset = PreferenceDataset(config.data.train)
    command.check_data_fits_model(dataset, "data.train", config.model.load, model_vocab)
    check_pairs(dataset, max_length)
    _check_policy_column(config, dataset)
    if config.data.eval is not None:
        eval_set = PreferenceDataset(config.data.eval)
        command.check_data_fits_model(eval_set, "data.eval", config.model.load, model_vocab)
        check_pairs(eval_set, max_length)
        return dataset, dataset, eval_set
    if config.data.eval_fraction == 0:
        return dataset, dataset, None
    return dataset, *command.held_out_split(dataset, config.data.eval_fraction, config.train.seed)
