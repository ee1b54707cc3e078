"""The fused ALiBi attention kernel without a GPU: compiled for sm_90a, and run by the interpreter.

1. Forward and both backward kernels compile to a cubin for sm_90a (H100/H200) for every
   supported head dim (64, 80 = padded 128 block, 128): bf16 here, fp32 (IEEE dots) marked slow.
2. Under ``TRITON_INTERPRET=1``, at tiny sizes with 16-token blocks (block edges inside rows and
   sequences), against a float64 PyTorch reference (``models/bloom/attention.py``'s functions on
   float64 tensors): outputs and dq, dk, dv of left- and right-padded batches with an
   empty-after-padding row, rows with padding inside a sequence (``1 1 1 0 0 1 1``, alone and
   packed), packed ragged THD rows with trailing padding, every head dim, bf16
   and fp32; a TP rank's slopes through the core attention module; positions far from 0 (where
   an absolute ``slope * pos_k`` bias would lose fp32 bits: the one place the query-relative
   offset is visible, since a softmax row ignores a constant); and ``BloomModel`` with
   ``attention_backend="triton"`` against ``"torch"``, forward and backward, padded and packed,
   and generation with and without a KV cache; batch x heads on grid axis 0.
   Triton reads that variable when kernels are decorated, so this file re-runs itself in a
   subprocess: ``python tests/test_alibi_attention_triton.py --out results.json``.
3. ``benchmarks/gpu_attention.py --smoke`` runs under the interpreter (slow).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from triton_interpreter import REPO, run_checks, run_python
from triton_interpreter import interpreter_results as run_under_interpreter

triton = pytest.importorskip("triton")

# ---------------------------------------------------------------- 1. compile for sm_90

_KERNELS = {  # kernel: (tensor pointers, fp32 pointers, int32 pointers, stride arguments)
    "_forward_kernel": (4, ["lse", "slopes", "pos"], ["seg", "first"], 12),
    "_backward_kv_kernel": (6, ["lse", "delta", "slopes", "pos"], ["seg", "last"], 18),
    "_backward_q_kernel": (5, ["lse", "delta", "slopes", "pos"], ["seg", "first"], 15),
}


def _compile(kernel: str, dtype: str, head_dim: int) -> int:
    from megatron_rlhf.kernels import triton_alibi_attention as module
    from triton.backends.compiler import GPUTarget

    fn = getattr(module, kernel)
    tensors, floats, ints, strides = _KERNELS[kernel]
    types = [f"*{dtype}"] * tensors + ["*fp32"] * len(floats) + ["*i32"] * len(ints)
    types += ["i32"] * strides + ["i32"] * 4 + ["fp32"]  # heads, seq_q, seq_k, head_dim, scale
    block_d = triton.next_power_of_2(head_dim)
    constexprs = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": block_d, "IEEE": dtype == "fp32"}
    signature = dict(zip(fn.arg_names, types))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": 8 if block_d > 64 else 4, "num_stages": 2}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return len(compiled.asm["cubin"])


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("kernel", list(_KERNELS))
def test_attention_kernel_compiles_for_sm90_bf16(kernel, head_dim):
    assert _compile(kernel, "bf16", head_dim) > 1000


@pytest.mark.launch
@pytest.mark.parametrize("head_dim", [64, 128])  # 80 compiles as 128 (the padded block)
@pytest.mark.parametrize("kernel", list(_KERNELS))
def test_attention_kernel_compiles_for_sm90_fp32(kernel, head_dim):
    assert _compile(kernel, "fp32", head_dim) > 1000


# ---------------------------------------------------------------- 2. interpreter checks


def _exact(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 for a float64 reference run, else fp32 (the PyTorch path's own)."""
    return t.to(torch.float64 if like.dtype == torch.float64 else torch.float32)


def _reference_padded(q, k, v, key_mask, positions, slopes, scale):
    """The PyTorch path (Megatron's mask from the key mask, the query-relative bias)."""
    from megatron_rlhf.models.bloom.attention import alibi_attention
    from megatron_rlhf.models.bloom.model import attention_mask_for

    mask = attention_mask_for(key_mask, q.shape[0])
    return alibi_attention(q, k, v, mask, _exact(positions, q), _exact(slopes, q), scale)


