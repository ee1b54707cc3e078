"""``python -m megatron_rlhf eval-policy``: win/tie/lose of a policy against the SFT policy.

    torchrun --nproc-per-node N -m megatron_rlhf eval-policy --policy DIR --sft DIR \\
        --main main.jsonl [--forget forget.jsonl] --output-dir OUT \\
        (--judge AM_OR_RM_DIR [--judge-kind am|rm] | --score-fn package.module:function) \\
        [--tie-margin 0.0] [--tp T --pp P] [--max-new-tokens K] [--greedy | --temperature X \\
        --top-p Y --seed S] [--batch-size B] [--label NAME]

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
at a time (policy, then SFT, then the judge). Prompts are split over data-parallel replicas.
``--policy`` may be an HF BLOOM dir, a megatron-rlhf LM checkpoint, a ``train-ppo`` step
checkpoint, or a ``train-ppo`` output dir (its latest checkpoint). OUT receives
``eval_policy_samples.jsonl``, ``eval_policy.md`` and, last, ``eval_policy.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlhf.generation.cli import (
    add_generation_arguments,
    check_generation_arguments,
    sampling_from_args,
)
from megatron_rlhf.utils import (
    InputError,
    atomic_output,
    check_output_path,
    is_rank0,
    print_summary,
    run_command,
    write_json,
)

if TYPE_CHECKING:  # torch loads when a function needs it, so --help stays fast
    import torch

SET_NAMES = ("main", "forget")
VERDICT_NAMES = {1: "win", 0: "tie", -1: "lose"}
POLICY_ROLE = "actor"  # the role prefix of the policy inside a train-ppo checkpoint


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
    add_generation_arguments(parser)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (GPU only)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_command("eval-policy", lambda: run(args, validate_inputs(args)))


# ---------------------------------------------------------------- pure math


def verdicts(
    policy_scores: torch.Tensor,  # (B,)
    sft_scores: torch.Tensor,  # (B,)
    identical: torch.Tensor,  # (B,) bool: the two responses are the same tokens
    tie_margin: float,
) -> torch.Tensor:
    """+1 win, 0 tie, -1 lose per prompt from ``d = s_policy - s_sft`` (in float64): win if
    ``d > tie_margin``, lose if ``d < -tie_margin``, and a tie for identical responses. (B,)"""
    import torch

    diff = policy_scores.double() - sft_scores.double()
    verdict = (diff > tie_margin).long() - (diff < -tie_margin).long()
    return torch.where(identical, 0, verdict)


def summarize(
    verdict: torch.Tensor,  # (B,) +1 / 0 / -1
    policy_scores: torch.Tensor,  # (B,)
    sft_scores: torch.Tensor,  # (B,)
) -> dict:
    """Counts and rates of one prompt set (Table 2 reports the rates in percent)."""
    count = verdict.numel()
    wins, ties, loses = (int((verdict == v).sum()) for v in (1, 0, -1))
    return {
        "num_prompts": count,
        "win": wins,
        "tie": ties,
        "lose": loses,
        "win_rate": wins / count,
        "tie_rate": ties / count,
        "lose_rate": loses / count,
        "net_win_rate": (wins - loses) / count,
        "mean_score_policy": float(policy_scores.double().mean()),
        "mean_score_sft": float(sft_scores.double().mean()),
    }


# ---------------------------------------------------------------- validation (no model memory)


def validate_inputs(args) -> dict:
    """Every check that needs no model memory; returns the plan (paths, prompts, tokenizer)."""
    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.distributed import ParallelConfig, validate
    from megatron_rlhf.generation.cli import read_prompts, resolve_tokenizer
    from megatron_rlhf.ppo.setup import import_reward_fn, world_size
    from megatron_rlhf.training import run_lock

    if (args.judge is None) == (args.score_fn is None):
        raise InputError("give exactly one judge: --judge CHECKPOINT or --score-fn pkg.mod:fn")
    _check_numbers(args)
    for name in OUTPUT_FILES:
        check_output_path(Path(args.output_dir) / name, args.overwrite, "--output-dir")
    run_lock.lock_output(args.output_dir, "--output-dir")
    policy_dir = resolve_policy_dir(args.policy)
    model_dirs = {"--policy": policy_dir, "--sft": args.sft}
    if args.judge is not None:
        model_dirs["--judge"] = args.judge
    vocab_sizes = {}
    for flag, directory in model_dirs.items():
        if not Path(directory).is_dir():
            raise InputError(f"{flag} {directory}: no such checkpoint directory")
        arch = checkpoint_architecture(directory)
        try:
            validate(ParallelConfig(tp=args.tp, pp=args.pp), world_size(), arch.num_heads,
                     arch.num_layers)  # fmt: skip
        except InputError as err:
            raise InputError(
                f"{flag} {directory} with --tp {args.tp} --pp {args.pp}: {err}"
            ) from None
        vocab_sizes[flag] = arch.vocab_size
        if flag != "--judge":
            max_prompt_length = check_generation_arguments(args, arch.max_sequence_length)
    if len(set(vocab_sizes.values())) > 1:
        raise InputError(f"the models' vocabularies differ: {vocab_sizes}; they must share one")
    _check_policy_head(policy_dir)
    if args.judge is not None:
        _check_judge(args.judge, args.judge_kind)
    reward_fn = None
    if args.score_fn is not None:
        reward_fn = import_reward_fn(args.score_fn, key="--score-fn")
    tokenizer = resolve_tokenizer(args.tokenizer, args.sft)
    prompt_sets = {}
    for name in SET_NAMES:
        path = getattr(args, name)
        if path is None:
            continue
        prompt_sets[name] = read_prompts(
            path, tokenizer, vocab_sizes["--sft"], max_prompt_length, args.truncate_prompts
        )
    return {
        "policy_dir": policy_dir,
        "reward_fn": reward_fn,
        "tokenizer": tokenizer,
        "prompt_sets": prompt_sets,
    }


def _check_numbers(args) -> None:
    problems = []
    if not args.tie_margin >= 0:
        problems.append(f"--tie-margin must be >= 0, got {args.tie_margin}")
    if Path(args.output_dir).is_file():
        problems.append(f"--output-dir {args.output_dir} is a file; give a directory")
    if problems:
        raise InputError("; ".join(problems))


def resolve_policy_dir(directory: str) -> str:
    """A ``train-ppo`` output dir stands for its latest checkpoint."""
    from megatron_rlhf.training.checkpointing import latest_checkpoint

    latest = latest_checkpoint(directory) if Path(directory).is_dir() else None
    return str(latest) if latest is not None else directory


def _check_policy_head(directory: str) -> None:
    from megatron_rlhf.checkpoint import is_hf_checkpoint
    from megatron_rlhf.checkpoint.dist import read_metadata

    if is_hf_checkpoint(directory):
        return
    meta = read_metadata(directory)
    if meta["head"] != "lm":
        raise InputError(
            f"--policy {directory}: holds a {meta['head']!r} head; the policy must be a "
            "language model (an SFT/PPO actor checkpoint)"
        )


def _check_judge(directory: str, kind: str) -> None:
    from megatron_rlhf.checkpoint import is_hf_checkpoint
    from megatron_rlhf.checkpoint.dist import read_metadata

    if is_hf_checkpoint(directory):
        raise InputError(
            f"--judge {directory}: a Hugging Face LM, not a trained reward/advantage model; "
            "train one with `train-reward` (or use --score-fn)"
        )
    meta = read_metadata(directory)
    expected = 2 if kind == "am" else 1
    if meta["head"] != "scalar" or meta["num_scalar_outputs"] != expected:
        raise InputError(
            f"--judge {directory}: holds a {meta['head']!r} head with "
            f"{meta['num_scalar_outputs']} outputs; --judge-kind {kind} needs a scalar head with "
            f"{expected} ({'r and e_tau' if kind == 'am' else 'r'})"
        )


# ---------------------------------------------------------------- models


def load_policy(directory: str, params_dtype: torch.dtype):
    """The LM of an HF dir or a megatron-rlhf checkpoint, or the actor of a train-ppo one."""
    from megatron_rlhf.checkpoint import checkpoint_architecture, is_hf_checkpoint, load_bloom
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.models.bloom import BloomModel

    roles = [] if is_hf_checkpoint(directory) else dist_ckpt.read_metadata(directory).get("roles")
    if POLICY_ROLE not in (roles or []):
        return load_bloom(directory, head="lm", params_dtype=params_dtype, init_weights=False)
    model = BloomModel(
        checkpoint_architecture(directory), head="lm", params_dtype=params_dtype,
        init_weights=False,
    )  # fmt: skip
    prefix = POLICY_ROLE + "."
    loaded = dist_ckpt.load(directory, model.sharded_state_dict(prefix=prefix))
    model.load_state_dict({key.removeprefix(prefix): value for key, value in loaded.items()})
    return model


def rank_batches(records: list, batch_size: int, pad_id: int, dp_rank: int, dp_size: int):
    """This data-parallel rank's share of the prompts (every dp_size-th), left-padded: a list
    of batches."""
    import torch

    from megatron_rlhf.generation.cli import left_pad

    mine = list(range(dp_rank, len(records), dp_size))
    batches = []
    for first in range(0, len(mine), batch_size):
        index = mine[first : first + batch_size]
        ids, mask = left_pad([records[i][1] for i in index], pad_id)  # (B, P)
        batches.append({"input_ids": ids, "attention_mask": mask, "index": torch.tensor(index)})
    return batches


def generate_sets(model, batches: dict, sampling, desc: str) -> dict:
    """{set: [Experience per batch]}: one response per prompt of this rank's batches."""
    from tqdm import tqdm

    from megatron_rlhf.ppo.rollout import rollout

    out, step = {}, 0
    for name, set_batches in batches.items():
        out[name] = []
        for batch in tqdm(set_batches, desc=f"{desc} {name}", disable=not is_rank0()):
            seed = sampling.seed + 1_000_003 * step  # same per batch for policy and SFT
            out[name].append(rollout(model, batch, replace(sampling, seed=seed)))
            step += 1
    return out


