"""Candidate layouts for the four PPO roles and the rollout, the ones that fit, ranked by time.

Every role spans the whole world (``dp = gpus / (tp * pp)``, as ``train-ppo`` places them), so
one GPU holds a shard of each: the actor's and critic's training state, the frozen reference
and reward weights, the rollout copy of the actor when its layout differs, plus the largest
transient of the step's phases (rollout: KV cache; scoring: one forward pass; actor or critic
update: saved activations and logits). A plan fits when that total, plus ``reserve_gb`` for
the CUDA context and NCCL buffers, is within the GPU's memory.

Step time (seconds) is an estimate for ranking, from the GPU table in ``hardware``:
- compute phases: model FLOPs / (GPUs x peak x ``MATMUL_EFFICIENCY``), stretched by the 1F1B
  bubble ``(pp - 1) / microbatches`` and by 4/3 under full recompute;
- TP: 4 all-reduces of ``b s h`` bf16 values per layer and micro-batch in training (2 in a
  forward pass), ring volume ``2 (tp-1)/tp``, over NVLink; DP: the fp32 gradient reduce-scatter
  and bf16 all-gather of the distributed optimizer, inter-node when a replica group leaves the
  node;
- decoding: each new token reads this rank's weights and KV cache from HBM once per stage, the
  stages one after another (pp x per-stage time), plus the prefill's FLOPs;
- resharding the actor into a different rollout layout: each rollout rank receives its shard of
  the bf16 weights (every DP replica needs a whole copy), over NVLink inside a node, else the
  inter-node link.

Every plan also reports the actor-to-rollout weight sync per step three ways
(:func:`weight_sync`): our engine's refit, vLLM's full stream (every rank receives every full
tensor: the sync before shard-to-shard, now only its fallback) and vLLM's shard-to-shard sync
(``generation/shard_sync.py``: each rank only its rollout-TP shard).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

from megatron_rlhf.distributed.layouts import (
    Layout,
    check_global_batch,
    divisors,
    validate_layouts,
)
from megatron_rlhf.planning import hardware, memory
from megatron_rlhf.planning.memory import GB, Memory, Workload
from megatron_rlhf.planning.shapes import ModelShape, max_rank_params, model_params
from megatron_rlhf.utils import InputError

MATMUL_EFFICIENCY = (
    0.5  # share of dense bf16 peak a large Megatron matmul sustains (~BigScience's 48 %)
)
TP_CANDIDATES = (1, 2, 4, 8)  # TP stays inside a node of 8 GPUs
ROLE_HEADS = {"actor": "lm", "reference": "lm", "critic": "scalar", "reward": "scalar"}


@dataclass(kw_only=True)
class PlanRequest:
    """What to plan for."""

    models: dict[str, ModelShape]
    """actor, reference, critic, reward -> shape."""
    gpus: int
    """GPUs in the job."""
    gpu_memory_gb: float
    """Memory per GPU, GB."""
    rollout_sequences: int = 256
    """Sequences generated per PPO step over all replicas (paper: global batch 256)."""
    max_length: int = 2048
    """Prompt + response tokens per sequence."""
    prompt_length: int | None = None
    """Prompt tokens (default: half of max_length)."""
    micro_batch: int = 1
    """Sequences per training/scoring micro-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Packed scoring/update micro-batches (``train.packing``) of this many tokens instead of
    ``micro_batch`` padded rows."""
    reserve_gb: float = 2.0
    """Held back per GPU for the CUDA context, NCCL buffers and fragmentation."""
    gpu: hardware.GPU = field(default_factory=lambda: hardware.DEFAULT_GPU)
    """Hardware for the time estimate."""
    attention_backend: str = "torch"
    """The roles' core attention (``train.attention_backend``): ``triton`` keeps O(s)
    attention memory, ``torch`` and ``te`` (unfused with ALiBi) store the (s x s) scores.
    Planned as ``torch`` by default until the GPU check has measured the fused kernel."""

    @property
    def prompt(self) -> int:
        return self.prompt_length if self.prompt_length is not None else self.max_length // 2

    @property
    def response(self) -> int:
        return self.max_length - self.prompt


@dataclass(kw_only=True)
class Plan:
    """One assignment of layouts, its memory per GPU and estimated step time."""

    layouts: dict[str, Layout]
    recompute: bool
    memory: dict[str, Memory]
    """Per role (and ``rollout``, ``transient``) bytes per GPU."""
    transient_phase: str
    seconds: dict[str, float]
    total_bytes: float
    fits: bool

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def to_dict(self, request: PlanRequest | None = None) -> dict:
        sync = {} if request is None else {"weight_sync": weight_sync(request, self.layouts)}
        return sync | {
            "fits": self.fits,
            "step_time_s": round(self.step_seconds, 3),
            "time_s": {k: round(v, 3) for k, v in self.seconds.items()},
            "layouts": {role: layout.as_dict() for role, layout in self.layouts.items()},
            "recompute": self.recompute,
            "memory_per_gpu_gb": {
                role: {k: round(v / GB, 3) for k, v in mem.to_dict().items()}
                for role, mem in self.memory.items()
            },
            "transient_phase": self.transient_phase,
            "total_per_gpu_gb": round(self.total_bytes / GB, 3),
        }


def candidate_layouts(
    shape: ModelShape, gpus: int, global_batch: int | None = None
) -> list[Layout]:
    """Every layout the commands would accept for ``shape`` on ``gpus`` GPUs (tp among
    ``TP_CANDIDATES``, pp among the divisors of the layers), as the layout validator decides,
    and (given ``global_batch``, train-ppo's ``rollout.prompts_per_step``) whose DP size
    splits that batch, as train-ppo's batch check decides."""
    accepted = []
    for tp, pp in itertools.product(TP_CANDIDATES, divisors(shape.num_layers)):
        with contextlib.suppress(InputError):  # this model refuses it on this many GPUs
            layouts = validate_layouts({"": (tp, pp)}, gpus, {"": shape})
            if global_batch is not None:
                check_global_batch(global_batch, "rollout.prompts_per_step", layouts)
            accepted += layouts.values()
    return accepted


def role_workload(request: PlanRequest, layout: Layout, recompute: bool) -> Workload:
    """A role's micro-batches: ``micro_batch`` padded rows, or (``max_tokens_per_micro_batch``)
    one packed row of that many tokens, as full as the budget allows. A pack's sequences are
    attended alone (``packed_sequence_len``) except under sequence parallelism (here at tp > 1),
    where the block-diagonal mask costs the whole row's scores."""
    per_replica = max(1, request.rollout_sequences // layout.dp)
    rows, width, response, microbatches = (
        request.micro_batch, request.max_length, request.response,
        max(1, per_replica // request.micro_batch),
    )  # fmt: skip
    budget, sequence = request.max_tokens_per_micro_batch, None
    if budget is not None:
        rows, width = 1, budget
        response = max(1, budget * request.response // request.max_length)
        microbatches = max(1, -(-per_replica * request.max_length // budget))
        sequence = request.max_length if layout.tp == 1 else None
    return Workload(
        micro_batch=rows,
        seq_len=width,
        response_len=response,
        num_microbatches=microbatches,
        packed_sequence_len=sequence,
        element_bytes=2,
        recompute=recompute,
        sequence_parallel=layout.tp > 1,
        distributed_optimizer=True,
        # the fused Triton kernel takes PPO's left-padded rows and keeps O(s); the PyTorch path
        # and TE (unfused with ALiBi) store the (s x s) scores
        fused_attention=memory.fused_attention(request.attention_backend),
    )


def _train_seconds(
    request: PlanRequest, shape: ModelShape, layout: Layout, work: Workload
) -> float:
    gpu, tokens = request.gpu, request.rollout_sequences * request.max_length
    flops = (
        hardware.train_flops_per_token(
            model_params(shape), shape.num_layers, shape.hidden_size, request.max_length
        )
        * tokens
    )
    compute = flops / (request.gpus * gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
    compute *= 1 + (layout.pp - 1) / work.num_microbatches
    compute *= 4 / 3 if work.recompute else 1
    return compute + _tp_seconds(request, shape, layout, 4) + _dp_seconds(request, shape, layout)


def _forward_seconds(request: PlanRequest, shape: ModelShape, layout: Layout) -> float:
    gpu, tokens = request.gpu, request.rollout_sequences * request.max_length
    flops = (
        hardware.forward_flops_per_token(
            model_params(shape), shape.num_layers, shape.hidden_size, request.max_length
        )
        * tokens
    )
    microbatches = max(1, request.rollout_sequences // layout.dp // request.micro_batch)
    compute = flops / (request.gpus * gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
    return compute * (1 + (layout.pp - 1) / microbatches) + _tp_seconds(request, shape, layout, 2)


def _tp_seconds(request: PlanRequest, shape: ModelShape, layout: Layout, per_layer: int) -> float:
    """All-reduces of the (b, s, h) bf16 activations inside each TP group, per GPU."""
    if layout.tp == 1:
        return 0.0
    sequences = request.rollout_sequences / layout.dp
    volume = (
        per_layer
        * shape.num_layers
        / layout.pp
        * sequences
        * request.max_length
        * shape.hidden_size
        * 2
    )
    return volume * 2 * (layout.tp - 1) / layout.tp / (request.gpu.nvlink_gb_per_s * 1e9)


def _dp_seconds(request: PlanRequest, shape: ModelShape, layout: Layout) -> float:
    """Distributed optimizer: reduce-scatter fp32 grads, all-gather bf16 params."""
    if layout.dp == 1:
        return 0.0
    volume = max_rank_params(shape, layout.tp, layout.pp) * (4 + 2) * (layout.dp - 1) / layout.dp
    crosses_nodes = layout.tp * layout.pp * layout.dp > hardware.GPUS_PER_NODE
    bandwidth = hardware.INTER_NODE_GB_PER_S if crosses_nodes else request.gpu.nvlink_gb_per_s
    return volume / (bandwidth * 1e9)


def _generate_seconds(
    request: PlanRequest, shape: ModelShape, layout: Layout, kv_bytes: float
) -> float:
    """Prefill FLOPs, then per token: every stage reads its weights and KV cache once."""
    gpu = request.gpu
    rows = request.rollout_sequences / layout.dp
    prefill_flops = (
        hardware.forward_flops_per_token(
            model_params(shape), shape.num_layers, shape.hidden_size, request.prompt
        )
        * rows
        * request.prompt
    )
    prefill = prefill_flops / (layout.tp * layout.pp * gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
    weights = max_rank_params(shape, layout.tp, layout.pp) * 2
    per_stage = (weights + kv_bytes / 2) / (
        gpu.hbm_tb_per_s * 1e12
    )  # the cache is half full on average
    latency = 2 * shape.num_layers * 10e-6 if layout.tp > 1 else 0.0  # two all-reduces per layer
    return prefill + request.response * (layout.pp * per_stage + latency)


@dataclass(kw_only=True)
class _RoleOption:
    layout: Layout
    static: Memory
    transient: dict[str, Memory]
    seconds: dict[str, float]

    def __post_init__(self):
        self.static_total = self.static.total
        self.transient_totals = {phase: m.total for phase, m in self.transient.items()}
        self.seconds_total = sum(self.seconds.values())


def _role_options(request: PlanRequest, role: str, recompute: bool) -> list[_RoleOption]:
    shape, head = request.models[role], ROLE_HEADS[role]
    options = []
    for layout in candidate_layouts(shape, request.gpus, request.rollout_sequences):
        work = role_workload(request, layout, recompute)
        if role in ("actor", "critic"):
            full = memory.train_memory(shape, layout, head, work)
            static = Memory(weights=full.weights, grads=full.grads, optimizer=full.optimizer)
            transient = {f"train_{role}": Memory(activations=full.activations, logits=full.logits)}
            seconds = {f"train_{role}": _train_seconds(request, shape, layout, work)}
        else:
            seconds = {}
        forward = memory.forward_memory(shape, layout, head, work)
        if role not in ("actor", "critic"):
            static = Memory(weights=forward.weights)
        transient = (transient if role in ("actor", "critic") else {}) | {
            "score": Memory(activations=forward.activations, logits=forward.logits)
        }
        seconds[f"score_{role}"] = _forward_seconds(request, shape, layout)
        options.append(
            _RoleOption(layout=layout, static=static, transient=transient, seconds=seconds)
        )
    return options


def _rollout_options(request: PlanRequest) -> list[_RoleOption]:
    shape = request.models["actor"]
    options = []
    for layout in candidate_layouts(shape, request.gpus, request.rollout_sequences):
        rows = max(1, request.rollout_sequences // layout.dp)
        gen = memory.generate_memory(
            shape,
            layout,
            rows,
            request.prompt,
            request.response,
            2,
            fused_attention=memory.fused_attention(request.attention_backend),
        )  # fmt: skip  (the prefill takes the backend; KV-cached decode the PyTorch path)
        seconds = {"rollout": _generate_seconds(request, shape, layout, gen.kv_cache)}
        transient = {
            "rollout": Memory(activations=gen.activations, logits=gen.logits, kv_cache=gen.kv_cache)
        }
        options.append(
            _RoleOption(
                layout=layout,
                static=Memory(weights=gen.weights),
                transient=transient,
                seconds=seconds,
            )
        )
    return options


@dataclass(kw_only=True)
class Ranking:
    """The best plans and how many candidates were weighed."""

    plans: list[Plan]
    """The ``top`` best: fitting ones by step time, then the rest by memory."""
    candidates: int
    fitting: int


def make_plans(request: PlanRequest, top: int = 10) -> Ranking:
    """Every combination of role layouts and recompute, scored cheaply; the best built in full."""
    rollouts = pareto(_rollout_options(request))
    scored = []
    for recompute in (False, True):
        options = {role: pareto(_role_options(request, role, recompute)) for role in ROLE_HEADS}
        for combo in itertools.product(*options.values(), rollouts):
            total, seconds = _score(request, combo)
            fits = fits_memory(request, total)
            key = (not fits, seconds, total) if fits else (not fits, total, seconds)
            scored.append((*key, recompute, combo))
    scored.sort(key=lambda item: item[:3])
    plans = [_combine(request, recompute, *combo) for *_, recompute, combo in scored[:top]]
    return Ranking(plans=plans, candidates=len(scored), fitting=sum(not s[0] for s in scored))


def _score(request: PlanRequest, combo) -> tuple[float, float]:
    """(bytes per GPU, step seconds) of a combination, without building the breakdown."""
    *roles, rollout = combo
    actor = roles[0]
    resharded = rollout.layout != actor.layout
    total = sum(option.static_total for option in roles)
    total += rollout.static_total if resharded else 0.0
    seconds = sum(option.seconds_total for option in combo)
    if resharded:
        seconds += _reshard_seconds(request, rollout.layout)
    return total + peak_transient(combo), seconds


def peak_transient(options) -> float:
    """The largest transient of any phase of options whose shards share a GPU (the phases run
    one after another, so only one phase's working set is live at a time)."""
    transient = {}
    for option in options:
        for phase, value in option.transient_totals.items():
            transient[phase] = max(transient.get(phase, 0.0), value)
    return max(transient.values(), default=0.0)


def fits_memory(request: PlanRequest, total: float) -> bool:
    """Whether ``total`` bytes a GPU, plus the reserve, fit in the GPU's memory."""
    return total + request.reserve_gb * GB <= request.gpu_memory_gb * GB


def _sync_bandwidth(request: PlanRequest) -> float:
    """Bytes/s one GPU receives in a weight sync: NVLink when the job is one node, else the
    inter-node link (the actor's and the rollout's shards of a rank sit on other nodes)."""
    one_node = request.gpus <= hardware.GPUS_PER_NODE
    return (request.gpu.nvlink_gb_per_s if one_node else hardware.INTER_NODE_GB_PER_S) * 1e9


def _reshard_seconds(request: PlanRequest, rollout: Layout) -> float:
    """Our engine's refit: each rollout rank receives its (tp x pp) shard of the bf16 actor."""
    weights = model_params(request.models["actor"]) * 2
    return weights / (rollout.tp * rollout.pp) / _sync_bandwidth(request)


def weight_sync(request: PlanRequest, layouts: dict[str, Layout]) -> dict:
    """Bytes each rollout rank receives per step to get the updated actor, and the seconds at
    the sync bandwidth, for three ways of sending them:

    - ``megatron_refit``: our engine, Megatron-Core's resharding into the rollout layout (its
      (tp x pp) shard; nothing when the rollout uses the actor's own layout);
    - ``vllm_full_stream``: ``rollout.engine=vllm``'s fallback (``checkpoint/hf_stream``):
      every rank gathers every full tensor (all-gather over the actor's TP, broadcast over its
      PP) and vLLM keeps its shard: the whole bf16 model a rank;
    - ``shard_to_shard``: ``rollout.engine=vllm`` (``generation/shard_sync``): each vLLM rank
      writes only its rollout-TP shard (vLLM has no PP), in buckets. An upper bound on what
      crosses the links: a rank copies from itself what its actor shard holds (at actor TP =
      rollout TP and PP 1, everything but the vocabulary rows the two pad differently).
    """
    weights = model_params(request.models["actor"]) * 2
    actor, rollout = layouts["actor"], layouts["rollout"]
    bandwidth = _sync_bandwidth(request)
    received = {
        "megatron_refit": 0.0 if rollout == actor else weights / (rollout.tp * rollout.pp),
        "vllm_full_stream": float(weights),
        "shard_to_shard": weights / rollout.tp,
    }
    return {
        way: {"gb_per_rank": round(b / GB, 3), "seconds": round(b / bandwidth, 3)}
        for way, b in received.items()
    } | {"bandwidth_gb_per_s": bandwidth / 1e9}


def pareto(options: list[_RoleOption]) -> list[_RoleOption]:
    """Drop options another beats on static bytes, every transient and time at once (a
    dominated option can never make a plan faster or let one fit)."""

    def key(option):
        transients = option.transient_totals
        return (
            option.static_total,
            *(transients[p] for p in sorted(transients)),
            option.seconds_total,
        )

    keys = [key(option) for option in options]
    return [
        option
        for i, option in enumerate(options)
        if not any(
            j != i and all(a <= b for a, b in zip(keys[j], keys[i])) and keys[j] != keys[i]
            for j in range(len(options))
        )
    ]


def _combine(request, recompute, actor, reference, critic, reward, rollout) -> Plan:
    roles = {"actor": actor, "reference": reference, "critic": critic, "reward": reward}
    resharded = rollout.layout != actor.layout
    mem = {role: option.static for role, option in roles.items()}
    mem["rollout"] = rollout.static if resharded else Memory()  # the actor's own weights otherwise
    phases: dict[str, Memory] = {}
    for option in (*roles.values(), rollout):
        for phase, transient in option.transient.items():
            if phase not in phases or transient.total > phases[phase].total:
                phases[phase] = transient
    phase, transient = max(phases.items(), key=lambda item: item[1].total)
    mem["transient"] = transient
    total = sum(m.total for m in mem.values())
    seconds = {}
    for option in (*roles.values(), rollout):
        seconds |= option.seconds
    if resharded:
        seconds["reshard"] = _reshard_seconds(request, rollout.layout)
    layouts = {role: option.layout for role, option in roles.items()} | {"rollout": rollout.layout}
    fits = fits_memory(request, total)
    return Plan(
        layouts=layouts,
        recompute=recompute,
        memory=mem,
        transient_phase=phase,
        seconds=seconds,
        total_bytes=total,
        fits=fits,
    )


def roles_summary(request: PlanRequest) -> dict:
    """The ``roles`` block of the JSON: each model's shape and exact parameter count."""
    return {
        role: {
            "model": shape.name,
            "params": model_params(shape, ROLE_HEADS[role]),
            "layers": shape.num_layers,
            "hidden": shape.hidden_size,
            "heads": shape.num_heads,
            "vocab": shape.vocab_size,
        }
        for role, shape in request.models.items()
    }
