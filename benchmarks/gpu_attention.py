"""BLOOM's ALiBi attention on one CUDA GPU: the fused Triton kernel vs the PyTorch path vs TE.

    python benchmarks/gpu_attention.py [--json attention.json]      (H200: planned <= 60 s)

For the heads one tensor-parallel rank holds in BLOOM-7b1 (32 heads of 128: TP1 32, TP4 8) and
BLOOM-176B (112 heads of 128: TP8 14), at S = 512, 2,048 and 4,096 tokens (B x S = 8,192 tokens,
rows right-padded by up to an eighth, the layout every backend takes), in bf16:

- time (ms, median of ``REPEATS`` calls interleaved across the methods, after a warm-up call,
  CUDA-synchronised; every Triton specialisation is compiled before the budget's clock starts)
  and peak extra memory (``max_memory_allocated`` during the call minus
  ``memory_allocated`` before it) of the forward, and of forward + backward;
- error against the fp32 PyTorch path on the same inputs, in bf16 steps at the reference's
  largest magnitude (``2^(floor(log2 max|ref|) - 7)``): output, and the largest of dq, dk, dv.
  A Triton error above twice the PyTorch bf16 path's plus 4 steps prints MISMATCH, exit code 1.

Methods: ``triton`` (``megatron_rlhf.kernels.alibi_attention``), ``torch`` (``alibi_attention``
of ``models/bloom/attention.py``: fp32 scores, O(S^2)), ``te`` (TransformerEngine's
DotProductAttention with ALiBi slopes and a padding mask, which runs its unfused attention; only
where transformer-engine imports). Sizes stop early when ``--budget-s`` is spent (noted in the
table and the JSON); the JSON is rewritten after every configuration.

``--smoke`` runs every line at tiny sizes on the CPU under ``TRITON_INTERPRET=1`` (times
meaningless, memory not measured): ``tests/test_alibi_attention_triton.py`` does so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from megatron_rlhf.kernels import triton_alibi_attention
from megatron_rlhf.kernels.alibi_attention import fused_alibi_attention, fused_alibi_available

from megatron_rlhf.models.bloom.alibi import alibi_slopes_for_rank, positions_from_mask
from megatron_rlhf.models.bloom.attention import alibi_attention, te_attention_class
from megatron_rlhf.models.bloom.model import attention_mask_for

REPEATS = 3
TOKENS = 8192  # B x S of every measurement
HEADS = [  # (name, heads of the model, TP)
    ("7b1 tp1", 32, 1),
    ("7b1 tp4", 32, 4),
    ("176b tp8", 112, 8),
]
SEQ_LENS = [512, 2048, 4096]
HEAD_DIM = 128


class Batch:
    """Right-padded bf16 q, k, v (S, B, H, D), their key mask, positions and this rank's slopes.
    The tensors are drawn on ``device`` (``gen``: a generator there): on the CPU they took ~1 s
    a configuration; the row lengths come from the CPU generator ``lengths_gen``."""

    def __init__(self, seq, rows, heads, tp, head_dim, device, gen, lengths_gen):
        per_rank = heads // tp
        shape = (seq, rows, per_rank, head_dim)
        self.inputs = [torch.randn(shape, generator=gen, device=device) for _ in "qkv"]
        lengths = seq - torch.randint(0, seq // 8 + 1, (rows,), generator=lengths_gen)
        lengths[0] = seq
        self.key_mask = (torch.arange(seq)[None] < lengths[:, None]).long().to(device)
        self.positions = positions_from_mask(self.key_mask).float()
        self.slopes = alibi_slopes_for_rank(heads, tp - 1, tp).to(device)  # the last rank's
        self.scale = head_dim**-0.5
        shape = (seq, rows, per_rank * head_dim)
        self.grad_out = torch.randn(shape, generator=gen, device=device)


def method_calls(batch: Batch, device) -> dict:
    """name -> fn(q, k, v) returning (S, B, H*D)."""
    calls = {
        "triton": lambda q, k, v: fused_alibi_attention(
            q, k, v, batch.positions, batch.key_mask, batch.slopes, batch.scale
        ),
        "torch": lambda q, k, v: alibi_attention(
            q,
            k,
            v,
            attention_mask_for(batch.key_mask, q.shape[0]),
            batch.positions,
            batch.slopes,
            batch.scale,
        ),  # fmt: skip
    }
    te_class = te_attention_class() if device.type == "cuda" else None
    if te_class is not None:
        seq, _, heads, head_dim = batch.inputs[0].shape
        te = te_class(heads, head_dim, qkv_format="sbhd", attn_mask_type="padding_causal")
        te_mask = (batch.key_mask == 0)[:, None, None, :]  # True = masked

        def te_call(q, k, v):
            out = te(q, k, v, attention_mask=te_mask, core_attention_bias_type="alibi",
                     alibi_slopes=batch.slopes)  # fmt: skip
            return out.reshape(q.shape[0], q.shape[1], -1)

        calls["te"] = te_call
    return calls


def run(fn, batch: Batch, dtype, backward: bool):
    """(output, [dq, dk, dv] or None) of ``fn`` on the batch's inputs cast to ``dtype``."""
    leaves = [t.detach().to(dtype, copy=True).requires_grad_(backward) for t in batch.inputs]
    out = fn(*leaves)
    if not backward:
        return out, None
    out.backward(batch.grad_out.to(out.dtype))
    return out, [t.grad for t in leaves]


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| in bf16 steps at ``want``'s largest magnitude."""
    largest = want.abs().max().item()
    step = 2.0 ** (math.floor(math.log2(largest)) - 7) if largest > 0 else 2.0**-133
    return (got.float() - want.float()).abs().max().item() / step