def score_sets(experiences: dict, judge, judge_kind: str, reward_fn, batch_size: int) -> dict:
    """Fill ``scores`` of every Experience with the judge model or the score function."""
    from megatron_rlhf.ppo.scoring import score

    models = {} if judge is None else {"reward": judge}
    for batches in experiences.values():
        for experience in batches:
            score(experience, models, judge_kind, 1.0, batch_size, reward_fn)
    return experiences


# ---------------------------------------------------------------- run


def run(args, plan: dict) -> int:
    import torch
    import torch.distributed as dist

    from megatron_rlhf.checkpoint import checkpoint_architecture, load_bloom
    from megatron_rlhf.distributed import ParallelConfig, destroy, initialize

    start = time.time()
    tokenizer, prompt_sets = plan["tokenizer"], plan["prompt_sets"]
    sampling = sampling_from_args(args, tokenizer)
    arch = checkpoint_architecture(args.sft)
    initialize(ParallelConfig(tp=args.tp, pp=args.pp), num_heads=arch.num_heads,
               num_layers=arch.num_layers)  # fmt: skip
    try:
        dtype = torch.bfloat16 if (args.bf16 and torch.cuda.is_available()) else torch.float32
        policy = load_policy(plan["policy_dir"], dtype)
        dp = policy.pg_collection.dp
        batches = {
            name: rank_batches(records, args.batch_size, sampling.pad_id, dp.rank(), dp.size())
            for name, records in prompt_sets.items()
        }
        policy_out = generate_sets(policy, batches, sampling, "policy")
        del policy
        sft = load_bloom(args.sft, head="lm", params_dtype=dtype, init_weights=False)
        sft_out = generate_sets(sft, batches, sampling, "sft")
        del sft
        judge = None
        if args.judge is not None:
            judge = load_bloom(
                args.judge, head="scalar", num_scalar_outputs=2 if args.judge_kind == "am" else 1,
                params_dtype=dtype, init_weights=False,
            ).eval()  # fmt: skip
        for out in (policy_out, sft_out):
            score_sets(out, judge, args.judge_kind, plan["reward_fn"], args.batch_size)
        del judge
        samples = sample_records(prompt_sets, policy_out, sft_out, tokenizer, args.tie_margin)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, samples)
    finally:
        destroy()
    merged = {(s["set"], s["index"]): s for part in gathered for s in part}
    samples = [merged[key] for key in sorted(merged, key=lambda k: (SET_NAMES.index(k[0]), k[1]))]
    _check_finite(samples)
    results = {name: summarize_samples([s for s in samples if s["set"] == name])
               for name in prompt_sets}  # fmt: skip
    report = {"sets": results, "settings": settings_of(args, plan)}
    if is_rank0():
        write_outputs(Path(args.output_dir), report, samples, args.label or args.policy)
    fields = {}
    for name, row in results.items():
        fields[f"{name}_win_tie_lose"] = f"{row['win']}/{row['tie']}/{row['lose']}"
        fields[f"{name}_net_win"] = round(row["net_win_rate"], 4)
    print_summary("eval-policy", **fields, seconds=round(time.time() - start, 1),
                  output=args.output_dir)  # fmt: skip
    return 0


