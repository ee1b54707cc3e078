"""Bytes per GPU of one role, from what our code allocates (checked by tools/scaling_study.py).

Units: ``s`` sequence length, ``b`` micro-batch rows, ``h`` hidden, ``a`` heads, ``v`` the padded
vocabulary, ``t`` TP, ``e`` bytes per activation element (bf16 2 on GPUs, fp32 4 on the CPU).

- Weights: the parameters of the fullest rank (``shapes.max_rank_params``) x e.
- Gradients: Megatron-Core's DDP buffer, fp32 (``grad_reduce_in_fp32=True``): 4 B/param.
- Adam: exp_avg + exp_avg_sq (8 B/param) plus an fp32 master copy of bf16 weights (4 B/param);
  the distributed optimizer divides all of it by the data-parallel size. The step itself holds
  two temporaries the size of the largest parameter (torch's single-tensor Adam on the CPU).
- Activations saved for backward per layer and micro-batch (counted with
  ``torch.autograd.graph.saved_tensors_hooks`` on our ``BloomModel``; Korthikanti et al. 2022's
  formula with our layer's tensors, no dropout masks since BLOOM's dropouts are 0):
  ``4 sbh`` replicated over TP (two LayerNorm inputs and outputs; ``/t`` with sequence
  parallelism) + ``12 sbh / t`` (QKV, attention context, fc1 output, GELU output) elements, the
  fp32 softmax output ``a s^2 b / t`` (4 B each, plus the e-byte probabilities it is cast to when
  e < 4) and the LayerNorm statistics. Attention by backend (:func:`fused_attention`): the fused
  Triton kernel keeps only the fp32 log-sum-exp ``a s b / t`` (O(s)); the PyTorch path and
  TransformerEngine with ALiBi (its unfused attention: a (b, a/t, s, s) fp32 bias and the scores)
  keep O(s^2). A 1F1B pipeline keeps ``min(pp, microbatches)``
  micro-batches in flight on its first stage. Full recompute keeps each layer's input
  (``sbh``) and one layer's activations at a time.
- The LM-head working set of the last stage: the logits shard ``b s v/t`` the output layer
  writes (S, B) and the contiguous (B, S) copy ``GPTModel`` returns; in training the
  ``token_logprobs`` kernel saves the response slice, and the backward holds the full-size
  gradient and its copy for the output layer's products, plus, through Megatron-Core's output
  layer (TP > 1 or SP), a transposed copy. The kernel's own scratch is two fp32 chunks of at
  most ``CHUNK_ELEMENTS`` values.
- KV cache (generation): ``StaticInferenceContext`` keys and values for the rollout's sequences
  at their full length: ``2 * (l/pp) * rows * (prompt + response) * h/t`` x e, plus the prefill's
  layer temporaries. Megatron-Core computes (and gathers over TP) the logits of the last
  position only. At PP > 1 the prefill and the logits are those of one pipelined micro-batch
  (``rows / pp`` rows by default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_rlhf.distributed.layouts import Layout
from megatron_rlhf.planning.shapes import ModelShape, padded_vocab, rank_params

CHUNK_ELEMENTS = 1 << 22  # kernels/fused/logprobs.py: values one step of the PyTorch path holds
GB = 1e9


@dataclass(kw_only=True)
class Workload:
    """What one step asks of a role."""

    micro_batch: int = 1
    """Sequences per micro-batch of a training or scoring pass."""
    seq_len: int = 2048
    """Tokens per sequence (prompt + response)."""
    response_len: int = 1024
    """Response tokens (the LM head's log-probs are taken over these)."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step on each data-parallel replica (1F1B in flight)."""
    element_bytes: int = 2
    """Bytes of a weight or activation element: 2 (bf16) on GPUs, 4 (fp32) on the CPU."""
    recompute: bool = False
    """Full activation recompute (Megatron ``recompute_granularity=full``, one layer per unit)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (LayerNorm activations split over TP)."""
    distributed_optimizer: bool = True
    """Shard Adam state (and the fp32 master weights) over the data-parallel replicas."""
    fused_attention: bool = False
    """The fused Triton ALiBi attention (``attention_backend="triton"``, GPUs): the (s x s) scores
    are never stored, only the fp32 log-sum-exp per query; False: the PyTorch core attention or
    TransformerEngine's (unfused with ALiBi), O(s^2). Set it with :func:`fused_attention`."""
    packed_sequence_len: int | None = None
    """Packed micro-batches (``train.packing``): ``micro_batch`` 1 row of
    ``seq_len`` tokens (the budget) holding sequences of at most this many tokens, each
    attended alone (the THD path), so a layer's scores are at most ``seq_len`` x this per head,
    not ``seq_len``²; None: padded rows, or a pack under the block-diagonal mask (sequence
    parallelism, TE layers), whose scores are ``seq_len``²."""

    logprob_scratch: bool = False
    """The log-prob kernel's PyTorch path runs (a CPU without our AVX-512 kernel, fp64 or bf16
    logits), with its two fp32 scratch chunks; False: the Triton kernel (GPUs) or the CPU
    kernel (``kernels/fused/cpu_logprobs.c``), which need none."""

    @property
    def key_len(self) -> int:
        """Keys each query's attention scores span (at most)."""
        return min(self.packed_sequence_len or self.seq_len, self.seq_len)


@dataclass(kw_only=True)
class Memory:
    """Bytes per GPU, by what holds them."""

    weights: float = 0.0
    """Parameters of the fullest rank."""
    grads: float = 0.0
    """fp32 gradient buffer."""
    optimizer: float = 0.0
    """Adam moments (+ fp32 master weights for bf16)."""
    activations: float = 0.0
    """Peak working set of the pass: saved activations, or one layer's forward temporaries."""
    logits: float = 0.0
    """LM-head logits and the log-prob kernel's working set."""
    kv_cache: float = 0.0
    """Generation keys and values."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)} | {
            "total": int(self.total)
        }

    def __add__(self, other: Memory) -> Memory:
        return Memory(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


def fused_attention(attention_backend: str) -> bool:
    """Whether a model's resolved ``attention_backend`` keeps O(s) attention memory: only the
    Triton kernel does. TE is O(s^2) here: given ALiBi slopes and a padding mask it runs its
    unfused attention (cuDNN refuses a bias with padding; flash-attn is not a dependency)."""
    return attention_backend == "triton"


def static_memory(
    shape: ModelShape, layout: Layout, head: str, trainable: bool, work: Workload, stage: int = 0
) -> Memory:
    """Weights, and for a trained role its gradient buffer and Adam state, on one stage."""
    params = rank_params(shape, layout.tp, layout.pp, stage, head)
    memory = Memory(weights=params * work.element_bytes)
    if trainable:
        per_param = 8 + (4 if work.element_bytes < 4 else 0)
        shards = layout.dp if work.distributed_optimizer else 1
        memory.grads = params * 4.0
        memory.optimizer = params * per_param / shards
    return memory


def layer_activation_bytes(shape: ModelShape, layout: Layout, work: Workload, seq: int) -> float:
    """Bytes one layer saves for backward for one micro-batch of ``seq`` tokens."""
    h, a, t, b, e = (
        shape.hidden_size,
        shape.num_heads,
        layout.tp,
        work.micro_batch,
        work.element_bytes,
    )
    sbh = seq * b * h
    replicated = 4 * sbh / (t if work.sequence_parallel else 1)
    if work.fused_attention:
        scores = a * seq * b / t * 4  # the softmax statistics flash attention keeps
    else:
        keys = min(work.key_len, seq)
        scores = a * seq * keys * b / t * (4 + (e if e < 4 else 0))
    layer_norm_stats = 4 * seq * b * 4
    return (replicated + 12 * sbh / t) * e + scores + layer_norm_stats


def layer_forward_bytes(
    shape: ModelShape,
    layout: Layout,
    rows: int,
    seq: int,
    e: int,
    fused_attention: bool = False,
    key_len: int | None = None,
) -> float:
    """Peak temporaries of one layer's forward without autograd: the residual stream and
    LayerNorm output, QKV and its permuted copies, and two fp32 score tensors at once (matmul,
    scale, ALiBi add and mask each write a new one), or the MLP's fc1 and GELU outputs.
    ``key_len``: keys per query (a packed row's longest sequence; None: ``seq``)."""
    h, a, t = shape.hidden_size, shape.num_heads, layout.tp
    sbh = rows * seq * h
    attention = (2 * sbh + 5 * sbh / t) * e
    if not fused_attention:
        keys = min(key_len or seq, seq)
        attention += 2 * a * seq * keys * rows / t * 4
    mlp = (2 * sbh + 8 * sbh / t) * e
    return max(attention, mlp)


def train_activations(shape: ModelShape, layout: Layout, work: Workload, stage: int) -> float:
    """Saved activations on a pipeline stage: 1F1B keeps ``pp - stage`` micro-batches there."""
    layers = shape.num_layers // layout.pp
    in_flight = min(layout.pp - stage, work.num_microbatches)
    sbh_bytes = work.seq_len * work.micro_batch * shape.hidden_size * work.element_bytes
    one_layer = layer_activation_bytes(shape, layout, work, work.seq_len)
    if work.recompute:
        return in_flight * layers * sbh_bytes + one_layer + sbh_bytes
    embedding_norm_input = sbh_bytes if stage == 0 else 0
    return in_flight * (layers * one_layer + embedding_norm_input)


def logits_bytes(shape: ModelShape, layout: Layout, work: Workload, training: bool) -> float:
    """The LM head's logits and the log-prob kernel's working set on the last stage."""
    vocab = padded_vocab(shape.vocab_size, layout.tp) // layout.tp
    rows = work.micro_batch * work.seq_len
    full = rows * vocab * work.element_bytes
    response = work.micro_batch * work.response_len * vocab * work.element_bytes
    scratch = 0
    if work.logprob_scratch:
        scratch = 2 * min(work.micro_batch * work.response_len, max(1, CHUNK_ELEMENTS // vocab))
        scratch *= vocab * 4
    # one row (a packed micro-batch) through our TP = 1 output layer: (S, 1, V) and (1, S, V)
    # are views of each other, no copy (measured at TP = 1 only: tests/test_planning.py)
    one_row = work.micro_batch == 1 and layout.tp == 1 and not work.sequence_parallel
    if training:
        # the slice the kernel saves, and in the backward the full-size gradient and its copy
        # for the output layer's products: Megatron-Core's layer takes a transposed copy for the
        # weight gradient besides; ours (TP = 1 without SP, models/bloom/vocab.py) reshapes the
        # gradient once for both products (tools/scaling_study.py: TP=1 actor rows 1.13-1.17
        # counted with three), which one row does in place
        copies = 2 if layout.tp == 1 and not work.sequence_parallel else 3
        return (copies - one_row) * full + response + scratch
    if one_row:  # a packed row: its response positions gathered from the full-grid logits
        gathered = response if work.packed_sequence_len is not None else 0
        return full + gathered + scratch
    return max(2 * full, full + scratch)  # the (S, B) output and its (B, S) copy; or the kernel


def scalar_head_bytes(shape: ModelShape, work: Workload, training: bool) -> float:
    """Final LayerNorm input and output of a scalar head (saved in training)."""
    sbh = work.seq_len * work.micro_batch * shape.hidden_size * work.element_bytes
    return 2 * sbh if training else sbh


def fullest_stage(per_stage: list[Memory]) -> Memory:
    """The pipeline stage that needs the most memory (what must fit on every GPU)."""
    return max(per_stage, key=lambda memory: memory.total)


def train_memory(shape: ModelShape, layout: Layout, head: str, work: Workload) -> Memory:
    """One training step of a role (actor: LM head; critic/reward model: scalar head)."""
    stages = []
    for stage in range(layout.pp):
        memory = static_memory(shape, layout, head, True, work, stage)
        memory.activations = train_activations(shape, layout, work, stage)
        if stage == layout.pp - 1 and head == "lm":
            memory.logits = logits_bytes(shape, layout, work, training=True)
        elif stage == layout.pp - 1:
            memory.activations += scalar_head_bytes(shape, work, training=True)
        step = optimizer_step_bytes(shape, layout, stage)
        memory.activations = max(memory.activations + memory.logits, step) - memory.logits
        stages.append(memory)
    return fullest_stage(stages)


def forward_memory(shape: ModelShape, layout: Layout, head: str, work: Workload) -> Memory:
    """One forward scoring pass of a frozen role (log-probs, values or scores).

    Nothing is saved without autograd, so the peak is either inside a layer or at the LM head,
    where the final hidden states (the LayerNorm input and output) meet the logits."""
    stages = []
    sbh = work.micro_batch * work.seq_len * shape.hidden_size * work.element_bytes
    for stage in range(layout.pp):
        memory = static_memory(shape, layout, head, False, work, stage)
        layer = layer_forward_bytes(
            shape, layout, work.micro_batch, work.seq_len, work.element_bytes,
            work.fused_attention, work.key_len,
        )  # fmt: skip
        if stage == layout.pp - 1 and head == "lm":
            memory.logits = logits_bytes(shape, layout, work, training=False)
        memory.activations = max(layer, 2 * sbh + memory.logits) - memory.logits
        stages.append(memory)
    return fullest_stage(stages)


def kv_cache_bytes(shape: ModelShape, layout: Layout, rows: int, length: int, e: int) -> float:
    """Keys and values of ``rows`` sequences of ``length`` tokens on one rank."""
    layers = shape.num_layers // layout.pp
    return 2.0 * layers * rows * length * shape.hidden_size / layout.tp * e


def generate_memory(
    shape: ModelShape,
    layout: Layout,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    e: int,
    fused_attention: bool = False,
    micro_batches: int = 0,
    decode_batch: int | None = None,
) -> Memory:
    """KV-cached generation of ``rows`` sequences on one rollout replica (weights included).

    At PP > 1 the rows travel the pipeline in ``micro_batches`` pieces (generation/pipelined.py;
    0: its default, PP), so a stage's layer temporaries and the last stage's logits are those of
    one piece; the KV cache still holds every row. With ``decode_batch`` slots (PP = 1,
    generation/refill.py) the cache holds that many rows of ``prompt_len + 2 * new_tokens``
    columns, plus a prompt-wide cache for the newcomers' prefill."""
    stages = []
    pieces = (micro_batches or layout.pp) if layout.pp > 1 else 1
    piece_rows = -(-rows // min(pieces, rows))
    kv = kv_cache_bytes(shape, layout, rows, prompt_len + new_tokens, e)
    if decode_batch and layout.pp == 1 and decode_batch < rows:
        piece_rows = decode_batch
        kv = kv_cache_bytes(shape, layout, decode_batch, prompt_len + 2 * new_tokens, e)
        newcomers = min(decode_batch, rows - decode_batch)
        kv += kv_cache_bytes(shape, layout, newcomers, prompt_len, e)
    for stage in range(layout.pp):
        memory = Memory(weights=rank_params(shape, layout.tp, layout.pp, stage, "lm") * e)
        memory.kv_cache = kv
        memory.activations = layer_forward_bytes(
            shape, layout, piece_rows, prompt_len, e, fused_attention
        )
        if stage == layout.pp - 1:  # only the last position's logits are computed, gathered
            vocab = padded_vocab(shape.vocab_size, layout.tp)
            memory.logits = piece_rows * vocab * e * (2 + 1 / layout.tp)
        stages.append(memory)
    return fullest_stage(stages)


def optimizer_step_bytes(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Temporaries of the optimizer step: two fp32 copies of the stage's largest parameter
    (Adam's denominator and update): the embedding shard or an MLP weight."""
    h = shape.hidden_size
    largest = 4 * h * h // layout.tp
    if stage in (0, layout.pp - 1):
        largest = max(largest, padded_vocab(shape.vocab_size, layout.tp) // layout.tp * h)
    return 2 * largest * 4.0
