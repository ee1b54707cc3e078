"""``torchrun ... -m megatron_rlhf train-reward --config FILE [key=value ...]``: RM or AM training.

    torchrun --nproc-per-node 8 -m megatron_rlhf train-reward \\
        --config examples/reward/bloomz_7b1_am.yaml parallel.tp=2 optim.lr=5e-6

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

This module holds what is the reward model's in the shared loop (training/loop.py): the
preference pairs and their batching, the loss and the held-out evaluation; the config and its
checks are reward/config.py's, the command line reward/train_cli.py's.

Importance weights (Eq. 8): with ``am.policy_column: k``, column k of the preference data's
behaviour log-probs is taken as π_φ(y|x), the policy whose expected reward e_τ models (e.g. the
SFT model that sampled the comparisons), and all K columns are the collecting policies π'_k;
each w_k is clipped at ``am.max_importance_weight`` (1 by default) so that Σ_k w_k / N < 1.
Without it (the default) the log-probs are ignored and a = r - e_τ(x) (K = 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.reward.config import (
    AMConfig,
    LayoutConfig,
    ModelConfig,
    RewardDataConfig,
    RewardTrainConfig,
    TrainConfig,
    check_policy_column,
    config_problems,
)
from megatron_rlhf.training import command, loop
from megatron_rlhf.training.command import to_device
from megatron_rlhf.utils import InputError

__all__ = [  # the config's names stay importable from here
    "AMConfig", "LayoutConfig", "ModelConfig", "RewardDataConfig", "RewardTrainConfig",
    "TrainConfig", "evaluate", "main", "make_loss_fn", "train",
]  # fmt: skip


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


def train(config: RewardTrainConfig, **options) -> dict:
    """Run (or resume) the training run; returns per-step metrics, the last evaluation and the
    final checkpoint. ``options``: training/loop.py ``train``'s (overwrite,
    force_config_change, skip_memory_check). Collective over every rank."""
    return loop.train(RewardTask(config), **options)


class RewardTask(loop.Task):
    """``train-reward`` in the shared loop: preference pairs, Eq. 1 or Eq. 6, ranking
    accuracy and ECE on the held-out pairs; the engine and checkpoints of ``config.backend``."""

    name, examples, rows_per_example, head = "train-reward", "pairs", 2, "scalar"
    config: RewardTrainConfig

    def config_problems(self) -> list[str]:
        return config_problems(self.config)

    def open_data(self, arch) -> loop.Data:
        return _open_data(self.config, arch.max_sequence_length, arch.vocab_size)

    def sharded_optimizer(self) -> bool:
        return self.config.backend == "deepspeed" or super().sharded_optimizer()

    def build_train_engine(self, arch, total_steps, num_microbatches, run):
        from megatron_rlhf.reward.model import NUM_OUTPUTS

        if self.config.backend == "deepspeed":
            from megatron_rlhf.reward import train_deepspeed

            return train_deepspeed.build_train_engine(
                self.config, total_steps, num_microbatches, run
            )
        return command.build_train_engine(
            self.config, arch, total_steps, run, check_saved=_check_saved_loss(self.config),
            head=self.head, num_scalar_outputs=NUM_OUTPUTS[self.config.loss],
        )  # fmt: skip

    def packs(self) -> bool:
        return self.config.train.packing and self.config.backend == "megatron"

    def batches(self, groups, data: loop.Data, num_microbatches: int, max_length: int, max_tokens):
        return PairBatches.of(
            self.config, groups, num_microbatches, data.dataset.pad_id, max_tokens=max_tokens
        )

    def loss_fn(self, groups):
        return make_loss_fn(self.config)

    def evaluate(self, engine, eval_set, batches) -> dict:
        return evaluate(engine, eval_set, self.config, batches)

    def progress(self, metrics: dict) -> dict:
        return {"loss": metrics["loss"], "acc": metrics["accuracy"]}

    def eval_scalars(self, result: dict) -> dict:
        return eval_scalars(result)

    def metadata(self) -> dict:
        return {"loss": self.config.loss, **super().metadata()}

    def save(self, engine, output_dir: Path, metadata: dict, trainer_state: dict, tokenizer):
        if self.config.backend == "deepspeed":
            from megatron_rlhf.reward import train_deepspeed

            return train_deepspeed.save_checkpoint(
                engine, output_dir, metadata, trainer_state, tokenizer
            )
        return super().save(engine, output_dir, metadata, trainer_state, tokenizer)


def make_loss_fn(config: RewardTrainConfig, sink: list | None = None):
    """``loss_fn(output, microbatch)`` for the engine: Eq. 1 or Eq. 6 on one microbatch of pairs.

    ``sink`` (a list) receives (chosen scores, rejected scores, task ids) lists per microbatch.
    A packed microbatch (:class:`PairBatches`) carries ``pair_weight``, its share of the global
    batch's pairs relative to a padded microbatch's; the loss and metrics, means over its
    pairs, are scaled by it so that they stay means over the global batch.
    """
    from megatron_rlhf.reward import losses
    from megatron_rlhf.reward.model import read_packed_scalars, read_scalars, split_pairs

    def loss_fn(output, microbatch):
        if "last_positions" in microbatch:  # packed
            rewards, expected = read_packed_scalars(
                output, microbatch["last_positions"], microbatch["prompt_ends"]
            )
        else:
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
        weight = microbatch.get("pair_weight")
        if weight is not None:
            loss, metrics = loss * weight, {k: v * weight for k, v in metrics.items()}
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


class PairBatches(loop.Batches):
    """How this rank turns preference pairs into microbatches: (2P, S) padded rows, chosen
    first, or (``max_tokens``) one packed row holding both sequences of each of its pairs."""

    def train_steps(self, dataset, seed: int, consumed: int):
        """Endless iterator of this rank's microbatches, one list per optimizer step."""
        if not self.max_tokens:
            for chunks in self.step_chunks(dataset, seed, consumed):
                yield self.collate_padded(chunks)
            return
        global_pairs = self.micro_batch_size * self.num_microbatches * self.dp_size
        for chunks in self.packed_step_chunks(dataset, seed, consumed):
            microbatches = self.collate_packed(chunks)
            share = len(microbatches) * self.dp_size / global_pairs
            for microbatch, chunk in zip(microbatches, chunks):
                microbatch["pair_weight"] = torch.tensor(len(chunk) * share, dtype=torch.float32)
            yield microbatches

    def eval_microbatches(self, dataset):
        """This rank's share of ``dataset``: (a list of one padded microbatch, its pair count)."""
        for chunk in self.eval_chunks(dataset):
            yield self.collate_padded([chunk]), len(chunk)

    def example_lengths(self, train_set, indices: list[int]) -> list[int]:
        from megatron_rlhf.data import stream_lengths

        def tokens(stream):
            return stream_lengths(train_set, stream, indices)

        return (2 * tokens("prompt") + tokens("chosen") + tokens("rejected")).tolist()

    def collate_padded(self, chunks: list[list[dict]]) -> list[dict]:
        from megatron_rlhf.reward.model import collate_pairs

        return [to_device(rows) for rows in collate_pairs(chunks, self.pad_id, self.width_multiple)]

    def collate_packed(self, chunks: list[list[dict]]) -> list[dict]:
        from megatron_rlhf.data import collate_preference
        from megatron_rlhf.reward.model import pack_pairs, pad_columns, pair_rows

        packs = [pack_pairs(pair_rows(collate_preference(chunk, self.pad_id))) for chunk in chunks]
        widths = self.pack_widths([pack["input_ids"].shape[1] for pack in packs])
        return [to_device(pad_columns(pack, w, self.pad_id)) for pack, w in zip(packs, widths)]


