"""``eval-policy``'s checks of its inputs, before any model memory: the prompts, the policy and
judge checkpoints (heads, kinds), the numbers, the output; ppo/evaluate.py runs the plan."""

from __future__ import annotations

from pathlib import Path

from megatron_rlhf.distributed.layouts import parallel_from_args
from megatron_rlhf.generation.prompts import check_generation_arguments
from megatron_rlhf.ppo.evaluate_report import OUTPUT_FILES, SET_NAMES
from megatron_rlhf.utils import InputError, check_output_path

ROLES = ("policy", "judge")
"""The layouts of eval-policy: the policy and SFT model generate in ``policy``'s, the judge scores
in ``judge``'s."""


def validate_inputs(args) -> dict:
    """Every check that needs no model memory; returns the plan (paths, prompts, tokenizer,
    the roles' layouts)."""
    from megatron_rlhf.checkpoint import checkpoint_architecture
    from megatron_rlhf.distributed.layouts import validate_layouts
    from megatron_rlhf.distributed.parallel import world_size_from_env
    from megatron_rlhf.generation.prompts import read_prompts, resolve_tokenizer
    from megatron_rlhf.ppo.setup import import_reward_fn
    from megatron_rlhf.runtime import locks

    if (args.judge is None) == (args.score_fn is None):
        raise InputError("give exactly one judge: --judge CHECKPOINT or --score-fn pkg.mod:fn")
    shapes = parallel_from_args(args, ROLES)
    _check_numbers(args)
    for name in OUTPUT_FILES:
        check_output_path(Path(args.output_dir) / name, args.overwrite, "--output-dir")
    locks.lock_output(args.output_dir, "--output-dir")
    policy_dir = resolve_policy_dir(args.policy)
    model_dirs = {"--policy": policy_dir, "--sft": args.sft}
    if args.judge is not None:
        model_dirs["--judge"] = args.judge
    vocab_sizes, layouts = {}, {}
    for flag, directory in model_dirs.items():
        if not Path(directory).is_dir():
            raise InputError(f"{flag} {directory}: no such checkpoint directory")
        arch = checkpoint_architecture(directory)
        role = "judge" if flag == "--judge" else "policy"
        tp, pp = shapes[role]
        try:
            layouts |= validate_layouts({role: (tp, pp)}, world_size_from_env(), {role: arch})
        except InputError as err:
            raise InputError(
                f"{flag} {directory} in the {role} layout (--parallel {role}.tp={tp} "
                f"{role}.pp={pp}): {err}"
            ) from None
        vocab_sizes[flag] = arch.vocab_size
        if flag != "--judge":
            max_prompt_length = check_generation_arguments(args, arch.max_sequence_length, pp)
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
    if args.judge is None:  # a score function runs on every rank: no judge model to place
        layouts["judge"] = layouts["policy"]
    return {
        "policy_dir": policy_dir,
        "reward_fn": reward_fn,
        "tokenizer": tokenizer,
        "prompt_sets": prompt_sets,
        "layouts": layouts,
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
