"""``python -m megatron_rlhf eval-policy``: win/tie/lose of a policy against the SFT policy.

    torchrun --nproc-per-node N -m megatron_rlhf eval-policy --policy DIR --sft DIR \\
        --main main.jsonl [--forget forget.jsonl] --output-dir OUT \\
        (--judge AM_OR_RM_DIR [--judge-kind am|rm] | --score-fn package.module:function) \\
        [--tie-margin 0.0] [--parallel policy.tp=T policy.pp=P judge.tp=T2 judge.pp=P2] \\
        [--max-new-tokens K] [--greedy | --temperature X --top-p Y --seed S] [--batch-size B] \\
        [--label NAME]

The paper's Table 2: for every prompt of a set, the policy and the SFT model each answer; the
judge compares the two answers; the table reports Win / Lose / Tie in percent over the SFT
model, on the main test set and on the "forget" test set (prompts of the SFT test data, where a
drop shows catastrophic forgetting). How this departs from the paper: its judge is GPT-4; here
it is a reward/advantage model's score difference ``d = s(policy) - s(SFT)`` (win if
``d > margin``, lose if ``d < -margin``, else tie) or a user function ``(prompt_ids,
response_ids) -> float`` compared the same way. Two identical responses are always a tie (the
judge's two forward passes may differ in the last float bit). We also report the net win rate
(win - lose).

Both models decode with the same settings and the same seed per batch (common random numbers:
a policy equal to the SFT model gives identical samples, hence all ties). Models are loaded one
at a time (policy, then SFT, then the judge). Two roles, each in its own layout
(``--parallel policy.tp=2 judge.tp=1``; ``--tp``/``--pp`` or ``tp=``/``pp=`` set both): the policy
and the SFT model generate in the ``policy`` layout, prompts split over its data-parallel
replicas; the judge scores every generated batch in the ``judge`` layout, batches split over its
replicas, so the report does not depend on the layouts (the verdicts and files live in
``evaluate_report.py``).
``--policy`` may be an HF BLOOM dir, a megatron-rlhf LM checkpoint, a ``train-ppo`` step
checkpoint, or a ``train-ppo`` output dir (its latest checkpoint). OUT receives
``eval_policy_samples.jsonl``, ``eval_policy.md`` and, last, ``eval_policy.json``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlhf.distributed.layouts import add_parallel_arguments
from megatron_rlhf.generation.prompts import (
    add_generation_arguments,
    sampling_from_args,
)
from megatron_rlhf.ppo.config import RolloutConfig
from megatron_rlhf.ppo.evaluate_inputs import ROLES, validate_inputs
from megatron_rlhf.ppo.evaluate_report import (
    SET_NAMES,
    check_finite,
    sample_records,
    summarize_samples,
    summary_fields,
    write_outputs,
)
from megatron_rlhf.utils import (
    is_rank0,
    print_summary,
    run_command,
)

if TYPE_CHECKING:  # torch loads when a function needs it, so --help stays fast
    import torch

POLICY_ROLE = "actor"  # the role prefix of the policy inside a train-ppo checkpoint
JUDGE_SAMPLING = RolloutConfig()  # the judge reads a scalar head: temperature 1, no top-p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rlhf eval-policy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--policy",
        required=True,
        help="HF BLOOM dir, LM checkpoint, train-ppo step checkpoint or train-ppo output dir",
    )
    parser.add_argument("--sft", required=True, help="the SFT policy it is compared with")
    parser.add_argument("--main", required=True, help="main test prompts (JSONL)")
    parser.add_argument("--forget", help="forget test prompts (JSONL, from the SFT test data)")
    parser.add_argument("--judge", help="reward/advantage model checkpoint (scalar head)")
    parser.add_argument(
        "--judge-kind", choices=("am", "rm"), default="am", help="am: a = r - e_tau(x); rm: r"
    )
    parser.add_argument(
        "--score-fn",
        help="instead of --judge: package.module:function (imports and runs that Python code)",
    )
    parser.add_argument("--tie-margin", type=float, default=0.0, help="|d| <= margin is a tie")
    parser.add_argument("--tokenizer", help="HF tokenizer dir (default: --sft if it has one)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report")
    parser.add_argument("--label", help="model name in the Markdown table (default: --policy)")
    add_parallel_arguments(parser, ROLES)
    add_generation_arguments(parser)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (GPU only)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_command("eval-policy", lambda: run(args, validate_inputs(args)))


def load_policy(directory: str, params_dtype: torch.dtype, pg_collection=None):
    """The LM of an HF dir or a megatron-rlhf checkpoint, or the actor of a train-ppo one, built
    on ``pg_collection`` (default: the launch's one layout)."""
    from megatron_rlhf.checkpoint import checkpoint_architecture, is_hf_checkpoint, load_bloom
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.models.bloom import BloomModel

    roles = [] if is_hf_checkpoint(directory) else dist_ckpt.read_metadata(directory).get("roles")
    if POLICY_ROLE not in (roles or []):
        return load_bloom(
            directory, head="lm", params_dtype=params_dtype, init_weights=False,
            pg_collection=pg_collection,
        )  # fmt: skip
    model = BloomModel(
        checkpoint_architecture(directory), head="lm", params_dtype=params_dtype,
        init_weights=False, pg_collection=pg_collection,
    )  # fmt: skip
    prefix = POLICY_ROLE + "."
    loaded = dist_ckpt.load(directory, model.sharded_state_dict(prefix=prefix))
    model.load_state_dict({key.removeprefix(prefix): value for key, value in loaded.items()})
    return model


def rank_batches(records: list, batch_size: int, pad_id: int, dp_rank: int, dp_size: int):
    """This data-parallel rank's share of the prompts (every dp_size-th), left-padded: a list
    of batches."""
    import torch

    from megatron_rlhf.generation.prompts import left_pad

    mine = list(range(dp_rank, len(records), dp_size))
    batches = []
    for first in range(0, len(mine), batch_size):
        index = mine[first : first + batch_size]
        ids, mask = left_pad([records[i][1] for i in index], pad_id)  # (B, P)
        batches.append({"input_ids": ids, "attention_mask": mask, "index": torch.tensor(index)})
    return batches


def generate_sets(engine, batches: dict, sampling, desc: str) -> dict:
    """{set: [Experience per batch]}: one response per prompt of this rank's batches, from a
    rollout engine (``generation/rollout_engines.py``)."""
    from tqdm import tqdm

    from megatron_rlhf.ppo.rollout import rollout

    out, step = {}, 0
    idle = engine.idle_calls(sum(len(set_batches) for set_batches in batches.values()))
    for name, set_batches in batches.items():
        out[name] = []
        for batch in tqdm(set_batches, desc=f"{desc} {name}", disable=not is_rank0()):
            seed = sampling.seed + 1_000_003 * step  # same per batch for policy and SFT
            out[name].append(rollout(engine, batch, replace(sampling, seed=seed)))
            step += 1
    for _ in range(idle):  # vLLM's replicas step together: as many calls as the busiest rank
        engine.idle_call()
    return out


def score_sets(experiences: dict, judge, judge_kind: str, reward_fn, batching) -> dict:
    """Fill ``scores`` of every Experience with the judge model or the score function, in
    ``batching``'s micro-batches (a ``ppo.microbatch.Batching``)."""
    from megatron_rlhf.ppo.scoring import score

    models = {} if judge is None else {"scores": judge}
    for batches in experiences.values():
        for experience in batches:
            score(experience, models, judge_kind, JUDGE_SAMPLING, batching, reward_fn)
    return experiences


# ---------------------------------------------------------------- run


def score_in_judge_layout(outputs: list[dict], judge, judge_kind: str, batching, policy_groups):
    """Fill ``scores`` of every generated batch (``outputs``: this policy replica's
    ``generate_sets`` results) with the judge in its own layout: every batch of every policy
    replica is handed to every rank, each data-parallel rank of the judge scores its share of
    them (each batch scored whole, as a single process scores it) and the scores are gathered
    back (``handoff.for_each_dp_shard``). Collective over the world."""
    import torch.distributed as dist

    from megatron_rlhf.distributed.handoff import for_each_dp_shard
    from megatron_rlhf.ppo.scoring import score

    mine = [experience for out in outputs for batches in out.values() for experience in batches]
    leader = policy_groups.tp.rank() == 0 and policy_groups.pp.rank() == 0
    shared = [_cpu(experience) for experience in mine] if leader else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (policy_groups.dp.rank(), shared))
    by_replica = dict(sorted((rank, batches) for rank, batches in everyone if batches is not None))
    every_batch = [(rank, b) for rank, batches in by_replica.items() for b in batches]

    def score_batches(items):
        return [
            score(b, {"scores": judge}, judge_kind, JUDGE_SAMPLING, batching).scores.cpu()
            for _, b in items
        ]

    scores = for_each_dp_shard(judge.pg_collection.dp, every_batch, score_batches)
    ours = [s for (rank, _), s in zip(every_batch, scores) if rank == policy_groups.dp.rank()]
    for experience, batch_scores in zip(mine, ours, strict=True):
        experience.scores = batch_scores.to(experience.sequences.device)