def _run(fn, inputs, dtype, weights):
    """``fn`` on ``inputs`` cast to ``dtype``: [output, dq, dk, dv] of ``sum(out * weights)``."""
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.double() * weights).sum().backward()
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def _compare(fused_fn, reference_fn, inputs, dtype, gen, what):
    """The fused kernel in ``dtype`` against ``reference_fn`` in float64 (``inputs`` are float64):
    output, dq, dk, dv. fp32: within 1e-4 of the largest value (or of 1); bf16: within twice the error of
    the PyTorch path in bf16 plus four bf16 steps (2^-8) of the largest value."""
    expected = reference_fn(*inputs)
    weights = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    exact = _run(reference_fn, inputs, torch.float64, weights)
    ours = _run(fused_fn, inputs, dtype, weights)
    assert torch.isfinite(ours[0]).all(), f"{what}: non-finite output"
    baseline = None if dtype == torch.float32 else _run(reference_fn, inputs, dtype, weights)
    details = []
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        scale = max(exact[i].abs().max().item(), 1.0)
        err = (ours[i] - exact[i]).abs().max().item()
        if baseline is None:
            tol = 1e-4 * scale
        else:
            tol = 2 * (baseline[i] - exact[i]).abs().max().item() + 4 * 2**-8 * scale
        assert err <= tol, f"{what} {name}: max abs error {err:.3g} > {tol:.3g}"
        details.append(f"{name} {err / scale:.1g}")
    return f"{what} (max error / max value): " + " ".join(details)


def _padded_rows(seq: int, batch: int) -> torch.Tensor:
    """Key masks: left padding, an empty row (padding only), right padding, a full row..."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, : seq // 3] = 0  # left padding: the first queries see no key
    mask[1] = 0  # empty after padding
    if batch > 2:
        mask[2, -5:] = 0  # right padding: padding queries see every real key
    return mask


def _padded_case(gen, dtype, head_dim, seq):
    from megatron_rlhf.kernels.alibi_attention import fused_alibi_attention

    from megatron_rlhf.models.bloom.alibi import alibi_slopes, positions_from_mask

    batch, heads = 4, 2
    key_mask = _padded_rows(seq, batch)
    positions = positions_from_mask(key_mask).float()
    slopes, scale = alibi_slopes(heads), head_dim**-0.5
    inputs = [torch.randn(seq, batch, heads, head_dim, generator=gen, dtype=torch.float64)]
    inputs += [torch.randn(inputs[0].shape, generator=gen, dtype=torch.float64) for _ in "kv"]
    return _compare(
        lambda q, k, v: fused_alibi_attention(q, k, v, positions, key_mask, slopes, scale),
        lambda q, k, v: _reference_padded(q, k, v, key_mask, positions, slopes, scale),
        inputs,
        dtype,
        gen,
        f"{dtype} d={head_dim} S={seq}",
    )


def check_padded(gen):
    cases = [(torch.float32, 64, 37), (torch.float32, 80, 21), (torch.float32, 128, 19)]
    cases += [(torch.bfloat16, 64, 21), (torch.bfloat16, 80, 37), (torch.bfloat16, 128, 19)]
    return "; ".join(_padded_case(gen, *case) for case in cases)


def check_segments_and_fewer_queries(gen):
    """Two sequences packed in each row of a padded batch (the masked path's segment ids, as
    under sequence parallelism), and queries that are the last Sq < Sk tokens."""
    from megatron_rlhf.kernels.alibi_attention import fused_alibi_attention

    from megatron_rlhf.models.bloom.alibi import alibi_slopes, positions_from_mask

    key_mask = torch.tensor([[1] * 7 + [2] * 12 + [0] * 4, [0] * 3 + [1] * 18 + [2] * 2])
    positions = positions_from_mask(key_mask).float()
    slopes = alibi_slopes(3)
    seq_k, seq_q = key_mask.shape[1], 17
    q = torch.randn(seq_q, 2, 3, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(seq_k, 2, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    return _compare(
        lambda q, k, v: fused_alibi_attention(q, k, v, positions, key_mask, slopes, 0.25),
        lambda q, k, v: _reference_padded(q, k, v, key_mask, positions, slopes, 0.25),
        [q, k, v],
        torch.float32,
        gen,
        "segments, Sq < Sk",
    )


def _fp32_against_the_mask(gen, key_mask, positions, slopes, what: str) -> str:
    """The fused kernel in fp32 against the PyTorch path (``attention_mask_for``) in float64, on
    random (S, B, H, 16) q, k, v for ``key_mask`` (B, S), one head per slope, scale 1/4."""
    from megatron_rlhf.kernels.alibi_attention import fused_alibi_attention

    batch, seq = key_mask.shape
    shape = (seq, batch, slopes.numel(), 16)
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in "qkv"]
    return _compare(
        lambda q, k, v: fused_alibi_attention(q, k, v, positions, key_mask, slopes, 0.25),
        lambda q, k, v: _reference_padded(q, k, v, key_mask, positions, slopes, 0.25),
        inputs,
        torch.float32,
        gen,
        what,
    )


def check_hole_in_a_row(gen):
    """Padding inside a sequence: ``1 1 1 0 0 1 1`` is one sequence whose last tokens see its
    first ones (``attention_mask_for``, and ``positions_from_mask`` counts on across the hole).
    The loop bounds started a new sequence at each run of an id, so those queries skipped key
    blocks they see and the kv backward used a log-sum-exp that never counted them (output off
    by ~1, dk by ~3). Rows cross 16-token blocks: the hole alone, after left padding, and in a
    packed row's second sequence; plus the 7-token row itself."""
    from megatron_rlhf.models.bloom.alibi import alibi_slopes, positions_from_mask

    rows = [
        [1] * 20 + [0] * 20 + [1] * 24,
        [0] * 5 + [1] * 13 + [0] * 19 + [1] * 10 + [2] * 17,
        [1] * 18 + [2] * 14 + [0] * 17 + [2] * 15,
    ]
    details = []
    for key_mask in (torch.tensor(rows), torch.tensor([[1, 1, 1, 0, 0, 1, 1]])):
        positions = positions_from_mask(key_mask).float()
        what = f"holes S={key_mask.shape[1]}"
        details.append(_fp32_against_the_mask(gen, key_mask, positions, alibi_slopes(2), what))
    return "; ".join(details)


