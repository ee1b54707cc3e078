"""Megatron-Core's BLOOM modules with a lean forward for inference (no autograd, eval mode).

A decode step of a small model is mostly Python: Megatron-Core's ``TransformerLayer``,
``SelfAttention`` and tensor-parallel linears handle recompute, activation offloading, cross
attention, RoPE, flash/dynamic decoding, FP8 and autograd ``Function``s for the TP regions on
every call, ~0.1 ms each, more than the matmuls of a 4x128 model (issue 11, item 6). With
autograd off and the module in eval mode (generation), none of that applies, so these
subclasses run the same submodules in the same order, and nothing else:

- linears: one ``F.linear`` on this rank's shard (on a CPU in fp32 our few-row kernel or
  oneDNN: ``models/cpu_linear.py``), + ``dist.all_reduce`` over the layer's own TP group for
  row-parallel, bias after the sum, as Megatron-Core orders it;
- attention: fused QKV -> BLOOM's [heads, 3, head_dim] split -> Megatron-Core's own static KV
  cache (``_adjust_key_value_for_inference``) -> the ALiBi core attention -> projection;
- layer: ``h += attn(ln(h))`` and ``h += mlp(ln(h))`` with the (skipped) biases added back;
  dropout is the identity in eval mode.

One training path of their own: on a CPU in fp32 at TP = 1 without sequence parallelism (the
linears communicate nothing), a training forward is ``vocab.linear``: the product through oneDNN
(``models/cpu_linear.py``, 1.3-1.6x MKL's at BLOOM-560m's 192-row shapes) and the weight
gradient added straight into Megatron's gradient buffer, as the LM head's (``vocab.py``), the
bias through autograd as before; a module in training mode without autograd (a trained model's
scoring pass) takes ``cpu_linear.linear`` itself. Anything else (autograd on elsewhere, sequence
parallelism, flash decoding, dynamic batching, a GPU) defers to Megatron-Core unchanged; parameters,
sharding and checkpoints are the parents'. The generation tests compare the tokens and
log-probs against transformers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_rlhf.models.bloom import vocab
from megatron_rlhf.models.cpu_linear import linear
from megatron_rlhf.models.precision import cpu_autocast


def _inference(module: torch.nn.Module) -> bool:
    return not (torch.is_grad_enabled() or module.training)


def _cpu_fp32_alone(layer, input_: torch.Tensor) -> bool:
    """Whether this linear runs on a CPU in fp32 outside autocast at TP = 1 without sequence
    parallelism (it communicates nothing): where :func:`_cpu_forward` may take it."""
    return (
        input_.device.type == "cpu"
        and not cpu_autocast(input_)
        and layer.tp_group.size() == 1
        and not layer.sequence_parallel
        and not layer.explicit_expert_comm
    )


def _cpu_forward(layer, input_: torch.Tensor):
    """A non-inference forward (a module in training mode) through our CPU fp32 path, or None:
    with autograd, for weights that opted in to accumulating into ``main_grad``
    (``vocab.opt_in``), ``vocab.linear``; without (a trained model's scoring pass, which stays
    in training mode), ``cpu_linear.linear``, oneDNN's product rather than Megatron-Core's
    autograd function's MKL ``matmul`` (the critic's scoring products 1.3-1.5x faster at
    BLOOM-560m's width, 192 rows)."""
    if not _cpu_fp32_alone(layer, input_):
        return None
    if not torch.is_grad_enabled():
        bias = None if layer.skip_bias_add else layer.bias
        return linear(input_, layer.weight, bias), (layer.bias if layer.skip_bias_add else None)
    if vocab.accumulates(layer.weight):
        return _add_bias(layer, vocab.linear(input_, layer.weight))
    return None


def _add_bias(layer, output: torch.Tensor):
    """A linear's (output, bias) as Megatron-Core returns them: the bias added, or handed on
    (``skip_bias_add``) for the fused bias-dropout-add or bias-GeLU."""
    if layer.skip_bias_add or layer.bias is None:
        return output, (layer.bias if layer.skip_bias_add else None)
    return output + layer.bias, None


class BloomColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear``; in inference one ``F.linear`` on this rank's rows."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        lean = _inference(self) and not (
            weight is not None
            or self.sequence_parallel
            or self.gather_output
            or runtime_gather_output
        )
        if not lean:
            output = None if weight is not None else _cpu_forward(self, input_)
            if output is not None:
                return output
            return super().forward(input_, weight, runtime_gather_output)
        bias = None if self.skip_bias_add else self.bias
        if bias is not None and cpu_autocast(input_):
            # Megatron-Core's training path adds the fp32 bias to the bf16 product (an fp32
            # sum); F.linear would round product + bias to bf16 (models/precision.py)
            output = linear(input_, self.weight) + bias
        else:
            output = linear(input_, self.weight, bias)
        return output, (self.bias if self.skip_bias_add else None)


class BloomRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear``; in inference ``F.linear`` on this rank's columns, the sum over the
    TP group, then the (replicated) bias."""

    def forward(self, input_):
        lean = _inference(self) and not (
            self.sequence_parallel or not self.input_is_parallel or self.explicit_expert_comm
        )
        if not lean:
            output = _cpu_forward(self, input_) if self.input_is_parallel else None
            if output is not None:
                return output
            return super().forward(input_)
        output = linear(input_, self.weight)
        if self.tp_group.size() > 1:
            dist.all_reduce(output, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


class BloomSelfAttention(SelfAttention):
    """``SelfAttention``; in inference (static KV cache or none, no flash decoding) QKV, cache,
    core attention and projection only."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        context = kwargs.get("inference_context")
        lean = (
            _inference(self)
            and not args
            and not self.config.flash_decode
            and (context is None or context.is_static_batching())
            and kwargs.get("rotary_pos_emb") is None
            and kwargs.get("packed_seq_params") is None
        )
        if not lean:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # (S, B, 3 * H/tp * D)
        sq, batch = mixed_qkv.shape[:2]
        head_dim = self.hidden_size_per_attention_head
        query, key, value = mixed_qkv.view(sq, batch, -1, 3 * head_dim).split(head_dim, dim=3)
        if context is not None:
            query, key, value, *_ = self._adjust_key_value_for_inference(
                context, query, key, value, None
            )
        core = self.core_attention(
            query, key, value, attention_mask, attention_bias=kwargs.get("attention_bias")
        )
        return self.linear_proj(core)


class BloomTransformerLayer(TransformerLayer):
    """``TransformerLayer``; in inference the two pre-LN residual blocks only."""

    def forward(self, *args, **kwargs):
        lean = (
            _inference(self)
            and not args
            and kwargs.get("context") is None
            and not self.config.inference_fuse_tp_communication
        )
        if not lean:
            return super().forward(*args, **kwargs)
        hidden = kwargs["hidden_states"]  # (S, B, H)
        output, bias = self.self_attention(
            self.input_layernorm(hidden),
            attention_mask=kwargs.get("attention_mask"),
            inference_context=kwargs.get("inference_context"),
            attention_bias=kwargs.get("attention_bias"),
            packed_seq_params=kwargs.get("packed_seq_params"),  # set: Megatron-Core's path
        )
        hidden = _residual_add(hidden, output, bias)
        output, bias = self.mlp(self.pre_mlp_layernorm(hidden))
        return _residual_add(hidden, output, bias), None


def _residual_add(residual: torch.Tensor, output: torch.Tensor, bias) -> torch.Tensor:
    """``residual + (output + bias)`` as Megatron-Core's bias-dropout-add forms it: under
    autocast (bf16 products, fp32 residual) the residual is first rounded to the product's
    dtype, so inference and training compute the same numbers (models/precision.py)."""
    if residual.dtype != output.dtype:
        residual = residual.to(output.dtype)
    return residual + (output if bias is None else output + bias)