def _cpu(experience):
    from dataclasses import fields, replace

    import torch

    return replace(
        experience,
        **{
            f.name: getattr(experience, f.name).cpu()
            for f in fields(experience)
            if isinstance(getattr(experience, f.name), torch.Tensor)
        },
    )


def run(args, plan: dict) -> int:
    import torch
    import torch.distributed as dist

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import destroy, initialize_layouts
    from megatron_rlhf.distributed.groups import seed_layout
    from megatron_rlhf.generation.prompts import engine_from_args
    from megatron_rlhf.ppo.microbatch import Batching

    start = time.time()
    tokenizer, prompt_sets = plan["tokenizer"], plan["prompt_sets"]
    sampling = sampling_from_args(args, tokenizer)
    groups = initialize_layouts(plan["layouts"])
    engine = None
    try:
        dtype = torch.bfloat16 if (args.bf16 and torch.cuda.is_available()) else torch.float32
        policy_groups = groups["policy"].pg_collection
        seed_layout(groups["policy"], args.seed)
        policy = load_policy(plan["policy_dir"], dtype, policy_groups)
        dp = policy_groups.dp
        batches = {
            name: rank_batches(records, args.batch_size, sampling.pad_id, dp.rank(), dp.size())
            for name, records in prompt_sets.items()
        }
        longest = max(len(ids) for records in prompt_sets.values() for _, ids in records)
        engine = engine_from_args(args, policy, longest, policy_groups)
        policy_out = generate_sets(engine, batches, sampling, "policy")
        del policy
        sft = load_bloom(
            args.sft, head="lm", params_dtype=dtype, init_weights=False,
            pg_collection=policy_groups,
        )  # fmt: skip
        engine.actor = sft  # the same engine generates with the SFT model's weights
        engine.refresh()
        sft_out = generate_sets(engine, batches, sampling, "sft")
        engine.close()  # before destroy(): vLLM's teardown takes torch.distributed with it
        del sft
        engine = None
        batching = Batching(
            micro_batch_size=args.batch_size, max_tokens=None, pad_id=sampling.pad_id
        )
        if args.judge is None:
            for out in (policy_out, sft_out):
                score_sets(out, None, args.judge_kind, plan["reward_fn"], batching)
        else:
            judge = load_bloom(
                args.judge, head="scalar", num_scalar_outputs=2 if args.judge_kind == "am" else 1,
                params_dtype=dtype, init_weights=False, pg_collection=groups["judge"].pg_collection,
            ).eval()  # fmt: skip
            score_in_judge_layout(
                [policy_out, sft_out], judge, args.judge_kind, batching, policy_groups
            )
            del judge
        samples = sample_records(prompt_sets, policy_out, sft_out, tokenizer, args.tie_margin)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, samples)
    finally:
        if engine is not None:
            engine.close()
        destroy()
    merged = {(s["set"], s["index"]): s for part in gathered for s in part}
    samples = [merged[key] for key in sorted(merged, key=lambda k: (SET_NAMES.index(k[0]), k[1]))]
    check_finite(samples)
    results = {name: summarize_samples([s for s in samples if s["set"] == name])
               for name in prompt_sets}  # fmt: skip
    report = {"sets": results, "settings": settings_of(args, plan)}
    if is_rank0():
        write_outputs(Path(args.output_dir), report, samples, args.label or args.policy)
    print_summary("eval-policy", **summary_fields(report), seconds=round(time.time() - start, 1),
                  output=args.output_dir)  # fmt: skip
    return 0


def settings_of(args, plan: dict) -> dict:
    return {
        "policy": plan["policy_dir"],
        "sft": args.sft,
        "judge": args.judge or args.score_fn,
        "judge_kind": args.judge_kind if args.judge else "score_fn",
        "tie_margin": args.tie_margin,
        "prompts": {name: getattr(args, name) for name in plan["prompt_sets"]},
        "max_new_tokens": args.max_new_tokens,
        "greedy": args.greedy,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "tp": args.tp,
        "pp": args.pp,
        "parallel": {role: layout.as_dict() for role, layout in plan["layouts"].items()},
    }