def check_grid_axes(gen):
    """Batch x heads goes on grid axis 0 (CUDA allows 2**31 - 1 there, 65,535 on axis 1: scoring
    4,096 rows of a 16-head model is 65,536 programs); the row's blocks on axis 1."""
    from megatron_rlhf.kernels import triton_alibi_attention as kernel
    from megatron_rlhf.kernels.alibi_attention import fused_alibi_attention

    grids = {}

    class Recorded:
        def __init__(self, name, jit):
            self.name, self.jit = name, jit

        def __getitem__(self, grid):
            grids[self.name] = grid
            return self.jit[grid]

    names = ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel")
    real = {name: getattr(kernel, name) for name in names}
    try:
        for name in names:
            setattr(kernel, name, Recorded(name, real[name]))
        batch, heads, seq = 3, 5, 20
        q, k, v = (torch.randn(seq, batch, heads, 16, requires_grad=True) for _ in "qkv")
        mask = torch.ones(batch, seq, dtype=torch.long)
        positions = torch.arange(seq, dtype=torch.float32).expand(batch, seq)
        slopes = torch.ones(heads)
        fused_alibi_attention(q, k, v, positions, mask, slopes, 0.25).sum().backward()
    finally:
        for name in names:
            setattr(kernel, name, real[name])
    blocks = -(-seq // kernel.BLOCK_M)
    assert grids == dict.fromkeys(names, (batch * heads, blocks)), grids
    return f"grids {grids}"


def test_loop_bounds_cover_every_key_the_mask_lets_a_query_see():
    """``alibi_loop_bounds`` against ``attention_mask_for`` (the mask the PyTorch path applies):
    each query's first key is at or before every key it sees, and each key's last query is after
    every query that sees it, for rows with padding inside a sequence, left and right padding and
    packed ids. (Runs on the CPU without Triton kernels.)"""
    from megatron_rlhf.kernels.alibi_attention import alibi_loop_bounds

    from megatron_rlhf.models.bloom.model import attention_mask_for

    rows = torch.tensor([
        [1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 1, 2, 2, 0, 2],
        [1, 2, 2, 2, 3, 0, 3, 3, 3, 3],
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
    ])  # fmt: skip
    seen = ~attention_mask_for(rows, rows.shape[1])[:, 0]  # (B, Sq, Sk) True: query sees key
    bounds = alibi_loop_bounds(rows)
    first_key, last_query = bounds[:, 0], bounds[:, 1]
    index = torch.arange(rows.shape[1])
    for b in range(rows.shape[0]):
        for i, j in seen[b].nonzero().tolist():
            assert first_key[b, i] <= j, (rows[b].tolist(), i, j)
            assert i < last_query[b, j], (rows[b].tolist(), i, j)
    assert (first_key <= index).all()  # and never past the query itself


def _packed_case(gen, dtype, head_dim):
    from megatron_rlhf.kernels.alibi_attention import fused_packed_alibi_attention

    from megatron_rlhf.models.bloom.alibi import alibi_slopes
    from megatron_rlhf.models.bloom.attention import packed_alibi_attention

    cu_seqlens = torch.tensor([0, 5, 6, 23, 40], dtype=torch.int32)  # then 5 trailing tokens
    slopes, scale = alibi_slopes(4)[1:], head_dim**-0.5
    inputs = [torch.randn(45, 3, head_dim, generator=gen, dtype=torch.float64) for _ in "qkv"]
    return _compare(
        lambda q, k, v: fused_packed_alibi_attention(q, k, v, cu_seqlens, slopes, scale),
        lambda q, k, v: packed_alibi_attention(q, k, v, cu_seqlens, _exact(slopes, q), scale),
        inputs,
        dtype,
        gen,
        f"packed {dtype} d={head_dim}",
    )


def check_packed(gen):
    return "; ".join(
        _packed_case(gen, *case) for case in [(torch.float32, 80), (torch.bfloat16, 64)]
    )


def check_tp_rank_slopes(gen):
    """Rank 1 of TP 2 of an 8-head model holds heads 4..7: the core attention must use the
    global slopes of those heads (not the slopes of a 4-head model, nor heads 0..3)."""
    from megatron_rlhf.models.bloom.alibi import alibi_slopes, positions_from_mask
    from megatron_rlhf.models.bloom.attention import FusedAlibiDotProductAttention

    group = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    config = SimpleNamespace(num_attention_heads=8, kv_channels=16, attention_dropout=0.0)
    module = FusedAlibiDotProductAttention(
        config, 1, None, "self", pg_collection=SimpleNamespace(tp=group)
    )
    key_mask = _padded_rows(19, 2)
    positions = positions_from_mask(key_mask).float()
    key_info = torch.stack([positions, key_mask.float()], 1)
    inputs = [torch.randn(19, 2, 4, 16, generator=gen, dtype=torch.float64) for _ in "qkv"]
    return _compare(
        lambda q, k, v: module(q, k, v, None, attention_bias=key_info),
        lambda q, k, v: _reference_padded(q, k, v, key_mask, positions, alibi_slopes(8)[4:], 0.25),
        inputs,
        torch.float32,
        gen,
        "TP rank 1 of 2",
    )


def check_far_positions(gen):
    """Keys and queries at positions 200,000 on (the tail of a very long row): the relative
    bias is as small as at position 0; an absolute one (~1e5) would keep 3 bits of the score."""
    from megatron_rlhf.models.bloom.alibi import alibi_slopes

    key_mask = torch.ones(2, 23, dtype=torch.long)
    positions = torch.arange(23, dtype=torch.float32).expand(2, 23) + 200_000
    slopes = alibi_slopes(2) * 8  # the steepest head of a BLOOM model: 0.5
    return _fp32_against_the_mask(gen, key_mask, positions, slopes, "positions 200,000+")


def check_bloom_model(gen):
    """BloomModel with attention_backend='triton' (no (B, 1, S, S) mask built) against 'torch':
    logits and every parameter's gradient, a padded batch with an empty row, a packed row."""
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    initialize()
    try:
        arch = BloomArchitecture(vocab_size=100, hidden_size=48, num_layers=2, num_heads=6)
        ids = torch.randint(0, 100, (3, 11), generator=gen)
        padded = _padded_rows(11, 3)
        packed = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0]])
        results = {}
        for backend in ("torch", "triton"):
            torch.manual_seed(0)
            model = BloomModel(arch, attention_backend=backend)
            assert model.attention_backend == backend
            logits = model(ids, padded)
            (logits.float().square().mean() + model(ids[:1], packed).float().mean()).backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            results[backend] = (logits.detach(), model(ids[:1], packed).detach(), grads)
    finally:
        destroy()
    torch_run, triton_run = results["torch"], results["triton"]
    logit_err = (torch_run[0] - triton_run[0]).abs().max().item()
    packed_err = (torch_run[1] - triton_run[1]).abs().max().item()
    grad_err = max((torch_run[2][n] - triton_run[2][n]).abs().max().item() for n in torch_run[2])
    assert logit_err < 1e-5 and packed_err < 1e-5, (logit_err, packed_err)
    assert grad_err < 1e-5, grad_err
    return f"logits {logit_err:.1g}, packed {packed_err:.1g}, grads {grad_err:.1g}"


