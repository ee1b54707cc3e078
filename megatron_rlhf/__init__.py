"""megatron-rlhf: the recipe of "Stabilizing RLHF through Advantage Model and Selective
Rehearsal" (arXiv 2309.10202) for BLOOM models on Megatron-Core.

Folders follow the pipeline (see README.md):
  distributed/   torch.distributed + Megatron-Core parallel state, the CPU compatibility layer
  models/bloom/  one BLOOM trunk on Megatron-Core (ModuleSpec) with an LM or scalar head per role
  checkpoint/    Hugging Face <-> Megatron conversion and distributed checkpoints
  generation/    the batched, KV-cached rollout engine
  data/          indexed datasets (tools/preprocess_data.py), loaders, collators, tokenizer
  reward/        Reward Model and Advantage Model: losses, training, scoring, calibration
  rehearsal/     Selective Rehearsal curation: embeddings, FAISS k-means, top-k selection
  ppo/           rollout -> score -> advantages -> update, with the rehearsal NLL term
  kernels        (top-level kernels/) fused log-probs over vocab shards, KL and GAE
"""

import warnings

__version__ = "0.1.0"

# Megatron-Core warns at import, on every machine without Transformer Engine or Apex, that it
# falls back to its local PyTorch implementations: the intended path on CPU. Said once instead,
# by ``python -m megatron_rlhf --version`` and in the README.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