def evaluate(engine, eval_set, config: RewardTrainConfig, batches: PairBatches) -> dict:
    """Loss, accuracy, ECE and per-task score statistics on the held-out pairs (all ranks)."""
    import torch.distributed as dist

    from megatron_rlhf.distributed.parallel import is_last_stage, model_groups
    from megatron_rlhf.reward import calibration

    sink: list = []
    loss_fn = make_loss_fn(config, sink)
    loss_sum = 0.0
    for microbatches, pairs in batches.eval_microbatches(eval_set):
        loss_sum += engine.step(microbatches, loss_fn, forward_only=True).get("loss", 0.0) * pairs
    groups = model_groups(engine.module)
    reports = is_last_stage(groups) and groups.tp.rank() == 0
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


def _open_data(config: RewardTrainConfig, model_max_length: int, model_vocab: int) -> loop.Data:
    """The training dataset, training pairs and held-out pairs (or None), every pair checked."""
    from megatron_rlhf.data import PreferenceDataset

    max_length = config.data.max_length or model_max_length
    dataset = PreferenceDataset(config.data.train)
    command.check_data_fits_model(dataset, "data.train", config.model.load, model_vocab)
    check_pairs(dataset, max_length)
    check_policy_column(config, dataset)
    if config.data.eval is not None:
        eval_set = PreferenceDataset(config.data.eval)
        command.check_data_fits_model(eval_set, "data.eval", config.model.load, model_vocab)
        check_pairs(eval_set, max_length)
        return loop.Data(dataset, dataset, eval_set)
    if config.data.eval_fraction == 0:
        return loop.Data(dataset, dataset, None)
    split = command.held_out_split(dataset, config.data.eval_fraction, config.train.seed)
    return loop.Data(dataset, *split)