def check_bloom_generate(gen):
    """Generation with a KV cache (prefill through the kernel, decode on the PyTorch path) and
    without one (every step through the kernel) gives the tokens of attention_backend='torch'."""
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.generation.decode_loop import SamplingConfig, generate
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    initialize()
    try:
        arch = BloomArchitecture(vocab_size=100, hidden_size=48, num_layers=2, num_heads=6)
        ids = torch.randint(4, 100, (3, 7), generator=gen)
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1] * 7])
        tokens = {}
        for backend in ("torch", "triton"):
            torch.manual_seed(0)
            model = BloomModel(arch, attention_backend=backend).eval()
            for kv_cache in (True, False):
                sampling = SamplingConfig(
                    max_new_tokens=5, row_seeds=(1, 2, 3), eos_id=-1, use_kv_cache=kv_cache
                )
                out = generate(model, ids, mask, sampling)
                tokens[backend, kv_cache] = out.response_ids.tolist()
    finally:
        destroy()
    assert len({str(t) for t in tokens.values()}) == 1, tokens
    return f"{len(tokens)} runs, the same tokens"


CHECKS = {
    "padded": check_padded,
    "segments_and_fewer_queries": check_segments_and_fewer_queries,
    "packed": check_packed,
    "tp_rank_slopes": check_tp_rank_slopes,
    "far_positions": check_far_positions,
    "bloom_model": check_bloom_model,
    "bloom_generate": check_bloom_generate,
    "hole_in_a_row": check_hole_in_a_row,
    "grid_axes": check_grid_axes,
}


