"""torchrun worker (4 ranks, ``torchrun_harness``) for per-role layouts: the checks below, then
(``--train-ppo ARGS...``, last on the command line) one train-ppo run, in one launch.

Layouts: actor TP2xPP2 (DP1), rollout TP2 (DP2), single TP1 (DP4): the reference for
"parallel equals serial" is each replica of the TP1 layout, which holds the whole model.
"""

from __future__ import annotations

import argparse

import torch
from torchrun_harness import Harness

from megatron_rlhf.distributed.layouts import Layout

harness = Harness(__doc__)
harness.parser.add_argument("--hf", required=True)
harness.parser.add_argument(
    "--train-ppo", nargs=argparse.REMAINDER, help="then run train-ppo with these arguments"
)

LAYOUTS = {
    "actor": Layout(tp=2, pp=2, dp=1),
    "rollout": Layout(tp=2, pp=1, dp=2),
    "single": Layout(tp=1, pp=1, dp=4),
}


def check_handoff(groups) -> str:
    """gather_rows: ragged widths padded on the right side, rows in DP-rank order."""
    from megatron_rlhf.distributed.handoff import dp_rows, gather_rows

    batch = torch.arange(8 * 5).reshape(8, 5)
    for role in ("rollout", "single"):
        g, dp = groups[role], groups[role].pg_collection.dp
        rows = dp_rows(8, g.layout.dp, dp.rank())
        width = 2 + dp.rank()  # every replica a different width
        got = gather_rows(batch[rows, :width], dp, pad_value=-1)
        expected = torch.full((8, 1 + g.layout.dp), -1)
        for d in range(g.layout.dp):
            part = dp_rows(8, g.layout.dp, d)
            expected[part, : 2 + d] = batch[part, : 2 + d]
        assert torch.equal(got, expected), (role, got, expected)
    return "ragged rows gathered over DP=2 and DP=4 in rank order"


def check_global_state_sealed(groups, hf_dir) -> str:
    """With several layouts in the launch, every read of Megatron-Core's global parallel state
    (ours or Megatron-Core's own) fails, naming the role API; models take explicit groups."""
    from megatron.core import parallel_state

    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.distributed.groups import GlobalParallelStateError
    from megatron_rlhf.models.bloom import BloomModel

    stray_reads = {
        "tp size": parallel_state.get_tensor_model_parallel_world_size,
        "tp group": lambda: parallel_state.get_tensor_model_parallel_group().size(),
        "pp last stage": parallel_state.is_pipeline_last_stage,
        "pp next rank": parallel_state.get_pipeline_model_parallel_next_rank,
        "dp rank": parallel_state.get_data_parallel_rank,
        "dp group": lambda: torch.distributed.all_reduce(
            torch.zeros(1), group=parallel_state.get_data_parallel_group()
        ),
        "model without groups": lambda: BloomModel(checkpoint_architecture(hf_dir)),
    }
    for what, read in stray_reads.items():
        try:
            read()
        except GlobalParallelStateError as err:
            assert "model_groups(model)" in str(err), (what, str(err))
        else:
            raise AssertionError(f"{what}: read the global parallel state without an error")
    model = BloomModel(checkpoint_architecture(hf_dir), pg_collection=groups["actor"].pg_collection)
    assert model.pg_collection is groups["actor"].pg_collection
    return f"{len(stray_reads)} stray reads of the global state raise; explicit groups build"


