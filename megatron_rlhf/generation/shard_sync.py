"""Shard-to-shard weight sync: each rollout-TP rank receives only its own shard of the actor.

The rollout's layout is given per HF tensor by a :class:`TensorSpec`: the dim TP splits (in
``T`` equal blocks; None: whole on every rank) and its ``kind``: ``plain``; ``qkv``, a fused
QKV whose target stores a shard's heads ``[q; k; v]`` while HF holds them ``(head, 3,
head_dim)`` (a rank's heads are one contiguous block of HF rows, permuted as they are
written); ``vocab``, the vocabulary padded to a multiple of ``vocab_multiple`` rows, split in
``T`` equal blocks, rows past the real vocabulary zero. Each target says how it shards: vLLM
in ``generation/vllm_layout.py`` (``vllm_target``), our BLOOM copy here
(:func:`megatron_target`).

:func:`build_plan` turns the two layouts into, for this rank, a list of buckets. A bucket is a
run of *units* (a tensor's rollout shard, or a block of its rows) of at most ``bucket_bytes``
per rank; for each unit every receiving rank needs one or more *pieces* (a rectangle of the HF
tensor inside one actor shard) and takes each from itself when it holds that actor shard (a
local copy: actor TP = rollout TP on the same ranks moves nothing), else from one holder
(spread over the actor's data-parallel replicas). Every rank computes every rank's pieces from
the same gathered description of the layouts, so sends and receives agree without a
handshake. :func:`run_plan` then, per bucket, packs each peer's pieces into one buffer and
exchanges them point-to-point (gloo on CPUs, NCCL on GPUs), and hands every piece to a
writer. Nothing here knows vLLM: its rules are in ``generation/vllm_layout.py``, its writer in
``generation/vllm_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor: its full shape (real vocabulary rows only), how TP splits it and how the
    rollout lays out a shard: ``plain``, ``qkv`` (fused QKV, head-interleaved in HF, ``[q; k;
    v]`` in the rollout) or ``vocab``."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    kind: str = "plain"
    head_rows: int = 1  # qkv: 3 x head_dim rows per head (a unit never splits a head)
    vocab_multiple: int = 0  # vocab: the rollout pads the rows to a multiple (its target sets it)


@dataclass(frozen=True)
class Piece:
    """Rows/columns ``ranges`` (global HF coordinates, one ``(start, stop)`` per dim) of tensor
    ``name``, from rank ``src`` to rank ``dst``."""

    name: str
    ranges: tuple[tuple[int, int], ...]
    src: int
    dst: int

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.ranges:
            n *= b - a
        return n


@dataclass
class Bucket:
    local: list[Piece] = field(default_factory=list)
    sends: dict[int, list[Piece]] = field(default_factory=dict)
    recvs: dict[int, list[Piece]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)  # tensors with a unit in this bucket


@dataclass
class SyncPlan:
    rank: int
    specs: dict[str, TensorSpec]
    buckets: list[Bucket]
    rollout_rank: int  # in the rollout TP group
    rollout_tp: int
    actor_starts: dict[str, int]  # this rank's actor shard start on the split dim, per tensor
    element_bytes: int

    @property
    def received_bytes(self) -> int:
        """Bytes written into this rank's rollout shard (local copies and received ones)."""
        pieces = [p for b in self.buckets for p in b.local + sum(b.recvs.values(), [])]
        return sum(p.numel for p in pieces) * self.element_bytes

    @property
    def remote_bytes(self) -> int:
        """Of those, the bytes that came from another rank."""
        pieces = [p for b in self.buckets for p in sum(b.recvs.values(), [])]
        return sum(p.numel for p in pieces) * self.element_bytes


