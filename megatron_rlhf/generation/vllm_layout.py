"""vLLM's sharding of a BLOOM: the layout the shard-to-shard sync (``generation/shard_sync.py``)
writes into vLLM's parameters (``generation/vllm_engine.py``).

vLLM shards a BLOOM by its own rules (``vllm/model_executor/models/bloom.py``):

- ``query_key_value`` (QKVParallelLinear): rank ``r`` of ``T`` holds the heads
  ``[r H/T, (r+1) H/T)`` laid out ``[q; k; v]`` (each ``H/T x head_dim`` rows); HF and our
  Megatron-Core ``linear_qkv`` lay the same heads out ``(head, 3, head_dim)`` (MHA: one query
  group per head). A rank's heads are one contiguous block of HF rows, so its shard is a row
  range of the HF tensor, permuted ``(h, 3, d) -> (3, h, d)`` as it is written (the plan's
  ``qkv`` kind).
- ``dense_h_to_4h`` (ColumnParallelLinear): rows ``[r N/T, (r+1) N/T)``, bias too;
  ``dense`` and ``dense_4h_to_h`` (RowParallelLinear): columns, the bias whole on every rank.
- ``word_embeddings`` (VocabParallelEmbedding, tied to the LM head): the vocabulary padded to
  a multiple of 64, split in ``T`` equal row blocks; rows past the real vocabulary are zero.
  Megatron pads its own way (to 128 x TP); real rows are row ``i`` in both.
- layer norms: whole on every rank.

``VLLMGenerator.check_shards`` compares these rules with the live vLLM model before the first
sync, and the engine streams full tensors instead where they do not hold.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_rlhf.generation.shard_sync import TensorSpec, plan_from_actor, vocab_rows

VLLM_VOCAB_PADDING = (
    64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
)


def vllm_vocab_rows(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """vLLM's vocabulary shard of rank ``rank`` of ``tp``: (first row, end of the real rows,
    rows in the shard incl. padding), as ``VocabParallelEmbedding._get_indices``."""
    return vocab_rows(vocab, tp, rank, VLLM_VOCAB_PADDING)


def vllm_target(spec: TensorSpec) -> TensorSpec:
    """``spec`` as vLLM shards it over the rollout TP: the vocabulary padded to a multiple of
    :data:`VLLM_VOCAB_PADDING`, a fused QKV's shard ``[q; k; v]`` (its ``qkv`` kind kept)."""
    if spec.kind == "vocab":
        return replace(spec, vocab_multiple=VLLM_VOCAB_PADDING)
    return spec


def vllm_plan(model, rollout_tp_group, bucket_bytes: int, canonical_order: list[str]):
    """This rank's plan from the actor ``model`` into vLLM's shards at the TP of
    ``rollout_tp_group`` (collective over the world), and its sources:
    ``shard_sync.plan_from_actor`` with vLLM's rules."""
    return plan_from_actor(model, rollout_tp_group, bucket_bytes, canonical_order, vllm_target)
