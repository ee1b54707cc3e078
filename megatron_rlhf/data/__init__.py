"""The data layer: tokenize once into Megatron-Core indexed files, then read them back.

- :mod:`.preprocess` (``tools/preprocess_data.py``): JSONL / parquet / local HF datasets ->
  ``.bin/.idx`` streams + a JSON sidecar; layout in :mod:`.indexed`, fields in :mod:`.records`.
- ``write_prompt_dataset`` / ``write_sft_dataset`` / ``write_preference_dataset``: the same
  files from token ids in Python (e.g. the rehearsal set D_R).
- ``PromptDataset`` / ``SFTDataset`` / ``PreferenceDataset``: map-style readers (no tokenizer).
- ``ShardedSampler`` / ``build_loader``: data-parallel, seeded, resumable from consumed samples.
- ``collate_prompts`` (left padding) / ``collate_sft`` / ``collate_preference``.
- ``train_tiny_tokenizer`` / ``load_tokenizer`` and the built-in corpus of :mod:`.synthetic`.

Importing this package is cheap; megatron-core is imported when a dataset is opened or written.
"""

from megatron_rlhf.data.collate import collate_preference, collate_prompts, collate_sft
from megatron_rlhf.data.datasets import PreferenceDataset, PromptDataset, SFTDataset
from megatron_rlhf.data.indexed import (
    read_sidecar,
    token_dtype,
    write_preference_dataset,
    write_prompt_dataset,
    write_sft_dataset,
)
from megatron_rlhf.data.records import Example, split_hh_pair
from megatron_rlhf.data.sampler import ShardedSampler, build_loader, default_collator
from megatron_rlhf.data.synthetic import english_sentences, synthetic_records
from megatron_rlhf.data.tokenizer import load_tokenizer, tokenizer_info, train_tiny_tokenizer

__all__ = [
    "Example",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "ShardedSampler",
    "build_loader",
    "collate_preference",
    "collate_prompts",
    "collate_sft",
    "default_collator",
    "english_sentences",
    "load_tokenizer",
    "read_sidecar",
    "split_hh_pair",
    "synthetic_records",
    "token_dtype",
    "tokenizer_info",
    "train_tiny_tokenizer",
    "write_preference_dataset",
    "write_prompt_dataset",
    "write_sft_dataset",
]
