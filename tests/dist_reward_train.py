"""Worker for test_reward_train.py: ``train-reward`` on 4 gloo ranks (launched by torchrun).

One launch runs every check (a launch costs 10-15 s of imports):
- for the AM and the RM, two optimizer steps at TP1 (DP4), TP2 (DP2), PP2 (DP2) and TP2xPP2
  (DP1), packed, and at TP1 padded, on the same 8-pair global batches: the per-step losses,
  gradient norms and updated weights must agree across layouts and with the padded run, and the first step's loss must equal an independent float64
  computation with Hugging Face ``BloomModel`` (one unpadded sequence at a time) plus the
  score head read from the HF files;
- training killed during step 3 (PP2 × DP2, with evaluation) and resumed from its step-2
  checkpoint gives bit-identical step-3 and step-4 losses and evaluation to an uninterrupted run;
- ``score`` of the same pairs at TP2xPP2 and TP1 agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrun_harness import Harness, run_killed_during_step

RUNS = ((1, 1, True), (1, 1, False), (2, 1, True), (1, 2, True), (2, 2, True))
"""(tp, pp, train.packing): packed (the default) at every layout, and padded at TP1."""
RM_SHIFT_INVARIANT = ("final_layernorm.bias", "scalar_head.bias")
"""Eq. 1 depends on r_chosen - r_rejected only, so these (each shifts every reward) have an
exactly zero gradient: a padded row order happens to sum it to 0.0, a packed one to ~1e-10,
and Adam (g / (|g| + eps)) turns that rounding into an lr-sized step. Not compared for the RM."""
GLOBAL_BATCH = 8
SEED = 11
TOLERANCE = 1e-5
harness = Harness(__doc__)
harness.parser.add_argument("--data", required=True)
harness.parser.add_argument("--hf-am", dest="hf_am", required=True)
harness.parser.add_argument("--hf-rm", dest="hf_rm", required=True)
harness.parser.add_argument("--work", type=Path, required=True)


def config_for(args, loss: str, tp: int, pp: int, output_dir: Path, **train):
    from megatron_rlhf.reward.train import (
        AMConfig,
        LayoutConfig,
        ModelConfig,
        RewardDataConfig,
        RewardTrainConfig,
        TrainConfig,
    )
    from megatron_rlhf.training import OptimConfig

    settings = dict(
        output_dir=str(output_dir),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=1,
        steps=2,
        eval_interval=0,
        save_interval=0,
        log_interval=1,
        seed=SEED,
    )
    settings.update(train)
    eval_fraction = settings.pop("eval_fraction", 0.0)
    return RewardTrainConfig(
        loss=loss,
        model=ModelConfig(load=getattr(args, f"hf_{loss}")),
        parallel=LayoutConfig(tp=tp, pp=pp),
        data=RewardDataConfig(train=args.data, eval_fraction=eval_fraction),
        am=AMConfig(margin=1.5),
        optim=OptimConfig(lr=3e-3, warmup_fraction=0.0, weight_decay=0.01),
        train=TrainConfig(**settings),
    )


def reference_first_loss(args, loss: str) -> float:
    """Eq. 1 / Eq. 6 in float64 on the first global batch, with transformers' BLOOM trunk."""
    from safetensors.torch import load_file
    from transformers import BloomModel

    from megatron_rlhf.data import PreferenceDataset, ShardedSampler

    hf_dir = getattr(args, f"hf_{loss}")
    trunk = BloomModel.from_pretrained(hf_dir).double().eval()
    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))
    weight, bias = tensors["score.weight"].double(), tensors["score.bias"].double()
    dataset = PreferenceDataset(args.data)
    sampler = ShardedSampler(len(dataset), 0, 1, SEED, micro_batch_size=1)
    losses = []
    with torch.no_grad():
        for position in range(GLOBAL_BATCH):
            item = dataset[sampler.global_index(position)]
            prompt_length = len(item["prompt_ids"])
            outputs = []
            for side in ("chosen_ids", "rejected_ids"):
                ids = torch.cat([item["prompt_ids"], item[side]])[None]
                hidden = trunk(ids).last_hidden_state[0]  # (S, H), after ln_f
                scalars = hidden @ weight.T + bias  # (S, n)
                reward = scalars[-1, 0]
                outputs.append(reward if loss == "rm" else reward - scalars[prompt_length - 1, 1])
            chosen, rejected = outputs
            if loss == "rm":
                losses.append(-F.logsigmoid(chosen - rejected))
            else:
                margin = 1.5
                losses.append(
                    -F.logsigmoid(chosen - rejected)
                    - F.logsigmoid(margin - chosen)
                    - F.logsigmoid(margin + rejected)
                )
    return float(torch.stack(losses).mean())


