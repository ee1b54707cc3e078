"""The shard-to-shard sync plan (``generation/shard_sync.py``) with vLLM's rules
(``generation/vllm_layout.py``), in process: every rank's plan of a simulated world, executed
by handing each piece from its source rank's actor shard to its destination, against a
reference built the way vLLM builds its shards (the full tensor, then vLLM's QKV repack,
narrow and vocabulary padding)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.generation import shard_sync as ss
from megatron_rlhf.generation.vllm_layout import vllm_target, vllm_vocab_rows
from megatron_rlhf.models.bloom.config import padded_vocab_size

HIDDEN, HEADS, LAYERS = 16, 4, 2
HEAD_DIM = HIDDEN // HEADS


def _full_tensors(vocab: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, int | None, str]]:
    """Full HF tensors (real vocabulary rows), their TP split dim and kind."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    out = {"transformer.word_embeddings.weight": (rand(vocab, HIDDEN), 0, "vocab")}
    out["transformer.word_embeddings_layernorm.weight"] = (rand(HIDDEN), None, "plain")
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        out[p + "self_attention.query_key_value.weight"] = (rand(3 * HIDDEN, HIDDEN), 0, "qkv")
        out[p + "self_attention.query_key_value.bias"] = (rand(3 * HIDDEN), 0, "qkv")
        out[p + "self_attention.dense.weight"] = (rand(HIDDEN, HIDDEN), 1, "plain")
        out[p + "self_attention.dense.bias"] = (rand(HIDDEN), None, "plain")
        out[p + "mlp.dense_h_to_4h.weight"] = (rand(4 * HIDDEN, HIDDEN), 0, "plain")
        out[p + "mlp.dense_h_to_4h.bias"] = (rand(4 * HIDDEN), 0, "plain")
        out[p + "mlp.dense_4h_to_h.weight"] = (rand(HIDDEN, 4 * HIDDEN), 1, "plain")
    out["transformer.ln_f.bias"] = (rand(HIDDEN), None, "plain")
    return out


