"""torchrun worker (2 ranks): LM training at TP=1, TP=2 and PP=2 gives the same numbers.

- One optimizer step (SFT NLL through the fused log-prob kernel) gives the same loss and the
  same updated weights (within 0.5 % of the step Adam takes).
- The ``train-sft`` command (``megatron_rlhf.training.sft.run``) at TP1×DP2, TP2 and PP2 gives
  the same per-step losses and held-out NLL, and its first loss equals a float64 transformers
  computation of the global batch's response-token mean NLL (sequences truncated to
  ``data.max_length``).
- PPO's adaptive KL controller at DP=2 moves exactly as at DP=1."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torchrun_harness import Harness

harness = Harness(__doc__)
harness.parser.add_argument("--hf", required=True)
harness.parser.add_argument(
    "--sft-data", required=True, help="train and eval prefixes: DIR/{train,eval}"
)
harness.parser.add_argument("--work", required=True)


def gathered_full_weights(model, arch) -> dict[str, torch.Tensor]:
    """Every parameter as its full HF-named tensor, gathered over TP/PP (for comparison)."""
    from megatron.core import parallel_state

    from megatron_rlhf.checkpoint.hf_io import stage_layer_offset
    from megatron_rlhf.checkpoint.hf_names import mapping_for

    tp = parallel_state.get_tensor_model_parallel_world_size()
    local = {}
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            continue
        mapping = mapping_for(name, "lm", stage_layer_offset(model))
        tensor = param.detach()
        if mapping.split_dim is not None and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
            tensor = torch.cat(parts, dim=mapping.split_dim)
        local[mapping.hf_name] = tensor[: arch.vocab_size] if mapping.is_vocab else tensor
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    return {k: v for part in everything for k, v in part.items()}


@harness.check
def engine_step(args) -> None:
    """One optimizer step at TP=2 and at PP=2 equals TP=1 (loss and updated weights)."""
    from megatron.core import parallel_state

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.distributed.parallel import vocab_group
    from megatron_rlhf.training import OptimConfig, TrainEngine
    from megatron_rlhf.training.sft import sft_loss

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 250, (4, 11), generator=generator)
    padding = torch.ones(4, 11, dtype=torch.long)
    padding[1, 8:] = 0
    loss_mask = padding.clone()
    loss_mask[:, :4] = 0
    microbatches = [
        {"input_ids": input_ids[i : i + 2], "padding_mask": padding[i : i + 2],
         "loss_mask": loss_mask[i : i + 2]}
        for i in (0, 2)
    ]  # fmt: skip
    for microbatch in microbatches:  # every rank holds both: the loss is their token mean
        microbatch["nll_scale"] = torch.tensor(2.0 / float(loss_mask[:, 1:].sum()))
    reference = None
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize(tp, pp)
        model = load_bloom(args.hf)
        # Adam's eps above the gradients' rounding noise: a gradient whose true value is 0 (the
        # key bias: softmax ignores a shift) is otherwise a full +-lr step in the noise's sign,
        # and each layout (and TP=1's oneDNN products, models/cpu_linear.py) sums in its order
        optim = OptimConfig(lr=1e-2, warmup_fraction=0.0, adam_eps=1e-6)
        engine = TrainEngine(model, optim, total_steps=4)
        loss_fn = partial(sft_loss, tp_group=vocab_group(model.pg_collection))
        metrics = engine.step(microbatches, loss_fn)
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, (metrics.get("loss"), metrics.get("grad_norm")))
        loss, norm = next(value for value in losses if value[0] is not None)
        weights = gathered_full_weights(model, model.arch)
        if reference is None:
            reference = (loss, weights, norm)
            continue
        worst = max((weights[k] - reference[1][k]).abs().max().item() for k in reference[1])
        moved = max(
            (reference[1][k] - w).abs().max().item()
            for k, w in gathered_full_weights(load_bloom(args.hf), model.arch).items()
        )
        # Adam's first step is ~lr * sign(grad): fp32 reduction-order noise in tiny gradients
        # moves a weight by a small fraction of the step, so the bound is relative to the step.
        # the gradient norm: Adam's first step is blind to a gradient's scale
        same_norm = abs(norm - reference[2]) < 1e-5 * reference[2]
        ok = abs(loss - reference[0]) < 1e-6 and same_norm and worst < 5e-3 * moved
        ok = ok and moved > 1e-3
        harness.record(
            f"tp{tp}_pp{pp}_step_equals_tp1",
            ok,
            f"loss {loss:.8f} vs {reference[0]:.8f}; grad norm {norm:.6g} vs {reference[2]:.6g}; "
            f"weights max diff {worst:.2e} (step moved them {moved:.2e})",
        )


SFT_STEPS, SFT_BATCH, SFT_MAX_LENGTH, SFT_SEED = 3, 8, 12, 5


@harness.check
def sft_command(args) -> None:
    """``train-sft`` (packed, the default) at TP2 and PP2 equals TP1 x DP2 and TP1 x DP2 padded
    (losses and gradient norms, rel 1e-5); its first loss equals transformers'."""
    from megatron_rlhf.distributed.layouts import LayoutConfig
    from megatron_rlhf.training.config import ModelConfig, OptimConfig
    from megatron_rlhf.training.sft import SFTConfig, SFTDataConfig, TrainConfig, run

    runs = {}
    for tp, pp, packing in ((1, 1, True), (1, 1, False), (2, 1, True), (1, 2, True)):
        config = SFTConfig(
            model=ModelConfig(load=args.hf),
            parallel=LayoutConfig(tp=tp, pp=pp),
            data=SFTDataConfig(
                train=f"{args.sft_data}/train",
                eval=f"{args.sft_data}/eval",
                max_length=SFT_MAX_LENGTH,
            ),
            optim=OptimConfig(lr=1e-2, warmup_fraction=0.0),
            train=TrainConfig(
                output_dir=f"{args.work}/sft_tp{tp}_pp{pp}_packing{packing}",
                global_batch_size=SFT_BATCH,
                micro_batch_size=2,
                steps=SFT_STEPS,
                eval_interval=0,
                save_interval=0,
                seed=SFT_SEED,
                packing=packing,
            ),
        )
        result = run(config)
        runs[(tp, pp, packing)] = (
            [m["loss"] for m in result["history"]] + [m["grad_norm"] for m in result["history"]],
            result["eval"]["loss"],
        )
    reference, reference_eval = runs[(1, 1, True)]
    reference_losses = reference[:SFT_STEPS]
    for tp, pp, packing in ((1, 1, False), (2, 1, True), (1, 2, True)):
        values, eval_loss = runs[(tp, pp, packing)]
        worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(values, reference))
        name = "padded_equal_packed" if not packing else f"tp{tp}_pp{pp}_losses_equal_tp1_dp2"
        harness.record(
            f"sft_{name}",
            len(values) == 2 * SFT_STEPS
            and worst < 1e-5
            and abs(eval_loss - reference_eval) < 1e-5,
            f"losses, grad norms {values} vs {reference}; eval {eval_loss} vs {reference_eval}",
        )
    expected = float64_first_batch_nll(args)
    harness.record(
        "sft_first_loss_equals_hf_float64",
        abs(reference_losses[0] - expected) < 1e-5 and reference_losses[-1] < reference_losses[0],
        f"train-sft {reference_losses[0]:.8f} vs transformers float64 {expected:.8f}",
    )


