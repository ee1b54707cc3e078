"""One BLOOM trunk on Megatron-Core with a head per RLHF role.

- ``head="lm"``: tied LM head (actor, reference); the last stage returns this rank's vocab
  shard of the logits, (B, S, V_padded / tp). Padded vocab entries get the dtype's lowest
  value so they never receive probability (parity with the unpadded Hugging Face model).
- ``head="scalar"``: BLOOM's final LayerNorm and ``nn.Linear(h, num_outputs)`` (critic: values;
  reward model: r; advantage model: r and e_tau); the last stage returns (B, S, num_outputs).

BLOOM specifics on top of ``GPTModel``: no position embedding (ALiBi lives in the core
attention), a LayerNorm right after the word embedding, and the BLOOM layer spec.

Device and dtype: every parameter and buffer is created on ``device`` (default: the compute
device, this process's GPU or the CPU) in ``params_dtype``, the LayerNorms and the scalar head
included; nothing is moved afterwards. fp32 by design in a bf16 model: the ALiBi slopes (buffers,
so the bias is exact), the attention scores and softmax, and the scalar head's outputs (cast to
fp32 after the bf16 matmul, so losses and rewards are reduced in fp32). ``forward`` takes its
inputs on the model's device and refuses others; callers place batches with ``compute_device()``.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from megatron_rlhf.distributed.cpu_compat import tensor_cuda_is_identity
from megatron_rlhf.distributed.parallel import compute_device, current_groups
from megatron_rlhf.kernels.alibi_attention import alibi_loop_bounds, fused_alibi_available
from megatron_rlhf.models.bloom.alibi import positions_from_mask
from megatron_rlhf.models.bloom.attention import rank_slopes
from megatron_rlhf.models.bloom.config import (
    BloomArchitecture,
    padded_vocab_size,
    transformer_config,
)
from megatron_rlhf.models.bloom.layers import BloomLayerNorm
from megatron_rlhf.models.bloom.spec import bloom_block_spec, resolve_attention_backend
from megatron_rlhf.models.bloom.vocab import BloomOutputLayer, BloomWordEmbedding

HEADS = ("lm", "scalar")


def attention_mask_for(padding_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """Megatron's boolean mask (B, 1, Sq, Sk), True = masked, from a key mask (B, Sk).

    The key mask is 0 on padding and, on real tokens, 1, or the id of the sequence the token
    belongs to when several sequences are packed in one row (ids increasing along the row:
    ``1 1 1 2 2 3 0 0``). Queries are the last ``query_length`` positions (all of them, or the
    new ones after a KV cache); each sees the real keys of its own sequence at or before its own
    position: block-diagonal causal attention for a packed row, plain causal for a padded one.
    """
    segments = padding_mask.long()  # (B, Sk)
    key_length = segments.shape[1]
    query_positions = torch.arange(key_length - query_length, key_length, device=segments.device)
    key_positions = torch.arange(key_length, device=segments.device)
    causal = key_positions[None, :] <= query_positions[:, None]  # (Sq, Sk)
    query_segments = segments[:, key_length - query_length :, None]  # (B, Sq, 1)
    # a padding query (its output unused) sees every real key before it, as before packing
    same = (query_segments == segments[:, None, :]) | (query_segments == 0)  # (B, Sq, Sk)
    allowed = causal[None] & same & (segments > 0)[:, None, :]
    return ~allowed[:, None]


class BloomModel(GPTModel):
    """BLOOM as a Megatron-Core GPTModel; see the module docstring for the heads."""

    def __init__(
        self,
        arch: BloomArchitecture,
        *,
        head: str = "lm",
        num_scalar_outputs: int = 1,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
        use_te_attention: bool | None = None,
        recompute_activations: bool = False,
        init_weights: bool = True,
        device: torch.device | str | None = None,
        pg_collection=None,
    ):
        """``pg_collection``: the model's Megatron-Core ``ProcessGroupCollection`` (its TP, PP,
        ... groups), kept as ``self.pg_collection``; default: the groups in force now.
        ``attention_backend``: auto | triton | te | torch (``spec.resolve_attention_backend``;
        ``use_te_attention`` is the older switch), kept resolved as ``self.attention_backend``."""
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        device = compute_device() if device is None else torch.device(device)
        pg_collection = current_groups() if pg_collection is None else pg_collection
        tp = pg_collection.tp.size()
        pp, pp_rank = pg_collection.pp.size(), pg_collection.pp.rank()
        config = transformer_config(
            arch,
            tp=tp,
            pp=pp,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            recompute_activations=recompute_activations,
            device=device,
        )
        config.perform_initialization = init_weights  # False when a checkpoint overwrites all
        pre_process, post_process = pp_rank == 0, pp_rank == pp - 1
        backend = resolve_attention_backend(
            attention_backend, device, use_te_attention,
            dtype=params_dtype, head_dim=arch.hidden_size // arch.num_heads,
        )  # fmt: skip
        slopes = rank_slopes(arch.num_heads, pg_collection).to(device)  # one for every layer
        spec = bloom_block_spec(get_num_layers_to_build(config, pp_rank=pp_rank), backend, slopes)
        # Megatron-Core creates its CPU-initialised tensors (and we create ours) on the default
        # device; on a GPU it passes torch.cuda.current_device() itself, the same device.
        # tensor_cuda_is_identity: language_module.py:244 calls weight.data.cuda() (CPU only).
        with torch.device(device), tensor_cuda_is_identity():
            super().__init__(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size(arch.vocab_size, tp),
                max_sequence_length=arch.max_sequence_length,
                pre_process=pre_process,
                post_process=post_process and head == "lm",
                parallel_output=True,
                share_embeddings_and_output_weights=head == "lm",  # no LM head to tie to otherwise
                position_embedding_type="none",
                pg_collection=pg_collection,
            )
            self._add_bloom_modules(arch, head, num_scalar_outputs, pre_process, post_process)
        if not init_weights:
            mark_tensor_parallel_weights(self)
        self.attention_backend = backend
        self.uses_te_attention = backend == "te"

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron-Core's sharded state dict, its replica ids taken from this model's own
        data-parallel group (Megatron-Core falls back to the global state without one)."""
        metadata = dict(metadata or {})
        metadata.setdefault("dp_cp_group", self.pg_collection.dp_cp)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def tie_embeddings_and_output_weights_state_dict(
        self, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key, metadata
    ) -> None:
        """Megatron-Core's, with the last stage's copy of the tied embedding given its replica id
        from this model's own data-parallel group (0.16.1 reads the global one there,
        language_module.py:352). Other stages: Megatron-Core's own."""
        if not self.post_process or self.pre_process:
            return super().tie_embeddings_and_output_weights_state_dict(
                sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key, metadata
            )
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        del sharded_state_dict[output_layer_weight_key]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(),
            key=first_stage_word_emb_key,
            replica_id=(1, 0, self.pg_collection.dp_cp.rank()),  # a copy of the first stage's
            allow_shape_mismatch=True,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

    def _add_bloom_modules(self, arch, head, num_scalar_outputs, pre_process, post_process):
        """BLOOM's embedding LayerNorm and, on the last stage, the scalar head and its norm."""
        config, tp = self.config, self.config.tensor_model_parallel_size
        self.arch = arch
        self.head = head
        self.num_scalar_outputs = num_scalar_outputs if head == "scalar" else 0
        self.is_last_stage = post_process
        if pre_process:
            self.embedding.word_embeddings.__class__ = BloomWordEmbedding  # models/bloom/vocab.py
            self.embedding.word_embeddings_layernorm = BloomLayerNorm(
                config, arch.hidden_size, eps=arch.layer_norm_epsilon
            )
            self.embedding.register_forward_hook(_apply_embedding_layernorm)
        if post_process and head == "scalar":
            self.final_layernorm = BloomLayerNorm(
                config, arch.hidden_size, eps=arch.layer_norm_epsilon
            )
            self.scalar_head = torch.nn.Linear(
                arch.hidden_size, num_scalar_outputs, dtype=config.params_dtype
            )
            init_replicated_head(self.scalar_head, std=config.init_method_std)
        if post_process and head == "lm":
            vocab_start = self.vocab_size // tp * self.pg_collection.tp.rank()
            self.num_valid_local_vocab = max(
                0, min(self.vocab_size // tp, arch.vocab_size - vocab_start)
            )
            self.output_layer.__class__ = BloomOutputLayer  # models/bloom/vocab.py
            self._output_positions = None  # set for the length of one forward
            self.output_layer.register_forward_pre_hook(
                partial(_select_output_positions, weakref.ref(self)), with_kwargs=True
            )

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, Sq) token ids (ignored on non-first pipeline stages)
        padding_mask: torch.Tensor,  # (B, Sk) 0 = padding, 1 (or a packed sequence's id) = real
        *,
        inference_context=None,
        runtime_gather_output: bool | None = None,
        output_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last stage's vocab shard of the logits (B, S, V/tp) (scalar head: (B, S, n)),
        other stages' activations (S, B, H). ``output_positions`` (K,): only those columns'
        outputs, (B, K, ...); for the LM head the vocabulary projection then runs on K
        positions only (the positions that predict a response token: in PPO scoring and the
        actor's update most of a row is prompt, whose logits nobody reads), except under
        sequence parallelism, where the hidden states are split by position and the columns
        are taken from the full logits."""
        self._check_device(input_ids, padding_mask)
        query_length = input_ids.shape[1]
        packed = self._packed_sequences(padding_mask, query_length, inference_context)
        if packed is not None:  # one row of sequences: attention within each, no T x T mask
            attention_mask, key_positions = None, None
        elif self.attention_backend == "triton":
            attention_mask, key_positions = self._fused_attention_inputs(
                padding_mask, query_length, inference_context
            )
        else:
            attention_mask = attention_mask_for(padding_mask, query_length)
            key_positions = self._key_positions(padding_mask, query_length)
        select_first = (
            output_positions is not None and self.head == "lm" and not self.config.sequence_parallel
        )
        if select_first:
            self._output_positions = output_positions
        try:
            output = super().forward(
                input_ids=input_ids,
                position_ids=None,
                attention_mask=attention_mask,
                inference_context=inference_context,
                runtime_gather_output=runtime_gather_output,
                packed_seq_params=packed,
                extra_block_kwargs={"attention_bias": key_positions},
            )
        finally:
            if select_first:
                self._output_positions = None
        if not self.is_last_stage:
            return output  # (S, B, H) activations for the next stage
        if self.head == "scalar":
            output = self._scalar_outputs(output)
        else:
            output = self._mask_padded_vocab(output)
        if output_positions is not None and not select_first:
            output = output[:, output_positions]
        return output

    @property
    def device(self) -> torch.device:
        """Where this model's parameters live (every pipeline stage has some)."""
        return next(self.parameters()).device

    def _check_device(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> None:
        device = self.device
        for name, tensor in (("input_ids", input_ids), ("padding_mask", padding_mask)):
            if tensor.device != device:
                raise ValueError(
                    f"BloomModel.forward: {name} is on {tensor.device}, the model on {device}; "
                    "move batches with megatron_rlhf.distributed.compute_device()"
                )

    def _packed_sequences(self, padding_mask: torch.Tensor, query_length: int, context):
        """Megatron's THD ``PackedSeqParams`` for one packed row (a (1, S) mask holding sequence
        ids 1..k, k > 1; data/packing.py) on the PyTorch or Triton attention path, whose core
        attention then runs each sequence alone (models/bloom/attention.py): the cost of k short
        sequences, not of one S x S score matrix. ``cu_seqlens`` ends at the last real token:
        trailing padding (id 0) gets no attention (its outputs are unused). None (the masked
        path) for anything else: a KV cache, TE layers, sequence parallelism (the row is split
        over TP ranks), a padded batch."""
        if (
            padding_mask.shape[0] != 1
            or context is not None
            or query_length != padding_mask.shape[1]
            or self.uses_te_attention
            or self.config.sequence_parallel
            or int(padding_mask.max()) < 2
        ):
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        segments = padding_mask[0]
        real = int(torch.nonzero(segments)[-1, 0]) + 1  # tokens up to the last real one
        changes = torch.nonzero(segments[1:real] != segments[: real - 1])[:, 0] + 1
        ends = torch.tensor([0, *changes.tolist(), real], dtype=torch.int32)
        longest = int((ends[1:] - ends[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=ends, cu_seqlens_kv=ends,
            max_seqlen_q=longest, max_seqlen_kv=longest,
        )  # fmt: skip

    def _key_positions(self, padding_mask: torch.Tensor, query_length: int):
        """Megatron's ``attention_bias`` for every layer: fp32 key positions (B, Sk) counted from
        the first real token of each row (of each packed sequence), from which the core attention builds the query-relative
        ALiBi bias; None for a batch TE takes (TE layers, no KV cache, every row
        right-padded), decided here once per forward (one host sync, TE layers only)."""
        if (
            self.uses_te_attention
            and query_length == padding_mask.shape[1]
            and bool((padding_mask[:, :-1] >= padding_mask[:, 1:]).all())
        ):
            return None
        return positions_from_mask(padding_mask).float()

    def _fused_attention_inputs(self, padding_mask: torch.Tensor, query_length: int, context):
        """The Triton core attention's (mask, ``attention_bias``): key positions and segment ids
        (B, 2, Sk) fp32, and no (B, 1, Sq, Sk) mask when the kernel runs (no KV cache, Triton
        usable on this device), else the mask for the PyTorch path. When the kernel runs, the
        bias also carries its loop bounds (B, 4, Sk): built here once per forward, not in every
        layer (``alibi_loop_bounds``; values below 2**24, exact in fp32)."""
        key_info = [positions_from_mask(padding_mask), padding_mask.long()]
        activations = padding_mask.new_empty(0, dtype=self.config.params_dtype)  # dtype, device
        runs = context is None and fused_alibi_available(activations)
        if runs:
            key_info += alibi_loop_bounds(padding_mask).unbind(1)
        mask = None if runs else attention_mask_for(padding_mask, query_length)
        return mask, torch.stack(key_info, 1).float()

    def _scalar_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        # Under SP the norm sees this rank's (S/tp, B, H) tokens, so its sequence-parallel
        # gradients are partial sums, as the TP all-reduce of finalize_model_grads expects.
        hidden = self.final_layernorm(hidden)  # (S, B, H)
        if self.config.sequence_parallel:
            # Every TP rank applies the replicated head to the whole sequence: the backward
            # must only split the gradient, not reduce-scatter (sum) tp equal copies.
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.pg_collection.tp
            )
        return self.scalar_head(hidden).transpose(0, 1).float()  # (B, S, num_outputs)

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        if local_vocab == self.vocab_size:  # gathered over TP for generation
            valid = self.arch.vocab_size
        else:
            valid = self.num_valid_local_vocab
        if valid < local_vocab:
            if torch.is_grad_enabled():
                logits = logits.clone()
            logits[..., valid:] = torch.finfo(logits.dtype).min
        return logits


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give every tensor-parallel layer's weight its TP attributes (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``).

    Megatron-Core 0.16.1 sets them only inside the weight initialisers
    (tensor_parallel/layers.py:244, 265, 855, 877), so a model built with
    ``perform_initialization=False`` (every model loaded from a checkpoint) has TP-sharded weights
    that look replicated: the optimizer's gradient norm then counts TP rank 0's shard only, and
    gradient clipping at TP > 1 differs from TP = 1.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    partition_dims = (
        (ColumnParallelLinear, 0),  # output features (the weight is stored transposed)
        (VocabParallelEmbedding, 0),  # vocabulary rows
        (RowParallelLinear, 1),  # input features
    )
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        for kind, dim in partition_dims:
            if isinstance(module, kind):
                set_tensor_model_parallel_attributes(weight, True, dim, 1)
                break


def init_replicated_head(linear: torch.nn.Linear, std: float) -> None:
    """Initialise a TP-replicated head identically on every rank (its own fixed-seed RNG)."""
    generator = torch.Generator().manual_seed(20230918)  # drawn on the CPU, the same everywhere
    weight = torch.randn(linear.weight.shape, generator=generator, device="cpu") * std
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.zero_()


def _select_output_positions(model_ref, output_layer, args, kwargs):
    """Forward pre-hook of the LM head: keep the hidden states (S, B, H) of the columns
    ``BloomModel.forward`` was asked for (its ``_output_positions``, set only during a call)."""
    model = model_ref()
    positions = None if model is None else model._output_positions
    if positions is None:
        return None
    return (args[0].index_select(0, positions), *args[1:]), kwargs


def _apply_embedding_layernorm(module, inputs, embeddings):
    """BLOOM's ``word_embeddings_layernorm``, applied to the (S, B, H) embedding output."""
    return module.word_embeddings_layernorm(embeddings)