def _run_checks(out: Path) -> None:
    from megatron_rlhf.kernels import _dispatch, triton_alibi_attention

    assert _dispatch.INTERPRET and _dispatch.HAVE_TRITON, "run with TRITON_INTERPRET=1"
    triton_alibi_attention.BLOCK_M = triton_alibi_attention.BLOCK_N = 16
    run_checks(CHECKS, out)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention_interpret") / "results.json"
    return run_under_interpreter(__file__, out)


@pytest.mark.launch
@pytest.mark.parametrize("check", list(CHECKS))
def test_fused_attention_under_interpreter(check, interpreter_results):
    result = interpreter_results[check]
    assert result["ok"], result["detail"]


@pytest.mark.launch
def test_attention_benchmark_script_runs_under_interpreter(tmp_path):
    """benchmarks/gpu_attention.py cannot time anything here; --smoke runs every line of it:
    the compiles before the budget's clock, and the JSON (rewritten after every size)."""
    import json

    out = tmp_path / "attention.json"
    script = str(REPO / "benchmarks" / "gpu_attention.py")
    proc = run_python([script, "--smoke", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MISMATCH" not in proc.stdout
    assert "triton" in proc.stdout and "total" in proc.stdout
    assert proc.stdout.index("compiled before measuring") < proc.stdout.index("config")
    result = json.loads(out.read_text())
    assert result["complete"] and result["compiled"] == [
        "tiny tp2: 2 heads x 80, bf16 fwd + bwd_kv + bwd_q"
    ]
    assert {row["seq"] for row in result["rows"]} == {24, 40}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    _run_checks(parser.parse_args().out)