def float64_first_batch_nll(args) -> float:
    """Σ response-token NLL / response tokens over the first global batch, one unpadded
    truncated sequence at a time through transformers' BloomForCausalLM in float64."""
    import torch.nn.functional as F
    from transformers import BloomForCausalLM

    from megatron_rlhf.data import SFTDataset, ShardedSampler

    model = BloomForCausalLM.from_pretrained(args.hf).double().eval()
    dataset = SFTDataset(f"{args.sft_data}/train")
    sampler = iter(ShardedSampler(len(dataset), 0, 1, SFT_SEED, micro_batch_size=2))
    nll, tokens = 0.0, 0.0
    for _ in range(SFT_BATCH):
        sample = dataset[next(sampler)]
        ids = sample["input_ids"][:SFT_MAX_LENGTH]
        mask = sample["loss_mask"][:SFT_MAX_LENGTH][1:].double()
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
        picked = logprobs.gather(1, ids[1:, None])[:, 0]
        nll -= float((picked * mask).sum())
        tokens += float(mask.sum())
    return nll / tokens


@harness.check
def kl_controller(args) -> None:
    """The adaptive KL controller at DP=2 moves exactly as at DP=1: ``train-ppo`` gives every
    rank the step's global batch, and the observation is its mean KL over the global rollout
    count (neither one rank's share of the rollouts nor a sum of the replicas' copies)."""
    from types import SimpleNamespace

    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.ppo.control import KLController
    from megatron_rlhf.ppo.metrics import observed_kl

    initialize()  # TP1 PP1 on 2 ranks: DP = 2
    generator = torch.Generator().manual_seed(21)
    kl = [torch.rand(6, 5, generator=generator) * 3 for _ in range(2)]  # (B, N) per rank
    settings = dict(init_coef=0.1, adaptive=True, target=1.0, horizon=40)
    distributed, serial = KLController(**settings), KLController(**settings)
    local_count = KLController(**settings)
    for _ in range(3):
        distributed.update(*observed_kl(SimpleNamespace(kl=torch.cat(kl))))  # the global batch
        per_sequence = torch.cat(kl).double().sum(dim=1)
        serial.update(float(per_sequence.mean()), len(per_sequence))
        local_count.update(float(per_sequence.mean()), 6)  # the old rule: one rank's batch
    harness.record(
        "kl_controller_dp2_equals_dp1",
        abs(distributed.coef - serial.coef) < 1e-12 and abs(local_count.coef - serial.coef) > 1e-4,
        f"DP=2 coef {distributed.coef!r}, DP=1 {serial.coef!r}, counting one "
        f"rank's rollouts {local_count.coef!r}",
    )


if __name__ == "__main__":
    harness.main()