def sample_records(prompt_sets: dict, policy_out: dict, sft_out: dict, tokenizer, margin) -> list:
    """One JSON-ready record per prompt of this rank: both responses, scores and the verdict."""
    import torch

    records = []
    for name, policy_batches in policy_out.items():
        for policy_exp, sft_exp in zip(policy_batches, sft_out[name]):
            policy_ids, sft_ids = _responses(policy_exp), _responses(sft_exp)
            identical = torch.tensor([a == b for a, b in zip(policy_ids, sft_ids)])
            verdict = verdicts(policy_exp.scores, sft_exp.scores, identical, margin)
            for row, index in enumerate(policy_exp.prompt_index.tolist()):
                record = {"set": name, "index": index, **prompt_sets[name][index][0]}
                for who, ids, exp in (
                    ("policy", policy_ids, policy_exp),
                    ("sft", sft_ids, sft_exp),
                ):
                    if tokenizer is not None:
                        record[f"{who}_response"] = tokenizer.decode(
                            ids[row], skip_special_tokens=True
                        )
                    record[f"{who}_response_token_ids"] = ids[row]
                    record[f"{who}_score"] = float(exp.scores[row])
                record["score_diff"] = record["policy_score"] - record["sft_score"]
                record["verdict"] = VERDICT_NAMES[int(verdict[row])]
                records.append(record)
    return records


