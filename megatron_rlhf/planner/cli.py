"""``tools/plan_parallelism.py``: which layouts fit a PPO run, and how fast each would step.

    python tools/plan_parallelism.py --actor bloomz-176b --critic bloomz-7b1 --reward bloomz-7b1 \\
        --gpus 80 --gpu-memory-gb 80 --rollout-sequences 256 --max-length 2048 [--json]

Models are BLOOM presets (bloom-560m, -1b1, -1b7, -3b, -7b1, -176b; ``bloomz-*`` alike) or an HF
``config.json`` (or its directory). ``--json`` prints ``{"request": ..., "roles": {role:
{"params": ..., ...}}, "plans": [...]}``, plans ranked (fitting ones first, by estimated step
time), each with its per-role layouts and per-GPU memory breakdown (GB). ``--write-config``
writes the best plan as a ``train-ppo`` config (``parallel:`` per role, rollout batch and
lengths) on top of ``--base-config`` (default: placeholders for the model and data paths).
``--placement disaggregated`` also splits the G GPUs into R rollout GPUs and G - R training
GPUs and prints every fitting split's predicted asynchronous step (``--max-staleness``, default
1: max(rollout, score + update) + weight sync) against the best colocated synchronous plan;
``--rollout-gpus R`` plans one split only.
How memory and time are estimated: ``megatron_rlhf/planning/{memory,plan,placement}.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rlhf.utils import InputError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/plan_parallelism.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--actor", required=True, help="policy model: preset or config.json")
    parser.add_argument("--critic", required=True, help="value model: preset or config.json")
    parser.add_argument("--reward", required=True, help="reward/advantage model")
    parser.add_argument("--reference", help="reference policy (default: the actor's model)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory per GPU, GB")
    parser.add_argument("--rollout-sequences", type=int, default=256, help="sequences per step")
    parser.add_argument("--max-length", type=int, default=2048, help="prompt + response tokens")
    parser.add_argument("--prompt-length", type=int, help="prompt tokens (default: half)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        help="plan packed scoring/update micro-batches of this many tokens (train.packing)",
    )
    parser.add_argument(
        "--gpu", default="H100", help="hardware for the time estimate (H200, H100, A100, ...)"
    )
    parser.add_argument("--reserve-gb", type=float, default=2.0, help="held back per GPU")
    parser.add_argument(
        "--attention-backend", default="torch", choices=["torch", "te", "triton"],
        help="the roles' attention (train.attention_backend): triton keeps O(s) memory; "
        "torch and te store (s x s) scores (default torch until the GPU check has measured triton)",
    )  # fmt: skip
    parser.add_argument(
        "--placement", default="colocated", choices=["colocated", "disaggregated"],
        help="disaggregated: also split the GPUs into R rollout and G - R training GPUs and "
        "print every split's predicted asynchronous step against the best colocated one",
    )  # fmt: skip
    parser.add_argument(
        "--max-staleness", type=int,
        help="async.max_staleness of the disaggregated step (default 1: generation overlaps "
        "score + update; 0: they follow each other)",
    )  # fmt: skip
    parser.add_argument(
        "--rollout-gpus", type=int, help="only this split R (default: every R in [1, G))"
    )
    parser.add_argument("--top", type=int, default=10, help="plans to print")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--write-config", help="write the best plan as a train-ppo YAML here")
    parser.add_argument("--base-config", help="train-ppo YAML the plan is written on top of")
    parser.add_argument("--overwrite", action="store_true", help="replace --write-config's file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        request = request_from_args(args)
        from megatron_rlhf.planning.plan import make_plans, roles_summary, weight_sync

        ranking = make_plans(request, top=args.top)
        plans = ranking.plans
        split = None
        if args.placement == "disaggregated":
            from megatron_rlhf.planning.placement import plan_disaggregated

            staleness = 1 if args.max_staleness is None else args.max_staleness
            split = plan_disaggregated(request, staleness, args.rollout_gpus, plans[0])
        if args.write_config:
            write_config(plans[0], request, args, split)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shown = plans
    if args.json:
        print(
            json.dumps(
                {
                    "request": request_dict(request),
                    "roles": roles_summary(request),
                    "plans": [p.to_dict(request) for p in shown],
                }
                | ({} if split is None else {"disaggregated": split.to_dict()}),
                indent=1,
            )
        )
    else:
        print(table(request, roles_summary(request), shown))
        print(sync_line(weight_sync(request, plans[0].layouts)))
        if split is not None:
            print(split_table(request, split))
    print(
        f"[plan_parallelism] done: candidates={ranking.candidates} fitting={ranking.fitting} "
        f"best_step_s={plans[0].step_seconds:.1f} best_gb_per_gpu={plans[0].total_bytes / 1e9:.1f}",
        file=sys.stderr,
    )
    return 0


def sync_line(sync: dict) -> str:
    """The best plan's actor-to-rollout weight sync, one line."""
    names = {"megatron_refit": "our engine's refit", "vllm_full_stream": "vLLM full stream (fallback)",
             "shard_to_shard": "vLLM shard-to-shard"}  # fmt: skip
    parts = [f"{names[way]} {sync[way]['gb_per_rank']:.1f} GB/rank {sync[way]['seconds']:.2f} s"
             for way in names]  # fmt: skip
    return f"weight sync per step (best plan, {sync['bandwidth_gb_per_s']:.0f} GB/s): " + "; ".join(
        parts
    )


