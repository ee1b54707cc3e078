"""The data layer: tokenize once into Megatron-Core indexed files, then read them back.

- :mod:`.preprocess` (``tools/preprocess_data.py``): JSONL / parquet / local HF datasets ->
  ``.bin/.idx`` streams + a JSON sidecar; layout in :mod:`.indexed`, fields in :mod:`.records`.
- ``write_prompt_dataset`` / ``write_sft_dataset`` / ``write_preference_dataset``: the same
  files from token ids in Python (e.g. the rehearsal set D_R).
- ``PromptDataset`` / ``SFTDataset`` / ``PreferenceDataset``: map-style readers (no tokenizer).
- ``ShardedSampler`` / ``build_loader``: data-parallel, seeded, resumable from consumed samples.
- ``collate_prompts`` (left padding) / ``collate_sft`` / ``collate_preference``;
  ``cut_prompt_to_fit`` shortens an over-long SFT row from the left of its prompt.
- ``train_tiny_tokenizer`` / ``load_tokenizer`` and the built-in corpus of :mod:`.synthetic`.

Importing this package is cheap: each name is imported from its submodule on first use.
"""

from megatron_rlhf.utils import lazy_exports

# name -> submodule; imported on first use (torch and megatron-core load only then).
_EXPORTS = {
    "collate_preference": "collate",
    "collate_prompts": "collate",
    "collate_sft": "collate",
    "cut_prompt_to_fit": "collate",
    "PreferenceDataset": "datasets",
    "PromptDataset": "datasets",
    "SFTDataset": "datasets",
    "stream_lengths": "datasets",
    "read_sidecar": "indexed",
    "token_dtype": "indexed",
    "write_preference_dataset": "indexed",
    "write_prompt_dataset": "indexed",
    "write_sft_dataset": "indexed",
    "Example": "records",
    "split_hh_pair": "records",
    "ShardedSampler": "sampler",
    "build_loader": "sampler",
    "default_collator": "sampler",
    "english_sentences": "synthetic",
    "synthetic_records": "synthetic",
    "load_tokenizer": "tokenizer",
    "tokenizer_info": "tokenizer",
    "train_tiny_tokenizer": "tokenizer",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