def _responses(experience) -> list[list[int]]:
    mask = experience.response_mask.bool()  # (B, N)
    return [experience.responses[row][mask[row]].tolist() for row in range(mask.shape[0])]


def _check_finite(samples: list[dict]) -> None:
    """Raise on every rank alike (all hold the gathered samples)."""
    for sample in samples:
        if not all(math.isfinite(sample[f"{who}_score"]) for who in ("policy", "sft")):
            raise InputError(
                f"--{sample['set']} prompt {sample['index']}: the judge gave a non-finite score "
                f"(policy {sample['policy_score']}, SFT {sample['sft_score']}); check the judge "
                "or the score function"
            )


def summarize_samples(samples: list[dict]) -> dict:
    import torch

    verdict = torch.tensor(
        [{v: k for k, v in VERDICT_NAMES.items()}[s["verdict"]] for s in samples]
    )
    policy = torch.tensor([s["policy_score"] for s in samples], dtype=torch.float64)
    sft = torch.tensor([s["sft_score"] for s in samples], dtype=torch.float64)
    return summarize(verdict, policy, sft)


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
    }


# ---------------------------------------------------------------- outputs


def markdown_report(report: dict, label: str) -> str:
    """Per-set table, then the row in the paper's Table 2 layout (percent)."""
    settings, sets = report["settings"], report["sets"]
    lines = [
        f"# Policy vs SFT: `{label}`",
        "",
        f"- judge: `{settings['judge']}` ({settings['judge_kind']}), tie margin "
        f"{settings['tie_margin']:g}",
        f"- SFT: `{settings['sft']}`; decoding: "
        + ("greedy" if settings["greedy"] else
           f"temperature {settings['temperature']:g}, top-p {settings['top_p']:g}")
        + f", max {settings['max_new_tokens']} new tokens, seed {settings['seed']}",
        "",
        "| set | prompts | Win % ↑ | Lose % ↓ | Tie % | Net win % ↑ | mean score policy "
        "| mean score SFT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, row in sets.items():
        lines.append(
            f"| {name} | {row['num_prompts']} | {100 * row['win_rate']:.2f} | "
            f"{100 * row['lose_rate']:.2f} | {100 * row['tie_rate']:.2f} | "
            f"{100 * row['net_win_rate']:.2f} | {row['mean_score_policy']:.4f} | "
            f"{row['mean_score_sft']:.4f} |"
        )
    header, rule, cells = ["Model"], ["---"], [label]
    for name in sets:
        header += [f"{name.capitalize()} Win ↑", f"{name.capitalize()} Lose ↓",
                   f"{name.capitalize()} Tie"]  # fmt: skip
        rule += ["---:"] * 3
        cells += [f"{100 * sets[name][key]:.2f}" for key in ("win_rate", "lose_rate", "tie_rate")]
    lines += [
        "",
        "Table 2 layout (over the SFT model, percent):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rule) + "|",
        "| " + " | ".join(cells) + " |",
        "",
    ]
    return "\n".join(lines)


OUTPUT_FILES = ("eval_policy_samples.jsonl", "eval_policy.md", "eval_policy.json")


def write_outputs(out: Path, report: dict, samples: list[dict], label: str) -> None:
    from megatron_rlhf.utils import write_jsonl

    write_jsonl(out / OUTPUT_FILES[0], samples)
    with atomic_output(out / OUTPUT_FILES[1]) as tmp:
        tmp.write_text(markdown_report(report, label), encoding="utf-8")
    write_json(out / OUTPUT_FILES[2], report)