def vocab_rows(vocab: int, tp: int, rank: int, multiple: int) -> tuple[int, int, int]:
    """The vocabulary shard of rank ``rank`` of ``tp`` when the rows are padded to a multiple of
    ``multiple`` and split in ``tp`` equal blocks: (first row, end of the real rows, rows in
    the shard incl. padding). vLLM's (``vllm_layout.vllm_vocab_rows``) and, with ``multiple``
    = our padded vocabulary (``models/bloom/config.padded_vocab_size``), Megatron-Core's."""
    if multiple < 1:
        raise ValueError(f"no vocabulary padding set ({multiple}): give the spec a target")
    padded = -(-vocab // multiple) * multiple
    if padded % tp:
        raise ValueError(
            f"the rollout pads the vocabulary to {padded}, which TP {tp} does not divide"
        )
    per = padded // tp
    start = rank * per
    return start, min(start + per, vocab), per


def rollout_shard(spec: TensorSpec, rank: int, tp: int) -> tuple[tuple[int, int], ...]:
    """The global ranges rollout TP rank ``rank`` of ``tp`` holds (real rows only)."""
    ranges = [(0, n) for n in spec.shape]
    if spec.split_dim is None:
        return tuple(ranges)
    if spec.kind == "vocab":
        start, end, _ = vocab_rows(spec.shape[0], tp, rank, spec.vocab_multiple)
        ranges[0] = (min(start, end), end)
        return tuple(ranges)
    size = spec.shape[spec.split_dim]
    if size % tp:
        raise ValueError(f"{spec.name}: {size} does not split over rollout TP {tp}")
    per = size // tp
    ranges[spec.split_dim] = (rank * per, (rank + 1) * per)
    return tuple(ranges)


def rollout_shard_start(spec: TensorSpec, rank: int, tp: int) -> int:
    """Where rank ``rank``'s shard starts on the split dim (vocab: its padded first row)."""
    if spec.split_dim is None:
        return 0
    if spec.kind == "vocab":
        return vocab_rows(spec.shape[0], tp, rank, spec.vocab_multiple)[0]
    return rank * spec.shape[spec.split_dim] // tp


def rollout_shard_shape(spec: TensorSpec, tp: int) -> tuple[int, ...]:
    """The shape of a rollout shard in the rollout's parameter (vocab: with its padding rows)."""
    shape = list(spec.shape)
    if spec.kind == "vocab":
        shape[0] = vocab_rows(spec.shape[0], tp, 0, spec.vocab_multiple)[2]
    elif spec.split_dim is not None:
        shape[spec.split_dim] //= tp
    return tuple(shape)


def _units(spec: TensorSpec, tp: int, bucket_bytes: int, element_bytes: int) -> list[tuple]:
    """Row blocks ``(first, stop)`` of a rollout shard (shard-relative rows of dim 0), each of
    at most ``bucket_bytes`` (at least one row; qkv: whole heads); the same for every rank."""
    shape = rollout_shard_shape(spec, tp)
    rows = shape[0] if shape else 1
    row_bytes = element_bytes
    for n in shape[1:]:
        row_bytes *= n
    step = max(bucket_bytes // max(row_bytes, 1), 1)
    step = max(step // spec.head_rows, 1) * spec.head_rows
    return [(first, min(first + step, rows)) for first in range(0, rows, step)]


def _unit_ranges(spec, rank, tp, first, stop) -> tuple[tuple[int, int], ...] | None:
    """Global ranges of rows ``[first, stop)`` of rank ``rank``'s shard, or None if empty."""
    ranges = list(rollout_shard(spec, rank, tp))
    if not ranges:  # a 0-dim tensor
        return ()
    base = rollout_shard_start(spec, rank, tp) if spec.split_dim == 0 else 0
    lo, hi = max(base + first, ranges[0][0]), min(base + stop, ranges[0][1])
    if lo >= hi:
        return None
    ranges[0] = (lo, hi)
    return tuple(ranges)


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds of the actor (each tensor's shard: start and stop on its split
    dim) and where it sits in the rollout layout."""

    actor_shards: dict[str, tuple[int, int]]
    rollout_rank: int | None  # None: the rank holds no rollout shard (disaggregated)
    rollout_tp: int
    rollout_names: frozenset | None = None  # the tensors its rollout stage holds; None: all


def _pieces_for(spec, ranges, dst, holders_of) -> list[Piece]:
    """Cut ``ranges`` (needed by ``dst``) along the actor shards, each from a chosen holder."""
    if spec.split_dim is None:
        holders = holders_of(spec.name, (0, 0))
        return [Piece(spec.name, ranges, _choose(holders, dst), dst)]
    pieces = []
    lo, hi = ranges[spec.split_dim]
    for shard, holders in holders_of.shards(spec.name):
        a, b = max(lo, shard[0]), min(hi, shard[1])
        if a >= b:
            continue
        cut = list(ranges)
        cut[spec.split_dim] = (a, b)
        pieces.append(Piece(spec.name, tuple(cut), _choose(holders, dst), dst))
    covered = sum(p.ranges[spec.split_dim][1] - p.ranges[spec.split_dim][0] for p in pieces)
    if covered != hi - lo:
        raise ValueError(f"{spec.name}: the actor's shards do not cover rows {lo}-{hi}")
    return pieces


def _choose(holders: list[int], dst: int) -> int:
    """The receiver itself when it holds the slice, else one holder (spread by receiver)."""
    return dst if dst in holders else holders[dst % len(holders)]


class _Holders:
    def __init__(self, layouts: list[RankLayout]):
        self.by_name: dict[str, dict[tuple[int, int], list[int]]] = {}
        for rank, layout in enumerate(layouts):
            for name, shard in layout.actor_shards.items():
                self.by_name.setdefault(name, {}).setdefault(shard, []).append(rank)

    def __call__(self, name, shard):
        return self.by_name[name][shard]

    def shards(self, name):
        return sorted(self.by_name[name].items())


def build_plan(
    specs: list[TensorSpec],
    layouts: list[RankLayout],
    rank: int,
    bucket_bytes: int,
    element_bytes: int,
) -> SyncPlan:
    """This rank's sends, receives and local copies, bucket by bucket. ``layouts[i]``
    describes rank ``i``: a colocated rollout's ranks are the world's (every rank receives);
    in the disaggregated placement the training ranks hold no rollout shard (``rollout_rank``
    None) and the rollout ranks no actor shard."""
    holders = _Holders(layouts)
    missing = [s.name for s in specs if s.name not in holders.by_name]
    if missing:
        raise ValueError(f"no actor rank holds {missing[:3]}")
    tp = layouts[rank].rollout_tp  # the same on every rank
    units = [
        (spec, first, stop)
        for spec in specs
        for first, stop in _units(spec, tp, bucket_bytes, element_bytes)
    ]
    buckets: list[Bucket] = []
    current, used = Bucket(), 0
    for spec, first, stop in units:
        shape = rollout_shard_shape(spec, tp)
        nbytes = element_bytes * (stop - first)
        for n in shape[1:]:
            nbytes *= n
        if current.names and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = Bucket(), 0
        used += nbytes
        current.names.add(spec.name)
        for dst, layout in enumerate(layouts):
            if layout.rollout_rank is None:  # a training rank (disaggregated)
                continue
            if layout.rollout_names is not None and spec.name not in layout.rollout_names:
                continue  # another pipeline stage's tensor
            ranges = _unit_ranges(spec, layout.rollout_rank, layout.rollout_tp, first, stop)
            if ranges is None:
                continue
            for piece in _pieces_for(spec, ranges, dst, holders):
                if piece.src == rank and piece.dst == rank:
                    current.local.append(piece)
                elif piece.src == rank:
                    current.sends.setdefault(dst, []).append(piece)
                elif piece.dst == rank:
                    current.recvs.setdefault(piece.src, []).append(piece)
    if current.names:
        buckets.append(current)
    mine = layouts[rank]
    return SyncPlan(
        rank=rank,
        specs={s.name: s for s in specs},
        buckets=buckets,
        rollout_rank=mine.rollout_rank,
        rollout_tp=mine.rollout_tp,
        actor_starts={name: shard[0] for name, shard in mine.actor_shards.items()},
        element_bytes=element_bytes,
    )


def _source_view(plan: SyncPlan, piece: Piece, sources: dict[str, torch.Tensor]):
    spec = plan.specs[piece.name]
    tensor = sources[piece.name]
    start = plan.actor_starts[piece.name] if spec.split_dim is not None else 0
    for dim, (a, b) in enumerate(piece.ranges):
        offset = start if dim == spec.split_dim else 0
        tensor = tensor.narrow(dim, a - offset, b - a)
    return tensor


def local_ranges(plan: SyncPlan, piece: Piece) -> tuple[tuple[int, int], ...]:
    """``piece.ranges`` relative to this rank's rollout shard."""
    spec = plan.specs[piece.name]
    start = rollout_shard_start(spec, plan.rollout_rank, plan.rollout_tp)
    return tuple(
        (a - start, b - start) if dim == spec.split_dim else (a, b)
        for dim, (a, b) in enumerate(piece.ranges)
    )


def write_piece(target: torch.Tensor, spec: TensorSpec, ranges, data: torch.Tensor) -> None:
    """Copy ``data`` (HF layout) into ``target`` (one rollout shard in the rollout's layout) at
    the shard-relative ``ranges``: qkv rows go from ``(head, 3, d)`` to ``(3, head, d)``."""
    shape = tuple(b - a for a, b in ranges)
    data = data.reshape(shape)
    if spec.kind == "qkv":
        (r0, r1), rest = ranges[0], target.shape[1:]
        heads = target.shape[0] // spec.head_rows
        h0, h1 = r0 // spec.head_rows, r1 // spec.head_rows
        view = target.view(3, heads, spec.head_rows // 3, *rest)
        cols = ranges[1:]
        for dim, (a, b) in enumerate(cols):
            view = view.narrow(3 + dim, a, b - a)
        view[:, h0:h1].copy_(data.view(h1 - h0, 3, spec.head_rows // 3, *shape[1:]).transpose(0, 1))
        return
    view = target
    for dim, (a, b) in enumerate(ranges):
        view = view.narrow(dim, a, b - a)
    view.copy_(data)


def run_plan(
    plan: SyncPlan, sources: dict[str, torch.Tensor], write, done=None, group=None, like=None
):
    """Execute ``plan``: ``sources`` maps each tensor this rank holds of the actor to its
    local shard; ``write(piece, shard_ranges, data)`` stores a received piece; ``done(names)``
    is called after each bucket with the tensors whose last unit it held. Collective over
    ``group`` (default: the world; ranks are the world's). ``like``: a tensor with the dtype
    and device of the receive buffers (default: the sources'; a rank without sources must
    give one)."""
    like = like if like is not None else next(iter(sources.values()))
    last_bucket = {}
    for index, bucket in enumerate(plan.buckets):
        for name in bucket.names:
            last_bucket[name] = index
    for index, bucket in enumerate(plan.buckets):
        ops, inbox = [], {}
        for peer, pieces in sorted(bucket.sends.items()):
            flat = torch.cat([_source_view(plan, p, sources).reshape(-1) for p in pieces])
            ops.append(dist.P2POp(dist.isend, flat, _global(peer, group), group))
        for peer, pieces in sorted(bucket.recvs.items()):
            inbox[peer] = torch.empty(
                sum(p.numel for p in pieces), dtype=like.dtype, device=like.device
            )
            ops.append(dist.P2POp(dist.irecv, inbox[peer], _global(peer, group), group))
        requests = dist.batch_isend_irecv(ops) if ops else []
        for piece in bucket.local:  # overlaps the transfers
            write(piece, local_ranges(plan, piece), _source_view(plan, piece, sources))
        for request in requests:
            request.wait()
        for peer, pieces in sorted(bucket.recvs.items()):
            offset = 0
            for piece in pieces:
                data = inbox[peer][offset : offset + piece.numel]
                offset += piece.numel
                write(piece, local_ranges(plan, piece), data)
        if done is not None:
            done(sorted(n for n in bucket.names if last_bucket[n] == index))


def zero_padding(target: torch.Tensor, spec: TensorSpec, rank: int, tp: int) -> None:
    """Zero a vocab shard's rows past the real vocabulary (no sync writes them)."""
    if spec.kind == "vocab":
        start, end, per = vocab_rows(spec.shape[0], tp, rank, spec.vocab_multiple)
        target[max(end - start, 0) :].zero_()


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def describe_actor(model, rollout_tp_group) -> tuple[list[TensorSpec], RankLayout, dict]:
    """This rank's view of ``model`` (a ``BloomModel`` with an LM head): the specs of the
    tensors its stage holds (no target yet: see ``retarget`` of :func:`plan_from_actor`), its
    ``RankLayout`` in the world, and its local shards by HF name (the tied ``output_layer`` is
    the word embedding: not sent twice)."""
    from megatron_rlhf.checkpoint.hf_io import stage_layer_offset
    from megatron_rlhf.checkpoint.hf_names import full_hf_name, mapping_for

    arch, tp = model.arch, model.pg_collection.tp
    offset = stage_layer_offset(model)
    head_rows = 3 * (arch.hidden_size // arch.num_heads)
    specs, shards = [], {}
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            continue
        mapping = mapping_for(name, model.head, offset)
        hf_name = full_hf_name(mapping.hf_name)
        shape, split = list(param.shape), mapping.split_dim
        kind = "vocab" if mapping.is_vocab else "qkv" if "query_key_value" in hf_name else "plain"
        if split is None:
            shards[hf_name] = (0, 0)
        else:
            local = shape[split]
            start, stop = tp.rank() * local, (tp.rank() + 1) * local
            shape[split] = local * tp.size()
            if kind == "vocab":
                shape[0] = arch.vocab_size
                start, stop = min(start, arch.vocab_size), min(stop, arch.vocab_size)
            shards[hf_name] = (start, stop)
        specs.append(
            TensorSpec(hf_name, tuple(shape), split, kind, head_rows if kind == "qkv" else 1)
        )
    layout = RankLayout(
        shards,
        rollout_tp_group.rank() if rollout_tp_group is not None else None,
        rollout_tp_group.size() if rollout_tp_group is not None else 0,
    )
    return specs, layout, actor_sources(model)


def actor_sources(model) -> dict[str, torch.Tensor]:
    """This rank's actor shards by HF name, taken afresh at each sync (a parameter's tensor
    may be swapped between syncs: a checkpoint load, a buffer re-layout)."""
    from megatron_rlhf.checkpoint.hf_io import stage_layer_offset
    from megatron_rlhf.checkpoint.hf_names import full_hf_name, mapping_for

    offset = stage_layer_offset(model)
    return {
        full_hf_name(mapping_for(name, model.head, offset).hf_name): param.detach()
        for name, param in model.named_parameters()
        if name != "output_layer.weight"
    }


def plan_from_actor(
    model, rollout_tp_group, bucket_bytes: int, canonical_order: list[str], retarget
):
    """Gather every rank's description (one ``all_gather_object`` over the world, once) and
    build this rank's plan; returns ``(plan, sources)``. ``canonical_order``: the HF names in
    the order to send them (the specs of every stage, merged); ``retarget(spec)``: the spec
    as the rollout shards it (vLLM: ``vllm_layout.vllm_target``)."""
    specs, layout, sources = describe_actor(model, rollout_tp_group)
    dtypes = {tensor.dtype for tensor in sources.values()}
    if len(dtypes) != 1:
        raise ValueError(f"the actor's parameters mix dtypes {sorted(map(str, dtypes))}")
    element_bytes = next(iter(sources.values())).element_size()
    plan = _gathered_plan(specs, layout, bucket_bytes, element_bytes, canonical_order, retarget)
    return plan, sources


def plan_to_megatron(
    actor, rollout_model, rollout_tp: int, bucket_bytes: int, canonical_order: list[str]
) -> SyncPlan:
    """The plan of the disaggregated placement (``ppo/placement.py``): the training ranks hold
    the ``actor`` (``rollout_model`` None), the rollout ranks ``rollout_model``, our BLOOM at
    TP ``rollout_tp`` (``actor`` None); each rollout rank receives its Megatron-Core TP shard
    of every tensor of its pipeline stage (``rollout_targets``), a row range of the HF tensor
    (the fused QKV's heads lie in HF's order; the vocabulary is padded as
    ``padded_vocab_size``). Collective over the world."""
    from functools import partial

    from megatron_rlhf.models.bloom import padded_vocab_size

    if actor is not None:
        specs, mine, sources = describe_actor(actor, None)
        layout = RankLayout(mine.actor_shards, None, rollout_tp)
        element_bytes, vocab = next(iter(sources.values())).element_size(), actor.arch.vocab_size
    else:
        names = frozenset(rollout_targets(rollout_model))
        tp_rank = rollout_model.pg_collection.tp.rank()
        specs, layout = [], RankLayout({}, tp_rank, rollout_tp, names)
        element_bytes = next(rollout_model.parameters()).element_size()
        vocab = rollout_model.arch.vocab_size
    retarget = partial(megatron_target, padded_vocab=padded_vocab_size(vocab, rollout_tp))
    return _gathered_plan(specs, layout, bucket_bytes, element_bytes, canonical_order, retarget)


def rollout_targets(model) -> dict[str, torch.Tensor]:
    """A rollout copy's parameters (our BLOOM, any TP/PP) by the HF name whose shard each
    receives: its stage's layers; the word embedding on the first stage, and on the last the
    LM head tied to it (at PP = 1 the same tensor, once)."""
    from megatron_rlhf.checkpoint.hf_io import stage_layer_offset
    from megatron_rlhf.checkpoint.hf_names import full_hf_name, mapping_for

    offset, targets, head = stage_layer_offset(model), {}, None
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            head = param.data
            continue
        targets[full_hf_name(mapping_for(name, model.head, offset).hf_name)] = param.data
    if head is not None:
        embedding = "embedding.word_embeddings.weight"
        targets.setdefault(full_hf_name(mapping_for(embedding, model.head, offset).hf_name), head)
    return targets


def megatron_target(spec: TensorSpec, padded_vocab: int) -> TensorSpec:
    """``spec`` as our BLOOM shards it over the rollout TP: QKV rows as HF's, the vocabulary
    padded to ``padded_vocab`` rows."""
    from dataclasses import replace

    if spec.kind == "qkv":
        return replace(spec, kind="plain", head_rows=1)
    if spec.kind == "vocab":
        return replace(spec, vocab_multiple=padded_vocab)
    return spec


def _gathered_plan(specs, layout, bucket_bytes, element_bytes, canonical_order, retarget):
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (specs, layout))
        rank = dist.get_rank()
    else:
        gathered, rank = [(specs, layout)], 0
    every = {spec.name: spec for rank_specs, _ in gathered for spec in rank_specs}
    ordered = [every[name] for name in canonical_order if name in every]
    if len(ordered) != len(every):
        extra = sorted(set(every) - set(canonical_order))
        raise ValueError(f"tensors outside the canonical order: {extra[:3]}")
    ordered = [retarget(spec) for spec in ordered]
    layouts = [lay for _, lay in gathered]
    return build_plan(ordered, layouts, rank, bucket_bytes, element_bytes)