def check_packed_rows(groups, hf_dir) -> str:
    """A packed row (sequences back to back, the key mask holding their ids) gives each token
    the logits of its padded row and of transformers, at TP2xPP2 (actor), TP2 (rollout) and TP1
    (single)."""
    from dist_bloom_common import ARCH_A, left_padded_batch
    from transformers import BloomForCausalLM

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.data.packing import pack_rows
    from megatron_rlhf.distributed.parallel import is_last_stage
    from megatron_rlhf.distributed.pipeline import gather_vocab_shards, pipeline_forward

    lengths = [5, 2, 7, 3]
    ids, mask = left_padded_batch(ARCH_A.vocab_size, lengths, seed=9)
    packed = pack_rows(ids, mask)
    with torch.no_grad():
        hf = BloomForCausalLM.from_pretrained(hf_dir).eval()
        reference = hf(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
    worst = 0.0
    for role in ("actor", "rollout", "single"):
        model = load_bloom(hf_dir, pg_collection=groups[role].pg_collection).eval()
        with torch.no_grad():
            padded = pipeline_forward(model, ids, mask)
            in_pack = pipeline_forward(model, packed.input_ids, packed.segments)
        pg = model.pg_collection
        if not is_last_stage(pg):
            assert padded is None and in_pack is None, role
            continue
        padded = gather_vocab_shards(padded, pg.tp)[..., : ARCH_A.vocab_size]
        in_pack = gather_vocab_shards(in_pack, pg.tp)[0, :, : ARCH_A.vocab_size]
        for row in range(len(lengths)):
            start, n = int(packed.starts[row]), lengths[row]
            mine = in_pack[start : start + n]
            real = mask[row].bool()
            assert (mine - padded[row][real]).abs().max() <= 1e-5, (role, row)
            worst = max(worst, float((mine - reference[row][real]).abs().max()))
    assert worst <= 1e-4, worst
    return f"packed = padded rows (1e-5) and transformers (max {worst:.1e}) at TP2xPP2, TP2, TP1"


def rollouts(groups, hf_dir, sampling):
    """Global responses from the training layout, the resharded layout and TP1 (DP4)."""
    from dist_bloom_common import ARCH_A, left_padded_batch

    from megatron_rlhf.checkpoint import checkpoint_architecture, load_bloom
    from megatron_rlhf.generation.rollout_engines import build_rollout_engine
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.ppo.rollout import rollout_global, step_row_seeds

    ids, mask = left_padded_batch(ARCH_A.vocab_size, [5, 3, 7, 2, 6, 1, 4, 5], seed=3)
    prompts = {"input_ids": ids, "attention_mask": mask, "index": torch.arange(8)}
    seeds = step_row_seeds(7, 2, 8)
    actor = load_bloom(hf_dir, pg_collection=groups["actor"].pg_collection)
    arch = checkpoint_architecture(hf_dir)

    def copy(rollout_groups):
        return BloomModel(arch, init_weights=False, pg_collection=rollout_groups.pg_collection)

    engines = {
        "training": build_rollout_engine(actor, groups["actor"], groups["actor"], None),
        "resharded": build_rollout_engine(actor, groups["actor"], groups["rollout"], copy),
        "resharded_tp1": build_rollout_engine(actor, groups["actor"], groups["single"], copy),
    }
    single = load_bloom(hf_dir, pg_collection=groups["single"].pg_collection)
    engines["single"] = build_rollout_engine(single, groups["single"], groups["single"], None)
    out = {}
    for name, engine in engines.items():
        engine.refresh()
        out[name] = rollout_global(engine, prompts, sampling, seeds)
    return out


def check_rollouts(groups, hf_dir, greedy: bool) -> str:
    from megatron_rlhf.generation import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=6, greedy=greedy, eos_id=2, pad_id=3)
    out = rollouts(groups, hf_dir, sampling)
    reference = out["single"]
    for name in ("training", "resharded", "resharded_tp1"):
        assert torch.equal(out[name].sequences, reference.sequences), name
        assert torch.equal(out[name].response_mask, reference.response_mask), name
    kind = "greedy" if greedy else "sampled (row seeds)"
    shape = tuple(reference.sequences.shape)
    return f"{kind} tokens of TP2xPP2, resharded to TP2/DP2 and to TP1/DP4, TP1 equal: {shape}"


@harness.check
def global_state_sealed(args) -> str:
    return check_global_state_sealed(layout_groups(), args.hf)


@harness.check
def handoff_gather_rows(args) -> str:
    return check_handoff(layout_groups())


@harness.check
def packed_rows_layouts(args) -> str:
    return check_packed_rows(layout_groups(), args.hf)


@harness.check
def rollout_greedy_layouts(args) -> str:
    return check_rollouts(layout_groups(), args.hf, greedy=True)


@harness.check
def rollout_sampled_layouts(args) -> str:
    return check_rollouts(layout_groups(), args.hf, greedy=False)


@harness.check
def train_ppo(args) -> str | None:
    """Last: one train-ppo run in this launch (its own layouts; it tears the groups down);
    ``test_layouts_parallel`` compares its metrics with the single process's."""
    if args.train_ppo is None:
        return None
    from megatron_rlhf.ppo.train_cli import main as train_ppo_main

    code = train_ppo_main(args.train_ppo)
    assert code == 0, f"train-ppo exited with {code}"
    return "train-ppo ran (metrics compared by the test)"


_GROUPS: dict = {}


def layout_groups() -> dict:
    """The three layouts' groups, built on first use (collective; every rank runs every check
    in the same order)."""
    if not _GROUPS:
        from megatron_rlhf.distributed import initialize_layouts
        from megatron_rlhf.distributed.groups import seed_layout

        _GROUPS.update(initialize_layouts(LAYOUTS))
        seed_layout(_GROUPS["actor"], 1234)
    return _GROUPS


if __name__ == "__main__":
    harness.main()
