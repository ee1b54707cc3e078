"""The Triton kernels without a GPU: compiled for sm_90 (H100/H200), and run by the interpreter.

1. Every kernel is compiled down to a cubin for sm_90a with the signatures its launcher uses
   (Triton's front end, LLVM and ptxas all run on the CPU), so type and lowering errors that the
   interpreter would forgive surface here.
2. The public API runs through the Triton kernels under ``TRITON_INTERPRET=1`` at tiny sizes with
   small block sizes (several vocabulary blocks and splits, several GAE blocks, sizes that are not
   multiples of the blocks), against float64 references and the PyTorch path. Triton reads that
   variable when kernels are decorated, so this file re-runs itself in a subprocess with it set:
   ``python tests/test_kernels_triton.py --out results.json``.
3. ``benchmarks/gpu_kernels.py --smoke`` runs (agreement checks and tables) under the interpreter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from triton_interpreter import REPO, run_checks, run_python
from triton_interpreter import interpreter_results as run_under_interpreter

triton = pytest.importorskip("triton")

# ---------------------------------------------------------------- 1. compile for sm_90

_FLOATS = ["*bf16", "*fp32"]


def _compile_cases():
    lp_stats = {
        "x_ptr": None,
        "targets_ptr": "*i64",
        "out_ptr": "*fp32",
        "n_rows": "i32",
        "vocab": "i32",
        "row_stride": "i32",
        "blocks_per_program": "i32",
        "inv_temp": "fp32",
    }
    lp_grad = {
        "x_ptr": None,
        "grad_ptr": None,
        "targets_ptr": "*i64",
        "lse_ptr": "*fp32",
        "entropy_ptr": "*fp32",
        "grad_logprob_ptr": "*fp32",
        "grad_entropy_ptr": "*fp32",
        "vocab": "i32",
        "x_row_stride": "i32",
        "grad_row_stride": "i32",
        "inv_temp": "fp32",
    }
    cases = []
    for dtype in _FLOATS:
        for entropy in (True, False):
            consts = {"BLOCK_V": 4096, "WITH_ENTROPY": entropy}
            stats_sig = {k: v or dtype for k, v in lp_stats.items()}
            grad_sig = {k: v or dtype for k, v in lp_grad.items()}
            cases.append(("triton_logprobs", "_stats_kernel", stats_sig, consts, 8))
            cases.append(("triton_logprobs", "_grad_kernel", grad_sig, consts, 8))
    kl_sig = {"logprobs_ptr": "*fp32", "ref_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    for kind in range(4):
        cases.append(("triton_advantages", "_kl_kernel", kl_sig, {"KIND": kind, "BLOCK": 1024}, 4))
    rows = {"seq_len": "i32"}
    shaped = {"scores_ptr": "*fp32", "kl_ptr": "*fp32", "mask_ptr": "*fp32", "out_ptr": "*fp32"}
    cases.append(
        (
            "triton_advantages",
            "_shaped_rewards_kernel",
            {**shaped, **rows, "beta": "fp32"},
            {"BLOCK_T": 1024},
            4,
        )
    )
    gae_ptrs = ["rewards_ptr", "values_ptr", "mask_ptr", "advantages_ptr", "returns_ptr"]
    gae_sig = {**dict.fromkeys(gae_ptrs, "*fp32"), "discounts_ptr": "*fp64", **rows}
    cases.append(("triton_advantages", "_gae_kernel", gae_sig, {"BLOCK_T": 1024}, 4))
    return cases


@pytest.mark.parametrize(
    "module,kernel,signature,constexprs,num_warps",
    _compile_cases(),
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_kernel_compiles_for_sm90(module, kernel, signature, constexprs, num_warps):
    import importlib

    from triton.backends.compiler import GPUTarget

    fn = getattr(importlib.import_module(f"megatron_rlhf.kernels.{module}"), kernel)
    source = triton.compiler.ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    assert len(compiled.asm["cubin"]) > 1000


# ---------------------------------------------------------------- 2. interpreter checks


def _ref_logprobs(logits, targets, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _ragged_mask(batch, seq_len, gen):
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=gen)
    lengths[:3] = torch.tensor([0, seq_len, 1])
    starts = (torch.rand(batch, generator=gen) * (seq_len - lengths + 1)).long()
    positions = torch.arange(seq_len)
    return (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])


def _close(a, b, atol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"
    return f"{what} err {err:.2g}"


def check_logprobs_forward_backward(gen):
    from megatron_rlhf.kernels import pytorch_only, token_logprobs

    details = []
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(2, 6, 203, generator=gen) * 3).to(dtype).requires_grad_()
        targets = torch.randint(0, 203, (2, 6), generator=gen)
        w_lp, w_h = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
        # logits[:, 1:] is a strided view: rows reach the kernel with a row stride != V
        lp, ent = token_logprobs(logits[:, 1:], targets[:, 1:], 0.8, return_entropy=True)
        ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
        ref_in = logits.detach().double().requires_grad_()
        ref_lp, ref_h = _ref_logprobs(ref_in[:, 1:], targets[:, 1:], 0.8)
        ((ref_lp * w_lp).sum() + (ref_h * w_h).sum()).backward()
        details.append(_close(lp, ref_lp, 2e-5, f"{dtype} logp"))
        details.append(_close(ent, ref_h, 2e-5, f"{dtype} entropy"))
        scale = ref_in.grad.abs().max().item()
        grad_tol = (3e-6 if dtype == torch.float32 else 2e-2) * scale
        details.append(_close(logits.grad, ref_in.grad, grad_tol, f"{dtype} grad"))
        with pytorch_only():
            lp_torch = token_logprobs(logits[:, 1:], targets[:, 1:], 0.8)
        details.append(_close(lp, lp_torch, 2e-6, f"{dtype} vs pytorch path"))
    return "; ".join(details)


def check_masked_vocab(gen):
    from megatron_rlhf.kernels import token_logprobs

    logits = torch.randn(2, 4, 90, generator=gen)
    logits[0, :, :40] = float("-inf")  # whole vocabulary blocks of -inf
    logits[1, 3, 1:] = float("-inf")
    targets = torch.randint(40, 90, (2, 4), generator=gen)
    targets[1, 3] = 0
    logits.requires_grad_()
    logprobs, entropy = token_logprobs(logits, targets, 0.7, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    ref = torch.log_softmax(logits.detach().double() / 0.7, dim=-1)
    ref_h = -(ref.exp() * ref).nan_to_num().sum(-1)
    assert torch.isfinite(logits.grad).all() and (logits.grad[0, :, :40] == 0).all()
    return "; ".join(
        [
            _close(logprobs, ref.gather(-1, targets[..., None])[..., 0], 2e-6, "logp"),
            _close(entropy, ref_h, 2e-6, "entropy"),
            "finite gradient, 0 on masked entries",
        ]
    )


def check_logprobs_from_hidden(gen):
    from megatron_rlhf.kernels import token_logprobs_from_hidden

    hidden = torch.randn(2, 7, 8, generator=gen).requires_grad_()
    weight = torch.randn(150, 8, generator=gen).requires_grad_()
    targets = torch.randint(0, 150, (2, 7), generator=gen)
    lp, ent = token_logprobs_from_hidden(
        hidden, weight, targets, return_entropy=True, token_chunk=5, vocab_chunk=64
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    ref_h, ref_w = hidden.detach().double().requires_grad_(), weight.detach().double()
    ref_w.requires_grad_()
    ref_lp, ref_ent = _ref_logprobs(ref_h @ ref_w.T, targets)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    return "; ".join(
        [
            _close(lp, ref_lp, 2e-5, "logp"),
            _close(ent, ref_ent, 2e-5, "entropy"),
            _close(hidden.grad, ref_h.grad, 1e-5, "grad hidden"),
            _close(weight.grad, ref_w.grad, 1e-5, "grad weight"),
        ]
    )


def check_kl_penalty(gen):
    from megatron_rlhf.kernels import kl_penalty

    logprobs = -torch.rand(3, 45, generator=gen) * 4
    ref = logprobs + torch.randn(3, 45, generator=gen) * torch.logspace(-6, 0, 45)
    log_ratio = logprobs.double() - ref.double()
    expected = {
        "k1": log_ratio,
        "k2": log_ratio**2 / 2,
        "k3": torch.expm1(-log_ratio) + log_ratio,
        "abs": log_ratio.abs(),
    }
    details = []
    for kind, value in expected.items():
        out = kl_penalty(logprobs, ref, kind)
        rel = ((out.double() - value).abs() / value.abs().clamp(min=1e-30)).max().item()
        assert rel < 1e-6, f"{kind}: relative error {rel:.3g}"
        details.append(f"{kind} rel err {rel:.2g}")
    return "; ".join(details)


def check_shaped_rewards(gen):
    from megatron_rlhf.kernels import shaped_rewards

    mask = _ragged_mask(6, 21, gen)
    kl = torch.randn(6, 21, generator=gen)
    scores = torch.randn(6, generator=gen)
    out = shaped_rewards(scores, kl, mask, 0.1)
    expected = torch.zeros(6, 21, dtype=torch.float64)
    for b in range(6):
        valid = torch.nonzero(mask[b]).flatten().tolist()
        for t in valid:
            expected[b, t] = -0.1 * float(kl[b, t])
        if valid:
            expected[b, valid[-1]] += float(scores[b])
    return _close(out, expected, 1e-6, "rewards")


def check_gae(gen):
    from megatron_rlhf.kernels import gae, pytorch_only

    details = []
    for seq_len, gamma, lam in [(37, 0.99, 0.95), (19, 1.0, 1.0), (8, 0.5, 0.0)]:
        mask = _ragged_mask(5, seq_len, gen)
        rewards = torch.randn(5, seq_len, generator=gen)
        values = torch.randn(5, seq_len, generator=gen)
        adv, ret = gae(rewards, values, mask, gamma, lam)
        with pytorch_only():
            ref_adv, ref_ret = gae(rewards.double(), values.double(), mask, gamma, lam)
        details.append(_close(adv, ref_adv, 2e-5, f"T={seq_len} advantages"))
        details.append(_close(ret, ref_ret, 2e-5, f"T={seq_len} returns"))
    return "; ".join(details)


CHECKS = {
    "logprobs_forward_backward": check_logprobs_forward_backward,
    "masked_vocab": check_masked_vocab,
    "logprobs_from_hidden": check_logprobs_from_hidden,
    "kl_penalty": check_kl_penalty,
    "shaped_rewards": check_shaped_rewards,
    "gae": check_gae,
}


def _run_checks(out: Path) -> None:
    from megatron_rlhf.kernels import _dispatch, triton_advantages, triton_logprobs

    assert _dispatch.INTERPRET and _dispatch.HAVE_TRITON, "run with TRITON_INTERPRET=1"
    # small blocks: several vocabulary blocks and splits per row, several GAE blocks per row
    triton_logprobs.BLOCK_V, triton_logprobs.TARGET_PROGRAMS = 32, 40
    triton_advantages.BLOCK_T = 8
    run_checks(CHECKS, out)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton_interpret") / "results.json"
    return run_under_interpreter(__file__, out, quiet=False)


@pytest.mark.launch
@pytest.mark.parametrize("check", list(CHECKS))
def test_triton_interpreter(check, interpreter_results):
    result = interpreter_results[check]
    assert result["ok"], result["detail"]


@pytest.mark.launch
def test_gpu_benchmark_script_runs_under_interpreter():
    """benchmarks/gpu_kernels.py cannot run here; its --smoke mode runs every line of it."""
    proc = run_python([str(REPO / "benchmarks" / "gpu_kernels.py"), "--smoke"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MISMATCH" not in proc.stdout
    for heading in ("agreement", "log-probs", "GAE"):
        assert heading in proc.stdout


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    _run_checks(parser.parse_args().out)
