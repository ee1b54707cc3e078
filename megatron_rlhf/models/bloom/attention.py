"""Core attention with ALiBi for Megatron-Core's ``SelfAttention`` (the ``core_attention`` slot).

Megatron-Core 0.16.1 has no ALiBi: its local ``DotProductAttention`` asserts ``attention_bias is
None`` and ``TEDotProductAttention`` never passes ``"alibi"``. :class:`AlibiDotProductAttention`
is a pure-PyTorch core attention computing the attention of transformers' ``BloomAttention``:

    scores = (q . k) / sqrt(d) + slope_h * (pos_k - pos_q)     (fp32; positions from the mask)
    probs  = softmax_fp32(scores masked with the causal + padding mask)
    out    = probs @ v

How this departs from transformers: BLOOM adds ``slope_h * pos_k`` (the key's absolute position)
in the model's dtype. A softmax row does not change when a constant is added to it, so the bias
relative to the query, ``slope_h * (pos_k - pos_q)``, gives the same probabilities; it is small
for the near keys that carry the weight, and it is added in fp32 to fp32 scores. In bf16 the
absolute bias of a key 1,000 tokens in is ~700 for the steepest head, where one bf16 step is 4:
logits drift with length (max error 3.3 at 1,024 tokens against 0.3 at 64).

Key positions come from the padding mask (``BloomModel`` passes them as Megatron's
``attention_bias``, fp32 (B, Sk)), so left-padded rows see the same biases as their unpadded
selves; queries are the last Sq keys (all of them, or the new ones after a KV cache). The mask is
Megatron's boolean convention (True = masked), shape (B, 1, Sq, Sk). A packed row (several
sequences back to back) comes in Megatron-Core's THD layout instead (``PackedSeqParams``, from
``BloomModel``): :func:`packed_alibi_attention` runs each sequence alone, causal, positions
from its first token, which is the block-diagonal mask's result without the T x T scores.

Three core attentions, chosen by ``BloomModel``'s ``attention_backend`` (``spec.py``):
- ``torch``: :class:`AlibiDotProductAttention`, the functions above. O(S^2) memory per layer
  (fp32 scores of every head).
- ``triton``: :class:`FusedAlibiDotProductAttention`, the same math as one fused Triton kernel
  (``megatron_rlhf.kernels.alibi_attention``): fp32 relative bias and softmax, O(S) extra memory
  (the log-sum-exp), for training, scoring and prefill, packed and padded rows. ``BloomModel``
  then passes ``attention_bias`` as (B, 2, Sk): key positions and key segment ids (the key mask),
  plus the kernel's loop bounds (B, 4, Sk) when it runs, and no (B, 1, S, S) mask unless a KV
  cache is in use (decode takes the PyTorch path).
- ``te``: :class:`TEAlibiDotProductAttention` (GPU, when transformer-engine imports), for
  full-length right-padded batches (``BloomModel`` decides once per forward and then passes no
  positions); everything else takes the PyTorch path. This is *not* a fused ALiBi kernel: with
  explicit slopes TE turns ALiBi into a ``post_scale_bias``, cuDNN refuses a bias with padding
  masks and flash-attn is not a dependency, so TE runs ``UnfusedDotProductAttention``, which
  materialises a (B, H, S, S) fp32 bias and rounds score + bias to bf16 before the softmax: O(S^2)
  memory like the PyTorch path, and bf16 numerics that differ from generation's fp32 bias.

Slopes: one fp32 tensor per (model, TP rank), shared by every layer's core attention
(``BloomModel`` builds it and passes it through the layer spec); a non-persistent buffer, so
state dicts do not hold it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_rlhf.distributed.parallel import current_groups
from megatron_rlhf.kernels.alibi_attention import (
    fused_alibi_attention,
    fused_alibi_available,
    fused_packed_alibi_attention,
)
from megatron_rlhf.models.bloom.alibi import alibi_slopes_for_rank
from megatron_rlhf.models.precision import cpu_autocast


def _tp_rank_and_size(pg_collection) -> tuple[int, int]:
    """This rank's place in the model's TP group (Megatron passes the model's groups to its
    core attention; built alone, the groups in force)."""
    tp_group = (pg_collection or current_groups()).tp
    return tp_group.rank(), tp_group.size()


def rank_slopes(num_heads: int, pg_collection=None) -> torch.Tensor:
    """This TP rank's ALiBi slopes (H/tp,), fp32, on the default device (``BloomModel`` builds
    under ``torch.device(compute device)``)."""
    tp_rank, tp_size = _tp_rank_and_size(pg_collection)
    return alibi_slopes_for_rank(num_heads, tp_rank, tp_size)


def _register_rank_slopes(
    module: torch.nn.Module, num_heads: int, pg_collection, slopes: torch.Tensor | None
) -> None:
    """``module.slopes``: ``slopes`` (the model's one tensor for this TP rank) or, for a module
    built alone, this rank's own; a non-persistent buffer."""
    if slopes is None:
        slopes = rank_slopes(num_heads, pg_collection)
    module.register_buffer("slopes", slopes, persistent=False)


def alibi_attention(
    query: torch.Tensor,  # (Sq, B, H, D)
    key: torch.Tensor,  # (Sk, B, H, D)
    value: torch.Tensor,  # (Sk, B, H, D)
    attention_mask: torch.Tensor,  # (B, 1, Sq, Sk) bool, True = masked
    key_positions: torch.Tensor,  # (B, Sk) fp32, counted from each row's first real token
    slopes: torch.Tensor,  # (H,) fp32
    softmax_scale: float,
    dropout: torch.nn.Module | None = None,
) -> torch.Tensor:
    """ALiBi attention with the bias relative to the query, in fp32; returns (Sq, B, H*D)."""
    if cpu_autocast(query):
        # bf16 on a CPU (models/precision.py): the two batched products here are a few per cent
        # of a layer's FLOP at these lengths and oneDNN's bf16 kernels are slower than fp32's
        # at their small per-head sizes (a BLOOM-560m-shaped decode: 1.52 s against 1.60 s),
        # so they stay fp32, with fp32 softmax as before
        with torch.autocast("cpu", enabled=False):
            args = (query.float(), key.float(), value.float(), attention_mask, key_positions)
            return alibi_attention(*args, slopes, softmax_scale, dropout)
    sq, batch, heads, dim = query.shape
    sk = key.shape[0]
    q = query.permute(1, 2, 0, 3).reshape(batch * heads, sq, dim)
    k = key.permute(1, 2, 3, 0).reshape(batch * heads, dim, sk)
    v = value.permute(1, 2, 0, 3).reshape(batch * heads, sk, dim)
    scores = torch.bmm(q, k).view(batch, heads, sq, sk).float().mul_(softmax_scale)
    key_positions = key_positions.float()
    relative = key_positions[:, None, :] - key_positions[:, sk - sq :, None]  # (B, Sq, Sk)
    scores = scores.addcmul_(slopes.float().view(1, heads, 1, 1), relative[:, None])
    scores = scores.masked_fill_(attention_mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # (B, H, Sq, Sk)
    if dropout is not None:
        probs = dropout(probs)
    context = torch.bmm(probs.view(batch * heads, sq, sk), v)  # (B*H, Sq, D)
    return context.view(batch, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, batch, -1)


def packed_alibi_attention(
    query: torch.Tensor,  # (T, H, D): sequences back to back (Megatron's THD layout)
    key: torch.Tensor,  # (T, H, D)
    value: torch.Tensor,  # (T, H, D)
    cu_seqlens: torch.Tensor,  # (k + 1,) where each sequence starts, then T
    slopes: torch.Tensor,  # (H,) fp32
    softmax_scale: float,
    dropout: torch.nn.Module | None = None,
) -> torch.Tensor:
    """:func:`alibi_attention` of each sequence alone (causal, positions from its first
    token): what the block-diagonal mask of a packed row computes, without the T x T scores.
    Tokens after ``cu_seqlens[-1]`` (trailing padding) get zeros. Returns (T, 1, H*D)."""
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    padding = query.shape[0] - bounds[-1]
    lengths.append(padding)  # split off with the rest; no attention computed
    outputs = []
    # split, not slices: a slice's backward writes a zero tensor of all T tokens per sequence
    for q, k, v in list(zip(*(t.split(lengths) for t in (query, key, value))))[:-1]:
        length = q.shape[0]
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu_(1)
        positions = torch.arange(length, dtype=torch.float32, device=query.device)[None]
        outputs.append(
            alibi_attention(
                q[:, None],
                k[:, None],
                v[:, None],
                causal[None, None],
                positions,
                slopes,
                softmax_scale,
                dropout,
            )
        )
    if padding:
        outputs.append(query.new_zeros(padding, 1, query.shape[1] * value.shape[2]))
    return torch.cat(outputs)


class AlibiDotProductAttention(MegatronModule):
    """ALiBi attention over this rank's heads; tensors are (S, B, heads_per_rank, head_dim)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        slopes: torch.Tensor | None = None,
    ):
        super().__init__(config=config)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        _register_rank_slopes(self, config.num_attention_heads, pg_collection, slopes)

    def forward(
        self,
        query: torch.Tensor,  # (Sq, B, H/tp, D)
        key: torch.Tensor,  # (Sk, B, H/tp, D)
        value: torch.Tensor,  # (Sk, B, H/tp, D)
        attention_mask: torch.Tensor,  # (B, 1, Sq, Sk) bool, True = masked
        attn_mask_type=None,
        attention_bias=None,  # (B, Sk) fp32 key positions, from BloomModel
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError("ALiBi attention takes packed sequences in THD only")
            return packed_alibi_attention(
                query, key, value, packed_seq_params.cu_seqlens_q, self.slopes,
                self.softmax_scale, self.dropout,
            )  # fmt: skip
        if attention_mask is None or attention_bias is None:
            raise ValueError(
                "BLOOM attention needs the causal+padding mask and the key positions (BloomModel "
                "passes both)"
            )
        return alibi_attention(
            query, key, value, attention_mask, attention_bias, self.slopes,
            self.softmax_scale, self.dropout,
        )  # fmt: skip

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


class FusedAlibiDotProductAttention(AlibiDotProductAttention):
    """:class:`AlibiDotProductAttention` through the fused Triton kernel where it runs (CUDA with
    a working Triton, or ``TRITON_INTERPRET=1``), no attention dropout active, and every query
    is new (Sq = Sk: training, scoring, prefill); otherwise the PyTorch path (decode with a KV
    cache). ``attention_bias`` is (B, 2, Sk): key positions and key segment ids, or (B, 4, Sk)
    with the kernel's loop bounds after them (``alibi_loop_bounds``, built once per forward);
    BloomModel builds no (B, 1, Sq, Sk) mask (``attention_mask`` None) when the kernel will run."""

    def forward(
        self,
        query: torch.Tensor,  # (Sq, B, H/tp, D)
        key: torch.Tensor,  # (Sk, B, H/tp, D)
        value: torch.Tensor,  # (Sk, B, H/tp, D)
        attention_mask: torch.Tensor | None,  # (B, 1, Sq, Sk) bool, or None
        attn_mask_type=None,
        attention_bias=None,  # (B, 2 or 4, Sk) fp32 key positions, segment ids (, loop bounds)
        packed_seq_params=None,
    ) -> torch.Tensor:
        fused = fused_alibi_available(query) and not (self.training and self.dropout.p > 0)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd" and fused:
            return fused_packed_alibi_attention(
                query, key, value, packed_seq_params.cu_seqlens_q, self.slopes, self.softmax_scale
            )
        if packed_seq_params is not None:
            return super().forward(query, key, value, None, packed_seq_params=packed_seq_params)
        if attention_bias is None or attention_bias.dim() != 3:
            raise ValueError(
                "the Triton BLOOM attention takes attention_bias (B, 2, Sk): key positions and "
                "segment ids (BloomModel passes them with attention_backend='triton')"
            )
        if fused and query.shape[0] == key.shape[0]:
            bounds = attention_bias[:, 2:4] if attention_bias.shape[1] == 4 else None
            return fused_alibi_attention(
                query, key, value, attention_bias[:, 0], attention_bias[:, 1], self.slopes,
                self.softmax_scale, loop_bounds=bounds,
            )  # fmt: skip
        if attention_mask is None:
            raise ValueError(
                "the Triton kernel cannot run here (no CUDA Triton, active attention dropout or "
                "a KV cache) and no attention mask was given"
            )
        return super().forward(
            query, key, value, attention_mask, attention_bias=attention_bias[:, 0]
        )


_te_import_failure_warned = False


def _import_te_attention():
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention


def te_attention_class():
    """TransformerEngine's DotProductAttention, or None when TE is not importable. When TE is
    installed but fails to import on a CUDA machine (a CUDA, cuDNN or driver mismatch), this
    warns once, naming the error: TE attention is then off in every command."""
    global _te_import_failure_warned
    try:
        return _import_te_attention()
    except Exception as err:  # ImportError, or a CUDA/driver error inside TE's import
        installed = importlib.util.find_spec("transformer_engine") is not None
        if installed and torch.cuda.is_available() and not _te_import_failure_warned:
            _te_import_failure_warned = True
            warnings.warn(
                f"transformer-engine is installed but does not import on this CUDA machine "
                f"({type(err).__name__}: {err}); TE attention is OFF in every model. Fix the "
                "install (its CUDA/cuDNN build must match torch's) or uninstall it.",
                RuntimeWarning,
                stacklevel=2,
            )
        return None


def drop_missing_extra_state(module: torch.nn.Module) -> None:
    """Let strict loads pass without the ``_extra_state`` of ``module``'s submodules.

    TransformerEngine modules carry ``_extra_state`` in their ``state_dict`` (FP8 scaling
    metadata). Our checkpoints do not save it: core attention has no weights, its
    ``sharded_state_dict`` is empty, and no FP8 recipe is used, so TE's freshly built state is
    the right one after a load. This post-hook removes those keys from a load's missing keys,
    so every strict ``load_state_dict`` (checkpoints, resume, conversion, evaluation) passes.
    """

    def hook(_module, incompatible_keys):
        missing = incompatible_keys.missing_keys
        missing[:] = [name for name in missing if not name.endswith("._extra_state")]

    module.register_load_state_dict_post_hook(hook)


def te_alibi_cache(te_attention: torch.nn.Module) -> dict | None:
    """TransformerEngine's process-wide ALiBi cache (``_alibi_cache`` of the module that defines
    its DotProductAttention), or None when this TE version keeps it elsewhere."""
    module = sys.modules.get(type(te_attention).__module__)
    cache = getattr(module, "_alibi_cache", None)
    return cache if isinstance(cache, dict) and "_alibi_slopes" in cache else None


class TEAlibiDotProductAttention(MegatronModule):
    """GPU path: TE's DotProductAttention with ALiBi and this TP rank's slopes passed explicitly.

    What TE runs then is its *unfused* attention (see the module docstring): a (B, H, S, S) fp32
    bias, score + bias rounded to bf16 before the softmax. TE's default slopes come from the
    *local* head count, which is wrong under TP, so this rank's slice of the global slopes is
    passed on every call. TE keeps one ALiBi cache per process (its bias included) and refreshes
    it only in its layer number 1: when the cached slopes are not this model's (another model
    with as many heads per rank, a later pipeline stage), the refresh is forced; every layer of
    one model shares one slopes tensor, so that happens once per model, not once per layer. TE
    reduces a padding mask to per-row valid-token counts (right-padding semantics), so
    ``BloomModel`` passes key positions (``attention_bias``) for batches TE cannot take (left
    padding, a KV cache), which then run :func:`alibi_attention`.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config=config)
        te_attention = te_attention_class()
        if te_attention is None:
            raise ImportError("transformer-engine is not importable")
        _tp_rank, tp_size = _tp_rank_and_size(kwargs.get("pg_collection"))
        self.heads_per_rank = divide(config.num_attention_heads, tp_size)
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        _register_rank_slopes(
            self, config.num_attention_heads, kwargs.get("pg_collection"), kwargs.get("slopes")
        )
        self.te_attention = te_attention(
            num_attention_heads=self.heads_per_rank,
            kv_channels=config.kv_channels,
            attention_dropout=config.attention_dropout,
            qkv_format="sbhd",
            attn_mask_type="padding_causal",
            layer_number=layer_number,
        )
        drop_missing_extra_state(self)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        key_positions = kwargs.get("attention_bias")
        if key_positions is not None:  # left padding or a KV cache: not for TE's kernels
            return alibi_attention(
                query, key, value, attention_mask, key_positions, self.slopes, self.softmax_scale
            )
        cache = te_alibi_cache(self.te_attention)
        if cache is not None and cache["_alibi_slopes"] is not self.slopes:
            cache["_alibi_slopes_require_update"] = True
            cache["_alibi_bias_require_update"] = True
        key_valid = ~attention_mask[:, 0, -1, :]  # (B, Sk)
        te_mask = ~key_valid[:, None, None, :]  # TE: True = masked, (B, 1, 1, Sk)
        context = self.te_attention(
            query,
            key,
            value,
            attention_mask=te_mask,
            core_attention_bias_type="alibi",
            alibi_slopes=self.slopes,
        )
        return context.reshape(query.shape[0], query.shape[1], -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}