def _stage_of(name: str, pp: int) -> list[int]:
    if ".h." in name:
        return [int(name.split(".")[2]) // (LAYERS // pp)]
    return [0] if "word_embeddings" in name else [pp - 1]


def _world(full, vocab, actor_tp, actor_pp, world, rollout_tp):
    """Every rank's (RankLayout, sources): Megatron's rank order (TP fastest, then DP, PP)."""
    dp = world // (actor_tp * actor_pp)
    ranks = []
    for rank in range(world):
        a, p = rank % actor_tp, rank // (actor_tp * dp)
        shards, sources = {}, {}
        for name, (tensor, split, kind) in full.items():
            if p not in _stage_of(name, actor_pp):
                continue
            if split is None:
                shards[name], sources[name] = (0, 0), tensor.clone()
                continue
            if kind == "vocab":  # Megatron's padding rows hold garbage: they must not be sent
                padded = padded_vocab_size(vocab, actor_tp)
                tensor = torch.cat([tensor, torch.full((padded - vocab, HIDDEN), 7e7)])
            local = tensor.shape[split] // actor_tp
            sources[name] = tensor.narrow(split, a * local, local).clone()
            start, stop = a * local, (a + 1) * local
            if kind == "vocab":
                start, stop = min(start, vocab), min(stop, vocab)
            shards[name] = (start, stop)
        ranks.append((ss.RankLayout(shards, rank % rollout_tp, rollout_tp), sources))
    return ranks


def _vllm_reference(tensor, split, kind, rank, tp, vocab):
    """The rollout shard as vLLM's loaders build it from the full HF tensor."""
    if split is None:
        return tensor
    if kind == "qkv":  # BloomModel._repack_qkv, then QKVParallelLinear's q/k/v narrow
        shape = tensor.shape
        tensor = tensor.view(HEADS, 3, -1, *shape[1:]).transpose(0, 1).reshape(shape)
        per = HIDDEN // tp
        parts = [tensor.narrow(0, j * HIDDEN + rank * per, per) for j in range(3)]
        return torch.cat(parts)
    if kind == "vocab":  # VocabParallelEmbedding: pad to 64, equal blocks, zero past vocab
        padded = -(-vocab // 64) * 64
        per = padded // tp
        out = torch.zeros(per, HIDDEN)
        start = rank * per
        real = max(min(per, vocab - start), 0)
        out[:real] = tensor[start : start + real]
        return out
    per = tensor.shape[split] // tp
    return tensor.narrow(split, rank * per, per)


def _run(world_ranks, specs, bucket_bytes):
    layouts = [lay for lay, _ in world_ranks]
    plans = [ss.build_plan(specs, layouts, r, bucket_bytes, 4) for r in range(len(layouts))]
    for r, plan in enumerate(plans):  # the same buckets everywhere; sends match receives
        assert len(plan.buckets) == len(plans[0].buckets)
        for i, bucket in enumerate(plan.buckets):
            for peer, pieces in bucket.sends.items():
                assert plans[peer].buckets[i].recvs.get(r) == pieces
            for peer, pieces in bucket.recvs.items():
                assert plans[peer].buckets[i].sends.get(r) == pieces
    shards = []
    for plan in plans:
        targets = {}
        for spec in specs:
            shape = ss.rollout_shard_shape(spec, plan.rollout_tp)
            targets[spec.name] = torch.full(shape, float("nan"))
            ss.zero_padding(targets[spec.name], spec, plan.rollout_rank, plan.rollout_tp)
        for bucket in plan.buckets:
            pieces = bucket.local + [p for ps in bucket.recvs.values() for p in ps]
            for piece in pieces:
                src_plan, src_sources = plans[piece.src], world_ranks[piece.src][1]
                data = ss._source_view(src_plan, piece, src_sources).clone()
                spec = plan.specs[piece.name]
                ss.write_piece(targets[piece.name], spec, ss.local_ranges(plan, piece), data)
        shards.append(targets)
    return plans, shards


def _specs(full):
    specs = []
    for name, (tensor, split, kind) in full.items():
        rows = 3 * HEAD_DIM if kind == "qkv" else 1
        specs.append(vllm_target(ss.TensorSpec(name, tuple(tensor.shape), split, kind, rows)))
    return specs


@pytest.mark.parametrize(
    "actor_tp,actor_pp,world,rollout_tp,vocab,bucket_bytes,remote",
    [
        (1, 1, 2, 2, 250, 1 << 20, False),  # 1 -> 2: each rank holds the whole actor
        (2, 1, 2, 1, 250, 1 << 20, True),  # 2 -> 1: the other half from the peer
        (2, 1, 2, 2, 2048, 1 << 20, False),  # same layout, same vocab split: all local
        # same layout, but Megatron pads 250 to 1,024 (rank 0 holds every real row) and vLLM
        # to 256 (rank 1 needs rows 128-249): only those rows move
        (2, 1, 2, 2, 250, 1 << 20, True),
        (2, 1, 4, 2, 250, 512, True),  # two replicas; small buckets split tensors in rows
        (1, 2, 4, 2, 250, 300, True),  # PP stages send their layers; buckets < a row
        (4, 1, 4, 2, 130, 1 << 20, True),  # vocab 130 -> vLLM 192 rows, Megatron 512
        (2, 1, 4, 4, 250, 2048, True),  # 2 -> 4
        (4, 1, 4, 1, 250, 1 << 20, True),  # 4 -> 1
    ],
)
def test_plan_gives_each_rank_the_vllm_shard(
    actor_tp, actor_pp, world, rollout_tp, vocab, bucket_bytes, remote
):
    full = _full_tensors(vocab)
    specs = _specs(full)
    world_ranks = _world(full, vocab, actor_tp, actor_pp, world, rollout_tp)
    plans, shards = _run(world_ranks, specs, bucket_bytes)
    shard_numel = 0
    for r, targets in enumerate(shards):
        rank = r % rollout_tp
        for name, (tensor, split, kind) in full.items():
            expected = _vllm_reference(tensor, split, kind, rank, rollout_tp, vocab)
            assert torch.equal(targets[name], expected), (name, r)
        # bytes: exactly this rank's shard (real rows), whatever the actor's layout
        shard_numel = sum(
            torch.Size([b - a for a, b in ss.rollout_shard(spec, rank, rollout_tp)]).numel()
            for spec in specs
        )
        assert plans[r].received_bytes == 4 * shard_numel
        # a rank that holds what it needs (same layout, or the whole actor) receives nothing
        if not remote:
            assert plans[r].remote_bytes == 0, plans[r].remote_bytes
        elif actor_tp == rollout_tp and actor_pp == 1:  # only vLLM rank 1's real vocab rows
            assert plans[r].remote_bytes == (4 * HIDDEN * (vocab - 128) if r % 2 else 0)
    assert any(plan.remote_bytes for plan in plans) == remote
    full_numel = sum(t.numel() for t, _, _ in full.values())
    if rollout_tp > 1:  # a shard is ~1/TP of the model (replicated norms and biases aside)
        assert shard_numel < 1.1 * full_numel / rollout_tp
    for plan in plans:  # no bucket holds more than bucket_bytes a rank, but for one row
        for bucket in plan.buckets:
            pieces = bucket.local + [p for ps in bucket.recvs.values() for p in ps]
            assert 4 * sum(p.numel for p in pieces) <= max(bucket_bytes, 4 * 3 * HEAD_DIM * HIDDEN)


def test_units_never_split_a_head():
    spec = ss.TensorSpec("qkv", (3 * HIDDEN, HIDDEN), 0, "qkv", 3 * HEAD_DIM)
    units = ss._units(spec, 1, 4 * HIDDEN * (3 * HEAD_DIM + 1), 4)
    assert all((stop - first) % (3 * HEAD_DIM) == 0 for first, stop in units)
    assert units[-1][1] == 3 * HIDDEN


def test_vllm_vocab_rows_match_vllm():
    """Our copy of vLLM's vocabulary sharding agrees with vLLM's own (when it is installed)."""
    vpe = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    for vocab, tp in [(250, 1), (250, 2), (130, 2), (512, 4), (250880, 8)]:
        for rank in range(tp):
            ours = vllm_vocab_rows(vocab, tp, rank)
            padded = vpe.pad_vocab_size(vocab)
            indices = vpe.VocabParallelEmbedding._get_indices(
                padded, padded, vocab, vocab, rank, tp
            )
            assert ours[:2] == (indices.padded_org_vocab_start_index, indices.org_vocab_end_index)
            assert ours[2] == padded // tp
