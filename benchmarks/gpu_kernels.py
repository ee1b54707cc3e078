"""The kernels on one CUDA GPU with Triton: agreement first, then time and peak memory tables.

    python benchmarks/gpu_kernels.py [--tokens 1024 2048] [--hidden 4096]   (H100/H200: < 5 min)

1. Agreement, before any timing (the script stops with exit code 1 on a mismatch): the Triton
   path against the PyTorch path on the same GPU tensors and against float64 references, for
   ``token_logprobs`` (log-prob, entropy, gradient) at V = 250,880 in bf16,
   ``token_logprobs_from_hidden``, ``kl_penalty``, ``shaped_rewards`` and ``gae`` (ragged masks).
2. Log-probs at V = 250,880, bf16, B = 1: naive ``log_softmax(logits.float()).gather``,
   megatron-core ``vocab_parallel_cross_entropy`` (TP=1), ours with Triton, ours on the PyTorch
   path, ``hidden @ W.T`` + naive, and ``token_logprobs_from_hidden``; forward only and forward +
   backward. Time: best of 3 after a warm-up, CUDA-synchronised. Peak extra memory:
   ``torch.cuda.max_memory_allocated()`` during the call minus ``memory_allocated()`` before it
   (outputs and gradients included).
3. GAE: the per-token loop of TRL/OpenRLHF on the GPU, our vectorised PyTorch path, and the
   Triton kernel, for B in {64, 256} and T in {1024, 2048}.

``--smoke`` runs all of it at tiny sizes on the CPU under ``TRITON_INTERPRET=1`` (times
meaningless, memory not measured): ``tests/test_kernels_triton.py`` does so to keep this script
working without a GPU. No GPU was available when this was written, so no table is recorded here:
the kernels were compiled for sm_90a and checked under the interpreter only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from megatron_rlhf.kernels import (
    gae,
    kl_penalty,
    pytorch_only,
    shaped_rewards,
    token_logprobs,
    token_logprobs_from_hidden,
)

VOCAB = 250_880
REPEATS = 3  # timed calls per measurement, after one warm-up (1 under --smoke)


class Mismatch(Exception):
    pass


def expect_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    err = (got.double() - want.double()).abs().max().item()
    status = "ok" if err <= atol else "MISMATCH"
    print(f"  {name:<46} max |diff| {err:9.2e}  (tol {atol:.0e})  {status}", flush=True)
    if err > atol:
        raise Mismatch(name)


def ragged_mask(batch: int, seq_len: int, device) -> torch.Tensor:
    lengths = torch.randint(0, seq_len + 1, (batch,), device=device)
    lengths[:2] = torch.tensor([0, seq_len], device=device)
    starts = (torch.rand(batch, device=device) * (seq_len - lengths + 1)).long()
    positions = torch.arange(seq_len, device=device)
    return (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])


def check_agreement(device, vocab: int, tokens: int, hidden_size: int, gae_shape) -> None:
    print(f"agreement (Triton vs PyTorch path vs float64), V={vocab}, {tokens} tokens")
    logits = (torch.randn(2, tokens // 2, vocab, device=device) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (2, tokens // 2), device=device)
    weights = torch.randn(2, tokens // 2, device=device)
    results = {}
    for path in ("triton", "pytorch"):
        logits.grad = None
        with pytorch_only() if path == "pytorch" else _nothing():
            logp, entropy = token_logprobs(logits, targets, 0.9, return_entropy=True)
            ((logp * weights).sum() + entropy.sum()).backward()
        results[path] = (logp.detach(), entropy.detach(), logits.grad.clone())
    ref = torch.log_softmax(logits.detach().double() / 0.9, dim=-1)
    ref_logp = ref.gather(-1, targets[..., None])[..., 0]
    ref_entropy = -(ref.exp() * ref).sum(-1)
    del ref
    (t_lp, t_h, t_grad), (p_lp, p_h, p_grad) = results["triton"], results["pytorch"]
    expect_close("token_logprobs: logp triton-float64", t_lp, ref_logp, 1e-4)
    expect_close("token_logprobs: entropy triton-float64", t_h, ref_entropy, 1e-4)
    expect_close("token_logprobs: logp triton-pytorch", t_lp, p_lp, 1e-4)
    expect_close("token_logprobs: entropy triton-pytorch", t_h, p_h, 1e-4)
    grad_tol = 1e-2 * p_grad.abs().max().item()  # bf16: one rounding of the same fp32 value
    expect_close("token_logprobs: grad triton-pytorch", t_grad, p_grad, grad_tol)

    hidden = torch.randn(2, tokens // 2, hidden_size, device=device).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device=device) * hidden_size**-0.5).bfloat16()
    with pytorch_only():
        hid_lp = token_logprobs_from_hidden(hidden, weight, targets, vocab_chunk=8192)
    expect_close(
        "from_hidden: logp triton-pytorch",
        token_logprobs_from_hidden(hidden, weight, targets, vocab_chunk=8192),
        hid_lp,
        1e-4,
    )
    logits = hidden @ weight.T  # rounded to bf16: the reference carries one bf16 step per logit
    bf16_tol = 2 * 2.0**-8 * logits.abs().max().item()
    expect_close(
        "from_hidden: triton-logits path", hid_lp, token_logprobs(logits, targets), bf16_tol
    )

    mask = ragged_mask(*gae_shape, device)
    rewards, values = torch.randn(gae_shape, device=device), torch.randn(gae_shape, device=device)
    with pytorch_only():
        ref_adv, ref_ret = gae(rewards.double(), values.double(), mask, 1.0, 0.95)
    adv, ret = gae(rewards, values, mask, 1.0, 0.95)
    scale = ref_adv.abs().max().item()  # the kernel runs in fp64: fp32 output rounding only
    expect_close("gae: advantages triton-float64", adv, ref_adv, 1e-6 * scale)
    expect_close("gae: returns triton-float64", ret, ref_ret, 1e-6 * scale)
    logprobs = -torch.rand(gae_shape, device=device) * 5
    ref_logprobs = logprobs + torch.randn_like(logprobs) * 0.1
    for kind in ("k1", "k2", "k3", "abs"):
        with pytorch_only():
            want = kl_penalty(logprobs.double(), ref_logprobs.double(), kind)
        expect_close(
            f"kl_penalty {kind}: triton-float64",
            kl_penalty(logprobs, ref_logprobs, kind),
            want,
            1e-6,
        )
    scores = torch.randn(gae_shape[0], device=device)
    kl = kl_penalty(logprobs, ref_logprobs)
    with pytorch_only():
        want = shaped_rewards(scores.double(), kl.double(), mask, 0.05)
    expect_close(
        "shaped_rewards: triton-float64", shaped_rewards(scores, kl, mask, 0.05), want, 1e-6
    )


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure(call, device, repeats: int | None = None) -> tuple[float, float]:
    """``(best seconds, peak extra MB)``; memory is NaN off CUDA."""
    cuda = device.type == "cuda"
    repeats = repeats or REPEATS
    call()  # warm-up: Triton compilation, cuBLAS heuristics
    peak_mb = float("nan")
    best = float("inf")
    for repeat in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
            if repeat == 0:
                peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
        best = min(best, time.perf_counter() - start)
    return best, peak_mb


def init_megatron_tp1(device) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def logprob_methods(logits, hidden, weight, targets):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def naive(z):
        return torch.log_softmax(z.float(), dim=-1).gather(-1, targets[..., None])[..., 0]

    def ours_pytorch():
        with pytorch_only():
            return token_logprobs(logits, targets)

    return {
        "naive": ([logits], lambda: naive(logits)),
        "mcore": ([logits], lambda: -vocab_parallel_cross_entropy(logits, targets)),
        "ours-triton": ([logits], lambda: token_logprobs(logits, targets)),
        "ours-pytorch": ([logits], ours_pytorch),
        "naive-hid": ([hidden, weight], lambda: naive(hidden @ weight.T)),
        "ours-hid": ([hidden, weight], lambda: token_logprobs_from_hidden(hidden, weight, targets)),
    }


def logprob_table(device, vocab: int, token_counts: list[int], hidden_size: int) -> None:
    print(f"\nlog-probs, V={vocab}, bf16, B=1, H={hidden_size} for the -hid rows")
    print(
        f"{'method':<13} {'T':>6} {'mode':<8} {'time (ms)':>10} {'peak extra (MB)':>16} {'vs naive':>9}"
    )
    for tokens in token_counts:
        logits = (torch.randn(1, tokens, vocab, device=device) * 3).bfloat16()
        hidden = torch.randn(1, tokens, hidden_size, device=device).bfloat16()
        weight = (torch.randn(vocab, hidden_size, device=device) * hidden_size**-0.5).bfloat16()
        targets = torch.randint(0, vocab, (1, tokens), device=device)
        grad_weights = torch.randn(1, tokens, device=device)
        for mode in ("fwd", "fwd+bwd"):
            naive_mb = None
            for name, (leaves, fn) in logprob_methods(logits, hidden, weight, targets).items():
                for leaf in leaves:
                    leaf.requires_grad_(mode == "fwd+bwd")

                def call(leaves=leaves, fn=fn, mode=mode, grad_weights=grad_weights):
                    for leaf in leaves:
                        leaf.grad = None
                    if mode == "fwd+bwd":
                        (fn() * grad_weights).sum().backward()
                    else:
                        with torch.no_grad():
                            fn()

                seconds, peak_mb = measure(call, device)
                naive_mb = peak_mb if name.startswith("naive") else naive_mb
                print(
                    f"{name:<13} {tokens:>6} {mode:<8} {1e3 * seconds:10.2f} {peak_mb:16.0f} "
                    f"{peak_mb / naive_mb:9.3f}",
                    flush=True,
                )
                for leaf in leaves:
                    leaf.requires_grad_(False)
                    leaf.grad = None
        del logits, hidden, weight


def gae_loop(rewards, values, mask, gamma: float, lam: float):
    """The per-token loop of TRL/OpenRLHF."""
    values, rewards = values * mask, rewards * mask
    last_gae, reversed_advantages = 0.0, []
    seq_len = rewards.shape[1]
    for t in reversed(range(seq_len)):
        next_values = values[:, t + 1] if t < seq_len - 1 else 0.0
        last_gae = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages * mask, (advantages + values) * mask


def gae_table(device, batches: list[int], token_counts: list[int]) -> None:
    print("\nGAE (gamma=1, lam=0.95), ragged right-padded masks")
    print(
        f"{'B':>4} {'T':>5} {'loop (ms)':>10} {'pytorch (ms)':>13} {'triton (ms)':>12} {'triton speedup':>15}"
    )
    for batch in batches:
        for tokens in token_counts:
            rewards = torch.randn(batch, tokens, device=device)
            values = torch.randn(batch, tokens, device=device)
            lengths = torch.randint(1, tokens + 1, (batch,), device=device)
            mask = (torch.arange(tokens, device=device) < lengths[:, None]).float()
            inputs = (rewards, values, mask, 1.0, 0.95)
            loop_s, _ = measure(lambda inputs=inputs: gae_loop(*inputs), device, repeats=1)

            def vectorised(inputs=inputs):
                with pytorch_only():
                    return gae(*inputs)

            torch_s, _ = measure(vectorised, device)
            triton_s, _ = measure(lambda inputs=inputs: gae(*inputs), device)
            print(
                f"{batch:>4} {tokens:>5} {1e3 * loop_s:10.2f} {1e3 * torch_s:13.3f} "
                f"{1e3 * triton_s:12.3f} {loop_s / triton_s:14.0f}x",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--hidden", type=int, default=4096, help="H of the -hid rows (BLOOM-7b1)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter")
    args = parser.parse_args(argv)
    from megatron_rlhf.kernels import _dispatch

    if args.smoke:
        if not (_dispatch.HAVE_TRITON and _dispatch.INTERPRET):
            print("--smoke needs triton and TRITON_INTERPRET=1 in the environment")
            return 2
        device, vocab, tokens, hidden_size, batches, gae_tokens = (
            torch.device("cpu"),
            500,
            [16],
            32,
            [3],
            [40],
        )
        check_tokens = 16
        global REPEATS
        REPEATS = 1
    else:
        if not torch.cuda.is_available() or not _dispatch.HAVE_TRITON:
            print("gpu_kernels.py needs a CUDA GPU and triton (pip install triton); none found.")
            return 2
        device, vocab, tokens, hidden_size = torch.device("cuda"), VOCAB, args.tokens, args.hidden
        batches, gae_tokens, check_tokens = [64, 256], [1024, 2048], 1024
        torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 matmuls in the GAE reference
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.manual_seed(0)
    try:
        check_agreement(device, vocab, check_tokens, hidden_size, (batches[0] + 1, gae_tokens[-1]))
    except Mismatch as err:
        print(f"Triton and the reference disagree on {err}: no timing is reported.")
        return 1
    init_megatron_tp1(device)
    logprob_table(device, vocab, tokens, hidden_size)
    gae_table(device, batches, gae_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