def errors(calls: dict, batch: Batch) -> dict:
    """name -> (output error, largest gradient error) in bf16 steps against fp32 torch."""
    ref_out, ref_grads = run(calls["torch"], batch, torch.float32, True)
    result = {}
    for name, fn in calls.items():
        out, grads = run(fn, batch, torch.bfloat16, True)
        grad_err = max(bf16_steps(g, r) for g, r in zip(grads, ref_grads))
        result[name] = (bf16_steps(out, ref_out), grad_err)
    return result


def measure(fn, batch: Batch, device, backward: bool) -> tuple[float, float | None]:
    """(ms, peak extra MB or None on the CPU) of one call."""
    leaves = [t.bfloat16().requires_grad_(backward) for t in batch.inputs]
    grad_out = batch.grad_out.bfloat16()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    out = fn(*leaves)
    if backward:
        out.backward(grad_out)
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
    return elapsed, peak


def timings(calls: dict, batch: Batch, device, repeats: int) -> dict:
    """name -> {mode: (median ms, peak MB)}, repetitions interleaved across the methods."""
    samples = {(name, mode): [] for name in calls for mode in ("fwd", "fwd+bwd")}
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "fwd"
        for fn in calls.values():  # warm-up: compiles, cuBLAS handles
            measure(fn, batch, device, backward)
        for _ in range(repeats):
            for name, fn in calls.items():
                samples[(name, mode)].append(measure(fn, batch, device, backward))
    result = {name: {} for name in calls}
    for (name, mode), values in samples.items():
        peaks = [peak for _, peak in values if peak is not None]
        result[name][mode] = (
            statistics.median(ms for ms, _ in values),
            max(peaks) if peaks else None,
        )
    return result


def compile_up_front(configs, head_dim: int, device, generators) -> tuple[float, list[str]]:
    """Compile, before the clock starts, every Triton specialisation the measurements use: one
    tiny forward + backward per (heads per rank) of ``configs``. Triton specialises integer
    arguments on divisibility by 16: heads per rank (32 vs 8 and 14) give two versions of each
    of the three kernels (~5 s each to compile at head dim 128, measured for sm_90 on a 2-core
    machine); the sequence lengths (all multiples of 16, as is 64 here) and strides (head dim
    128) give no more. Compiling inside the budget left time for S=512 only. Returns (seconds,
    what was compiled)."""
    start, compiled = time.perf_counter(), []
    for config, heads, tp in configs:
        batch = Batch(64, 1, heads, tp, head_dim, device, *generators)
        run(method_calls(batch, device)["triton"], batch, torch.bfloat16, True)
        compiled.append(f"{config}: {heads // tp} heads x {head_dim}, bf16 fwd + bwd_kv + bwd_q")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, compiled


