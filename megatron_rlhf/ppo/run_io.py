"""What a PPO run reads and writes besides models and the run log (training/run.py): data
streams, samples."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rlhf.generation.prompts import resolve_tokenizer


class RunData:
    """Prompt and rehearsal streams and the tokenizer.

    The streams are global (every rank reads the same rows; the roles' layouts split them), so
    their position is a count of global samples: a run resumes at any world size or layout.
    """

    def __init__(self, config, consumed_prompts: int, consumed_rehearsal: int):
        from megatron_rlhf.data import PromptDataset, SFTDataset, ShardedSampler

        self.config = config
        self.prompts = PromptDataset(config.data.prompts)
        self.eos_id = self.prompts.eos_id if self.prompts.eos_id is not None else 2
        self.pad_id = self.prompts.pad_id if self.prompts.pad_id is not None else 3
        self.prompt_sampler = ShardedSampler(
            len(self.prompts),
            0,  # one global stream: rank 0 of 1
            1,
            seed=config.train.seed,
            consumed_samples=consumed_prompts,
            micro_batch_size=config.rollout.prompts_per_step,
        )
        self._prompt_indices = iter(self.prompt_sampler)
        self.consumed_prompts = consumed_prompts
        self.rehearsal = None
        self.consumed_rehearsal = consumed_rehearsal
        self.rehearsal_rows_cut = 0
        if config.rehearsal.enabled:
            self.rehearsal = SFTDataset(config.rehearsal.dataset)
            self._rehearsal_indices = iter(
                ShardedSampler(
                    len(self.rehearsal),
                    0,
                    1,
                    seed=config.train.seed + 1,
                    consumed_samples=consumed_rehearsal,
                    micro_batch_size=config.rehearsal.micro_batch_size,
                )
            )
        self.clusters = None
        if config.data.prompt_clusters:
            from megatron_rlhf.rehearsal import load_cluster_assignment

            self.clusters = load_cluster_assignment(config.data.prompt_clusters)
        self.tokenizer = resolve_tokenizer(config.models.tokenizer, config.models.actor)

    def next_prompts(self) -> dict:
        """The next step's global batch of prompts, left-padded, truncated to
        max_prompt_length."""
        from megatron_rlhf.data import collate_prompts

        count = self.config.rollout.prompts_per_step
        samples = []
        for _ in range(count):
            sample = self.prompts[next(self._prompt_indices)]
            sample["input_ids"] = sample["input_ids"][-self.config.data.max_prompt_length :]
            samples.append(sample)
        self.consumed_prompts += count
        batch = collate_prompts(samples, self.pad_id)
        return {key: batch[key] for key in ("input_ids", "attention_mask", "index")}

    def rehearsal_minibatches(self, microbatches: int):
        """Endless lists of ``microbatches`` rehearsal microbatches (one PPO minibatch's)."""
        batches = self.rehearsal_batches()
        while True:
            yield [next(batches) for _ in range(microbatches)]

    def rehearsal_batches(self):
        """Endless rehearsal microbatches (collate_sft) of rows that fit rehearsal.max_length:
        a longer row loses prompt tokens from the left, never its response (counted in
        ``rehearsal_rows_cut``; the stream is global, every rank reads it)."""
        from megatron_rlhf.data import collate_sft, cut_prompt_to_fit

        size, limit = self.config.rehearsal.micro_batch_size, self.config.rehearsal.max_length
        while True:
            samples = []
            for _ in range(size):
                sample, cut = cut_prompt_to_fit(
                    self.rehearsal[next(self._rehearsal_indices)], limit
                )
                self.rehearsal_rows_cut += cut
                samples.append(sample)
            self.consumed_rehearsal += size
            yield collate_sft(samples, self.pad_id)

    def per_cluster_rewards(self, experience) -> dict:
        """Mean score per prompt cluster over this step's global batch: an early warning of
        reward hacking when one skill's reward runs away from the others."""
        if self.clusters is None:
            return {}
        clusters = torch.tensor(
            [self.clusters.cluster_of_index(int(i)) for i in experience.prompt_index]
        )
        scores = experience.scores.double()
        pairs = torch.stack([clusters.to(scores.device).double(), scores], dim=1)
        metrics = {}
        for cluster in pairs[:, 0].unique().tolist():
            scores = pairs[pairs[:, 0] == cluster, 1]
            metrics[f"reward_by_cluster/{int(cluster)}"] = float(scores.mean())
        return metrics


def dump_samples(path: Path, step: int, experience, tokenizer) -> None:
    """Append step ``step``'s rollouts to ``path`` (``samples.jsonl``): prompt and response
    token ids, score, and with a tokenizer their text."""
    with open(path, "a", encoding="utf-8") as handle:
        for row in range(experience.sequences.shape[0]):
            prompt_mask = experience.attention_mask[row, : experience.prompt_length].bool()
            prompt = experience.sequences[row, : experience.prompt_length][prompt_mask].tolist()
            response = experience.responses[row][experience.response_mask[row].bool()].tolist()
            record = {
                "step": step,
                "prompt_index": int(experience.prompt_index[row]),
                "score": float(experience.scores[row]),
                "prompt_token_ids": prompt,
                "response_token_ids": response,
            }
            if tokenizer is not None:
                record["prompt"] = tokenizer.decode(prompt, skip_special_tokens=True)
                record["response"] = tokenizer.decode(response, skip_special_tokens=True)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