def full_weights(directory: str, num_outputs: int) -> dict:
    """Every tensor of a checkpoint, loaded at TP1/PP1 on this rank."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import initialize

    initialize()
    model = load_bloom(directory, head="scalar", num_scalar_outputs=num_outputs)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@harness.check
def layout_parity(args) -> None:
    from megatron_rlhf.reward.train import train

    for loss, num_outputs in (("am", 2), ("rm", 1)):
        runs = {}
        for tp, pp, packing in RUNS:
            name = f"tp{tp}_pp{pp}" + ("" if packing else "_padded")
            config = config_for(args, loss, tp, pp, args.work / f"{loss}_{name}", packing=packing)
            runs[name] = train(config)
        base = runs["tp1_pp1"]
        base_losses = [m["loss"] for m in base["history"]]
        if dist.get_rank() == 0:
            reference = reference_first_loss(args, loss)
            harness.record(
                f"{loss}_first_step_loss_matches_hf_float64",
                abs(base_losses[0] - reference) < TOLERANCE,
                f"megatron {base_losses[0]:.8f} vs float64 reference {reference:.8f}",
            )
        base_weights = full_weights(base["checkpoint"], num_outputs)
        moved = max(
            (base_weights[name] - start).abs().max().item()
            for name, start in initial_weights(args, loss, num_outputs).items()
        )
        for name, result in runs.items():
            if name == "tp1_pp1":
                continue
            losses = [m["loss"] for m in result["history"]]
            norms = [m["grad_norm"] for m in result["history"]]
            base_norms = [m["grad_norm"] for m in base["history"]]
            pairs = zip(losses + norms, base_losses + base_norms)
            gap = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)  # relative above 1
            harness.record(
                f"{loss}_{name}_losses_match_tp1",
                len(losses) == 2 and gap < TOLERANCE,
                f"relative gap {gap:.1e}: losses {losses} grad norms {norms} vs TP1 "
                f"{base_losses} {base_norms}",
            )
            weights = full_weights(result["checkpoint"], num_outputs)
            compared = [k for k in weights if loss != "rm" or k not in RM_SHIFT_INVARIANT]
            weight_gap = max((weights[k] - base_weights[k]).abs().max().item() for k in compared)
            harness.record(
                f"{loss}_{name}_updated_weights_match_tp1",
                weights.keys() == base_weights.keys() and weight_gap < TOLERANCE and moved > 1e-3,
                f"max |w - w_tp1| = {weight_gap:.2e} (weights moved {moved:.2e} in training)",
            )


def initial_weights(args, loss: str, num_outputs: int) -> dict:
    """The model before training, from the HF directory (parallel state already TP1/PP1)."""
    from megatron_rlhf.checkpoint import load_bloom

    model = load_bloom(getattr(args, f"hf_{loss}"), head="scalar", num_scalar_outputs=num_outputs)
    return {name: param.detach() for name, param in model.named_parameters()}


@harness.check
def resume(args) -> None:
    from megatron_rlhf.reward import train as train_module
    from megatron_rlhf.training import TrainEngine

    settings = dict(steps=4, save_interval=2, eval_interval=2, eval_fraction=0.25)
    whole = train_module.train(config_for(args, "am", 1, 2, args.work / "whole", **settings))
    killed_dir = args.work / "killed"
    begun = run_killed_during_step(
        TrainEngine,
        3,
        lambda: train_module.train(config_for(args, "am", 1, 2, killed_dir, **settings)),
    )
    resumed = train_module.train(config_for(args, "am", 1, 2, killed_dir, **settings))
    whole_losses = [m["loss"] for m in whole["history"]]
    resumed_losses = [m["loss"] for m in resumed["history"]]
    harness.record(
        "killed_and_resumed_next_losses_equal_uninterrupted_bitwise",
        begun == 3 and resumed_losses == whole_losses[2:],
        f"uninterrupted {whole_losses}, resumed {resumed_losses}",
    )
    harness.record(
        "killed_and_resumed_final_evaluation_equal",
        resumed["eval"]["loss"] == whole["eval"]["loss"]
        and resumed["eval"]["accuracy"] == whole["eval"]["accuracy"]
        and resumed["eval"]["pairs"] == 16,
        f"uninterrupted {whole['eval']['loss']!r} vs resumed {resumed['eval']['loss']!r}",
    )


@harness.check
def score_layouts(args) -> None:
    """``score`` of the same pairs at TP2xPP2 (DP1) and TP1 (DP4) agree."""
    from megatron_rlhf.reward import score

    checkpoint = str(args.work / "am_tp1_pp1" / "step_0000002")
    lines = {}
    for tp, pp in ((2, 2), (1, 1)):
        out = args.work / f"scores_tp{tp}_pp{pp}.jsonl"
        argv = ["--load", checkpoint, "--input", args.data, "--output", str(out)]
        score.run(score.build_parser().parse_args([*argv, "--tp", str(tp), "--pp", str(pp)]))
        dist.barrier()
        lines[tp, pp] = [json.loads(line) for line in out.read_text().splitlines()]
    sharded, single = lines[2, 2], lines[1, 1]
    gap = max(
        abs(a[key] - b[key])
        for a, b in zip(sharded, single)
        for key in ("chosen_score", "rejected_score")
    )
    harness.record(
        "score_tp2_pp2_equals_tp1",
        len(sharded) == len(single) == 66 and gap < TOLERANCE,
        f"{len(sharded)} pairs, max gap {gap:.2e}",
    )


if __name__ == "__main__":
    harness.main()