def request_from_args(args):
    from megatron_rlhf.planning import hardware
    from megatron_rlhf.planning.plan import PlanRequest
    from megatron_rlhf.planning.shapes import model_shape

    for name in ("gpus", "rollout_sequences", "max_length", "micro_batch", "top"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.placement != "disaggregated":
        for name in ("max_staleness", "rollout_gpus"):
            if getattr(args, name) is not None:
                raise InputError(
                    f"--{name.replace('_', '-')} plans a disaggregated split: add "
                    "--placement disaggregated"
                )
    else:
        from megatron_rlhf.planning.placement import check_split

        check_split(args.gpus, args.max_staleness or 0, args.rollout_gpus)
    budget = args.max_tokens_per_micro_batch
    if budget is not None and budget < args.max_length:
        raise InputError(
            f"--max-tokens-per-micro-batch must be >= --max-length ({args.max_length}), "
            f"got {budget}: a pack holds at least one whole sequence"
        )
    if not args.gpu_memory_gb > 0:
        raise InputError(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
    if args.prompt_length is not None and not 0 < args.prompt_length < args.max_length:
        raise InputError(f"--prompt-length must be in [1, --max-length), got {args.prompt_length}")
    gpu = hardware.gpu_by_name(args.gpu)
    if gpu is None:
        raise InputError(
            f"--gpu {args.gpu!r}: unknown; known: {', '.join(g.name for g in hardware.GPUS)}"
        )
    models = {
        "actor": model_shape(args.actor),
        "reference": model_shape(args.reference or args.actor),
        "critic": model_shape(args.critic),
        "reward": model_shape(args.reward),
    }
    return PlanRequest(
        models=models,
        gpus=args.gpus,
        gpu_memory_gb=args.gpu_memory_gb,
        rollout_sequences=args.rollout_sequences,
        max_length=args.max_length,
        prompt_length=args.prompt_length,
        micro_batch=args.micro_batch,
        max_tokens_per_micro_batch=budget,
        reserve_gb=args.reserve_gb,
        gpu=gpu,
        attention_backend=args.attention_backend,
    )


def request_dict(request) -> dict:
    return {
        "gpus": request.gpus,
        "gpu_memory_gb": request.gpu_memory_gb,
        "gpu": request.gpu.name,
        "rollout_sequences": request.rollout_sequences,
        "max_length": request.max_length,
        "prompt_length": request.prompt,
        "micro_batch": request.micro_batch,
        "max_tokens_per_micro_batch": request.max_tokens_per_micro_batch,
        "reserve_gb": request.reserve_gb,
    }


def _layout(layout) -> str:
    return f"{layout.tp}x{layout.pp}x{layout.dp}"


def table(request, roles: dict, plans: list) -> str:
    lines = [
        f"{request.gpus} x {request.gpu_memory_gb:g} GB ({request.gpu.name} timing), "
        f"{request.rollout_sequences} sequences x {request.max_length} tokens "
        f"(prompt {request.prompt}), micro-batch {request.micro_batch}",
        "roles: "
        + ", ".join(
            f"{role} {info['model']} ({info['params']:,} params)" for role, info in roles.items()
        ),
        "layouts are TPxPPxDP; memory in GB per GPU (the fullest stage of each role, plus the step's largest transient)",
        "",
        f"{'#':>2} {'fits':<4} {'actor':<9} {'ref':<9} {'critic':<9} {'reward':<9} {'rollout':<9} {'recomp':<6} "
        f"{'actor':>6} {'ref':>5} {'critic':>6} {'reward':>6} {'roll':>5} {'trans':>5} {'total':>6} {'step s':>7}",
    ]
    for rank, plan in enumerate(plans, 1):
        mem = {role: m.total / 1e9 for role, m in plan.memory.items()}
        lines.append(
            f"{rank:>2} {'yes' if plan.fits else 'NO':<4} "
            + " ".join(
                f"{_layout(plan.layouts[r]):<9}"
                for r in ("actor", "reference", "critic", "reward", "rollout")
            )
            + f" {'yes' if plan.recompute else 'no':<6} {mem['actor']:>6.1f} {mem['reference']:>5.1f} "
            f"{mem['critic']:>6.1f} {mem['reward']:>6.1f} {mem['rollout']:>5.1f} {mem['transient']:>5.1f} "
            f"{plan.total_bytes / 1e9:>6.1f} {plan.step_seconds:>7.1f}"
        )
    if plans and not plans[0].fits:
        lines.append(
            f"no layout fits: the smallest needs {plans[0].total_bytes / 1e9:.1f} GB + {request.reserve_gb:g} GB reserve per GPU"
        )
    return "\n".join(lines)


def write_config(plan, request, args, split=None) -> None:
    """The plan as a train-ppo YAML, validated by loading it as ``train-ppo`` would; with
    ``split`` (``--placement disaggregated``) the best split's placement, layouts and
    staleness instead of the colocated plan's layouts."""
    import yaml

    from megatron_rlhf.config import load_config, move_keys, moved_keys
    from megatron_rlhf.distributed.layouts import layouts_to_dict
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.utils import atomic_output, check_output_path

    out = check_output_path(args.write_config, args.overwrite, "--write-config")
    if args.base_config:
        load_config(TrainPPOConfig, args.base_config)  # names a bad key before we build on it
        config = yaml.safe_load(Path(args.base_config).read_text())
        move_keys(config, moved_keys(TrainPPOConfig), args.base_config, warn=False)
    else:
        config = {
            "models": {
                role: f"/path/to/{getattr(args, role) or args.actor}"
                for role in ("actor", "critic", "reward")
            },
            "data": {"prompts": "/path/to/prompts"},
        }
    config["parallel"] = layouts_to_dict(plan.layouts) | {"sequence_parallel": True}
    if split is not None:
        best = split.best
        if best is None:
            raise InputError("--write-config: no split of the GPUs fits; nothing to write")
        layouts = best.layouts | {"rollout": best.rollout_layout}
        config["parallel"] = layouts_to_dict(layouts) | {"sequence_parallel": True}
        config["placement"] = {"mode": "disaggregated", "rollout_ranks": best.rollout_gpus}
        config["async"] = {"max_staleness": best.max_staleness}
        config.setdefault("train", {})["recompute_activations"] = best.recompute
    config.setdefault("rollout", {}).update(
        prompts_per_step=request.rollout_sequences, max_new_tokens=request.response
    )
    config.setdefault("data", {})["max_prompt_length"] = request.prompt
    train = config.setdefault("train", {})
    train["micro_batch_size"] = request.micro_batch
    if request.max_tokens_per_micro_batch is not None:
        train["max_tokens_per_micro_batch"] = request.max_tokens_per_micro_batch
    train["bf16"] = True
    train.setdefault("recompute_activations", plan.recompute)
    with atomic_output(out) as tmp:
        header = f"# written by tools/plan_parallelism.py: {request.gpus} x {request.gpu_memory_gb:g} GB, est. {plan.total_bytes / 1e9:.1f} GB/GPU, {plan.step_seconds:.1f} s/step{'' if plan.fits else ' (DOES NOT FIT)'}\n"
        if split is not None:
            header = f"# written by tools/plan_parallelism.py --placement disaggregated: {split.best.rollout_gpus} rollout + {split.best.training_gpus} training GPUs of {request.gpu_memory_gb:g} GB, est. {split.best.step_seconds:.1f} s/step at async.max_staleness={split.best.max_staleness}\n"
        tmp.write_text(header + yaml.safe_dump(config, sort_keys=False))
        load_config(TrainPPOConfig, tmp)
    print(f"wrote {out}", file=sys.stderr)


def split_table(request, estimate) -> str:
    """Every fitting split of the GPUs into rollout and training sets, the best marked, its
    predicted step against the best colocated synchronous plan, and the assumptions."""
    from megatron_rlhf.planning.placement import ASSUMPTIONS

    n, best = estimate.max_staleness, estimate.best
    step = (
        "max(rollout, score+update) + weight sync"
        if n >= 1
        else "rollout + score+update + weight sync (no overlap)"
    )
    lines = [
        "",
        f"disaggregated placement, async.max_staleness={n}: step = {step}; layouts TPxPPxDP, "
        "memory GB per GPU of each set",
        f"{'':1} {'R':>4} {'G-R':>4} {'rollout':<9} {'actor':<9} {'ref':<9} {'critic':<9} "
        f"{'reward':<9} {'recomp':<6} {'roll GB':>7} {'train GB':>8} {'rollout s':>9} "
        f"{'score+upd s':>11} {'sync s':>6} {'step s':>7}",
    ]
    for split in estimate.splits:
        roles = " ".join(
            f"{_layout(split.layouts[r]):<9}" for r in ("actor", "reference", "critic", "reward")
        )
        lines.append(
            f"{'*' if split is best else '':1} {split.rollout_gpus:>4} {split.training_gpus:>4} "
            f"{_layout(split.rollout_layout):<9} {roles} {'yes' if split.recompute else 'no':<6} "
            f"{split.rollout_bytes / 1e9:>7.1f} {split.training_bytes / 1e9:>8.1f} "
            f"{split.rollout_seconds:>9.1f} {split.training_seconds:>11.1f} "
            f"{split.sync_seconds:>6.2f} {split.step_seconds:>7.1f}"
        )
    if best is None:
        lines.append("no split fits: the rollout or the training set has no layout that fits")
    colocated = estimate.colocated
    if best is not None and colocated is not None:
        lines.append(
            f"best split: {best.rollout_gpus} rollout + {best.training_gpus} training GPUs, "
            f"{best.step_seconds:.1f} s/step vs {colocated.step_seconds:.1f} s colocated "
            f"synchronous (the best plan above): speed-up {estimate.speedup:.2f}x"
        )
    elif colocated is None:
        lines.append("no colocated plan fits: no speed-up to state")
    lines.append("assumptions: " + "; ".join(ASSUMPTIONS))
    return "\n".join(lines)