def write_results(path: Path, results: list, extra: dict) -> None:
    """The rows so far (rewritten after every configuration: a step stopped at its limit keeps
    what it measured), via a temporary name."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rows": results, **extra}, indent=1))
    tmp.replace(path)


def table_rows(config: str, seq: int, rows: int, heads: int, calls, errs, times) -> list[dict]:
    out = []
    for name in calls:
        entry = {"config": config, "seq": seq, "rows": rows, "heads_per_rank": heads}
        entry["method"] = name
        entry["fwd_ms"], entry["fwd_peak_mb"] = times[name]["fwd"]
        entry["fwd_bwd_ms"], entry["fwd_bwd_peak_mb"] = times[name]["fwd+bwd"]
        entry["out_err_bf16_steps"], entry["grad_err_bf16_steps"] = errs[name]
        out.append(entry)
    return out


def print_row(row: dict) -> None:
    def mb(value):
        return f"{'-':>9}" if value is None else f"{value:9.0f}"

    print(
        f"{row['config']:<9} {row['seq']:>5} {row['rows']:>3} {row['method']:<7}"
        f" {row['fwd_ms']:9.2f} {row['fwd_bwd_ms']:9.2f} {mb(row['fwd_peak_mb'])}"
        f" {mb(row['fwd_bwd_peak_mb'])} {row['out_err_bf16_steps']:8.1f}"
        f" {row['grad_err_bf16_steps']:8.1f}",
        flush=True,
    )


def agreement_ok(errs: dict) -> bool:
    limit = [2 * e + 4 for e in errs["torch"]]
    return all(got <= lim for got, lim in zip(errs["triton"], limit))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows and the environment here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter")
    parser.add_argument(
        "--budget-s", type=float, default=55.0,
        help="stop adding sizes after this many seconds of measuring (compiles are before it)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs triton and TRITON_INTERPRET=1 in the environment")
            return 2
        device, repeats = torch.device("cpu"), 1
        configs, seq_lens, tokens, head_dim = [("tiny tp2", 4, 2)], [24, 40], 80, 80
        triton_alibi_attention.BLOCK_M = triton_alibi_attention.BLOCK_N = 16
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
            return 2
        device, repeats = torch.device("cuda"), REPEATS
        configs, seq_lens, tokens, head_dim = HEADS, SEQ_LENS, TOKENS, HEAD_DIM
    if not fused_alibi_available(torch.empty(0, dtype=torch.bfloat16, device=device)):
        print("the Triton kernel cannot run here (no triton, or its probe failed)")
        return 2
    generators = (torch.Generator(device=device).manual_seed(0), torch.Generator().manual_seed(0))
    compile_s, compiled = compile_up_front(configs, head_dim, device, generators)
    print(f"compiled before measuring ({compile_s:.1f} s): " + "; ".join(compiled), flush=True)
    environment = {
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "smoke": args.smoke,
    }
    print(
        f"{'config':<9} {'S':>5} {'B':>3} {'method':<7} {'fwd ms':>9} {'f+b ms':>9} {'fwd MB':>9}"
        f" {'f+b MB':>9} {'out err':>8} {'grad err':>8}   (errors: bf16 steps vs fp32 torch)"
    )
    started = time.perf_counter()  # the budget's clock: compiles are done
    results, mismatches, stopped = [], [], None

    def record(done: bool) -> None:
        if args.json:
            environment["te"] = any(row["method"] == "te" for row in results)
            write_results(args.json, results, {
                "environment": environment, "compile_s": compile_s, "compiled": compiled,
                "seconds": time.perf_counter() - started, "stopped": stopped,
                "mismatches": mismatches, "complete": done,
            })  # fmt: skip

    for seq in seq_lens:
        for config, heads, tp in configs:
            if time.perf_counter() - started > args.budget_s:
                stopped = f"budget of {args.budget_s:.0f} s spent before {config} S={seq}"
                break
            rows = max(1, tokens // seq)
            batch = Batch(seq, rows, heads, tp, head_dim, device, *generators)
            calls = method_calls(batch, device)
            try:
                errs = errors(calls, batch)
            except Exception as err:  # TE's own failure must not cost the other columns
                if calls.pop("te", None) is None:
                    raise
                print(f"te dropped at {config} S={seq}: {type(err).__name__}: {err}")
                errs = errors(calls, batch)
            times = timings(calls, batch, device, repeats)
            for row in table_rows(config, seq, rows, heads // tp, calls, errs, times):
                results.append(row)
                print_row(row)
            if not agreement_ok(errs):
                mismatches.append(f"{config} S={seq}")
                print(f"MISMATCH {config} S={seq}: triton {errs['triton']} torch {errs['torch']}")
            del batch, calls
            record(done=False)
    elapsed = time.perf_counter() - started
    if stopped:
        print(f"stopped: {stopped}")
    print(f"total {elapsed:.1f} s measuring, {compile_s:.1f} s compiling before")
    record(done=True)
    return 1 if mismatches else 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
