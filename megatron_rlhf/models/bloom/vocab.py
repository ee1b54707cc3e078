"""BLOOM's vocabulary layers: Megatron-Core's word embedding and tied LM head, with two CPU
costs of a 250,880-token vocabulary taken out. ``BloomModel`` gives its
``embedding.word_embeddings`` and ``output_layer`` these classes (parameters, sharding and
checkpoint names are the parents').

**Decode** (:func:`vocab_projection`): a few rows times the vocabulary, projected in slices.

**Gradients straight into Megatron's gradient buffer.** Megatron-Core's DDP keeps every
parameter's gradient in a preallocated buffer (``main_grad``) and adds each backward's
``param.grad`` into it. For the word embedding of BLOOM's vocabulary that means, per
micro-batch and role: the embedding's backward allocates and zeroes a dense vocab x hidden
tensor (1 GB at BLOOM-560m's width, fp32) to scatter a few hundred rows into, the tied LM
head's weight gradient allocates another, autograd sums the two, and DDP adds the sum into
``main_grad``. On a CPU each fresh gigabyte is page-faulted in (0.3-0.4 s on the benchmarks'
2-core machine): at BLOOM-560m's shapes this was ~5 s of a 12 s PPO update. Megatron-Core's
own cure, ``gradient_accumulation_fusion``, needs a CUDA extension and covers linears only.

Here, for a parameter that opts in (``TrainEngine`` marks its model's parameters: its DDP never
overlaps the gradient reduce with the backward, so no bucket waits on the gradient hook that
these skip):

- the embedding's backward ``index_add_``s the rows' gradients into ``main_grad``;
- the LM head's weight gradient is one ``addmm_`` into ``main_grad`` (the input gradient as
  before).

Both return no gradient for the weight, so ``param.grad`` stays None and DDP adds nothing; the
tied weight's ``main_grad`` receives both contributions. The sums are the ones autograd and DDP
form, in another order (equal to rounding: ``tests/test_bloom_units.py`` compares a step
against Megatron-Core's own layers). Used at tensor-parallel size 1 without sequence
parallelism, where neither layer communicates, and where ``main_grad`` has the weight's dtype
(fp32 weights); elsewhere Megatron-Core's layers run unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

from megatron_rlhf.models import cpu_linear
from megatron_rlhf.models.precision import bf16_copy

OPT_IN = "accumulate_into_main_grad"


def opt_in(module: torch.nn.Module) -> None:
    """Let the vocabulary layers of ``module`` (wrapped in Megatron DDP with
    ``overlap_grad_reduce=False``) accumulate into ``main_grad`` directly."""
    for param in module.parameters():
        setattr(param, OPT_IN, True)


def accumulates(weight: torch.Tensor) -> bool:
    """Whether a backward of this forward should write into ``weight.main_grad``."""
    return (
        torch.is_grad_enabled()
        and weight.requires_grad
        and getattr(weight, OPT_IN, False)
        and getattr(weight, "main_grad", None) is not None
        and weight.main_grad.dtype == weight.dtype
    )


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        rows = grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype)
        main_grad.index_add_(0, ids.reshape(-1), rows)
        return None, None


VOCAB_SLICE = 4_096
"""Vocabulary rows of a bf16 weight gradient formed at a time before their fp32 add: 8 MB at
BLOOM's width, into one bf16 and one fp32 scratch slice reused by every slice. (Slices of 16,384
rows with a fresh product and a fresh fp32 copy of it for each ``add_`` spent most of their time
page-faulting those copies in: 0.49 s for one micro-batch's (128 tokens) gradient at BLOOM-560m's
shapes on the 2-core benchmark machine, 0.16 s this way; the whole product in fp32 takes 0.27.)"""


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        operand = bf16_copy(weight)  # the weight, or its kept bf16 copy (models/precision.py)
        ctx.save_for_backward(hidden, weight, operand)
        return cpu_linear.linear(hidden, operand)  # oneDNN in fp32 on a CPU

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, operand = ctx.saved_tensors
        # one (tokens x V) @ (V x H) product, bf16 under autocast: a non-contiguous 3-D gradient
        # times a weight that does not require grad is otherwise a batched product over a copy
        # of the weight per token (oneDNN asked for 66 GB at BLOOM-560m's shapes)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_input = cpu_linear.linear(flat_grad, operand.t())  # flat_grad @ operand
        grad_input = grad_input.view(*grad.shape[:-1], operand.shape[1])
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        main_grad = weight.main_grad
        if flat_grad.dtype == main_grad.dtype:
            main_grad.addmm_(flat_grad.t(), flat_hidden.to(main_grad.dtype))
        else:  # bf16 products into the fp32 buffer, a vocabulary slice at a time
            flat_hidden = flat_hidden.to(flat_grad.dtype)
            size = (min(VOCAB_SLICE, main_grad.shape[0]), main_grad.shape[1])
            product = flat_hidden.new_empty(size)
            widened = main_grad.new_empty(size)
            for rows, grads in zip(main_grad.split(VOCAB_SLICE), flat_grad.t().split(VOCAB_SLICE)):
                n = rows.shape[0]
                torch.mm(grads, flat_hidden, out=product[:n])
                rows.add_(widened[:n].copy_(product[:n]))
        return grad_input, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient goes into ``weight.main_grad``."""
    return _EmbeddingIntoMainGrad.apply(ids, weight)


def linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(hidden, weight)`` whose weight gradient goes into ``weight.main_grad``."""
    return _LinearIntoMainGrad.apply(hidden, weight)


class BloomWordEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding``; at TP = 1, training a model that opted in, the lookup whose
    backward writes into ``main_grad``."""

    def forward(self, input_):
        if (
            self.tp_group.size() > 1
            or self.reduce_scatter_embeddings
            or not accumulates(self.weight)
        ):
            return super().forward(input_)
        return embedding(input_, self.weight)


class BloomOutputLayer(ColumnParallelLinear):
    """GPTModel's (tied) LM head. At TP = 1 without sequence parallelism (gathering the
    vocabulary is then the identity): in inference :func:`vocab_projection`; in training a
    model that opted in, the projection whose weight gradient goes into ``main_grad``."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        plain = self.tp_group.size() == 1 and not self.sequence_parallel
        if plain and not torch.is_grad_enabled():  # also a trained model's scoring
            return vocab_projection(input_, weight), None
        if plain and accumulates(weight):
            return linear(input_, weight), None
        return super().forward(input_, weight, runtime_gather_output)


LARGE_VOCAB = 16_384


def vocab_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(hidden, weight)`` (..., H) x (V, H) -> (..., V). On a CPU in fp32:
    ``cpu_linear.linear``, our AVX-512 kernel for a few rows (a decode step's 8 rows at
    BLOOM-560m's shapes: 38-42 ms on the 2-core AMD benchmark VM, oneDNN's 56-66 ms, 112 ms
    below) and oneDNN's product for more; under a CPU bf16 region the kept bf16 copy's product,
    our kernel's bf16 path for a few rows (14-20 ms for 8 rows, oneDNN's 33-43), ``F.linear``
    (oneDNN's bf16 product) for more. With oneDNN switched off (``MEGATRON_RLHF_CPU_LINEAR=mkl``),
    for a few rows (a decode step: 3 to 64) and a large vocabulary, as ``weight @ hidden^T``:

    A decode step's LM head is a (rows x H) x (H x V) product that must read the whole
    vocabulary matrix (1 GB in fp32 at BLOOM-560m's width) for a few rows: memory-bound.
    ``F.linear`` hands it to MKL's sgemm as ``hidden @ weight^T``, which splits it badly over
    the cores: on the 2-core benchmark machine 8 rows take 0.11 s where reading the matrix
    takes 0.04 s. The same product as ``weight @ hidden^T`` (V x H times H x rows, the
    matrix streamed row by row) takes 0.06 s (``benchmarks/roofline.py`` times both). Each
    output is the same dot product summed in another order: equal to rounding. One or two
    rows already take MKL's matrix-vector path; GPUs, many rows and small vocabularies use one
    ``F.linear``."""
    if cpu_linear.onednn_applies(hidden, weight):  # fp32 on a CPU: our kernel or oneDNN
        return cpu_linear.linear(hidden, weight)
    weight = bf16_copy(weight)  # under a CPU bf16 region: its kept bf16 copy
    few_rows = cpu_linear.few_rows_bf16(hidden, weight)  # a bf16 decode step: our kernel
    if few_rows is not None:
        return few_rows
    rows = hidden.numel() // hidden.shape[-1]
    # bf16 under autocast: F.linear is oneDNN's bf16 product, 37 ms for 8 rows on the AMD VM
    # against 55 ms as weight @ hidden^T (kept only where oneDNN is switched off)
    onednn_bf16 = weight.dtype == torch.bfloat16 and cpu_linear.onednn_enabled()
    small = not 2 < rows <= 64 or weight.shape[0] < LARGE_VOCAB
    if hidden.device.type != "cpu" or small or onednn_bf16:
        return F.linear(hidden, weight)
    flat = hidden.reshape(rows, hidden.shape[-1])
    logits = torch.matmul(weight, flat.t()).t().contiguous()
    return logits.reshape(*hidden.shape[:-1], weight.shape[0])
