"""Checks that need a CUDA GPU (``pytest -m gpu``; ``benchmarks/gpu_check.py`` runs them).

Collected everywhere, skipped without a GPU; the default ``pytest -q`` deselects them
(``-m 'not gpu'`` in pyproject.toml). On a GPU a missing Triton fails (it is imported, not
``importorskip``-ed); a missing TransformerEngine (the bare CUDA image this project is lent has
none) skips test 1 with a reason that starts "not on this machine", and
``benchmarks/gpu_check.py`` counts every other skip as a failure.
Models reach the GPU by themselves (no ``.cuda()`` here: that would hide a CPU-built tensor).
Tolerances are in units of bf16 resolution (2**-8 of the compared scale). Each compares the GPU
path against an independent one:
1. TransformerEngine's fused ALiBi attention and our PyTorch core attention, both in bf16,
   against the same attention in fp32; right-padded ragged rows.
2. The Triton kernels against their PyTorch paths on the same GPU tensors (log-probs and
   entropy with gradients at a vocabulary that is not a multiple of the block; GAE).
3. The distributed optimizer (TrainEngine's GPU optimizer): a run saved after two steps and
   resumed gives the uninterrupted run's third step exactly.
4. bf16 BLOOM logits against transformers' ``BloomForCausalLM`` in fp32 on the same GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def single_gpu():
    """Megatron-Core parallel state at world size 1 on cuda:0."""
    import torch.distributed as dist

    from megatron_rlhf.distributed import destroy, initialize

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    initialize()
    yield
    destroy()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    """Megatron's boolean mask (B, 1, S, S), True = masked, for right-padded rows."""
    from megatron_rlhf.models.bloom.model import attention_mask_for

    valid = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        valid[row, :length] = 1
    return attention_mask_for(valid, width).cuda()


BF16_EPS = 2.0**-8


NOT_ON_THIS_MACHINE = "not on this machine"


def test_te_alibi_attention_matches_fp32(single_gpu):
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip(f"{NOT_ON_THIS_MACHINE}: transformer-engine is not installed")
    import transformer_engine.pytorch  # noqa: F401  (installed but broken fails)

    from megatron_rlhf.models.bloom.alibi import positions_from_mask
    from megatron_rlhf.models.bloom.attention import (
        AlibiDotProductAttention,
        TEAlibiDotProductAttention,
    )
    from megatron_rlhf.models.bloom.config import BloomArchitecture, transformer_config

    arch = BloomArchitecture(vocab_size=1024, hidden_size=12 * 64, num_layers=1, num_heads=12)
    config = transformer_config(arch, tp=1, pp=1, params_dtype=torch.bfloat16)
    with torch.device("cuda"):
        fused = TEAlibiDotProductAttention(config, 1, None, "self")
        local = AlibiDotProductAttention(config, 1, None, "self")
    generator = torch.Generator(device="cuda").manual_seed(0)
    seq, lengths = 96, [96, 71, 40, 1]
    q, k, v = (
        torch.randn(seq, len(lengths), 12, 64, device="cuda", generator=generator) for _ in range(3)
    )
    mask = _right_padded_mask(lengths, seq)
    key_positions = positions_from_mask(~mask[:, 0, -1, :]).float()  # (B, S)
    want = local(q, k, v, mask, attention_bias=key_positions)  # fp32 inputs: the reference
    bf16 = [t.bfloat16() for t in (q, k, v)]
    got_te = fused(*bf16, mask).float()  # no key positions: TE's fused ALiBi
    got_local = local(*bf16, mask, attention_bias=key_positions).float()
    for row, length in enumerate(lengths):
        scale = want[:length, row].abs().max().item()
        for name, got in (("te", got_te), ("pytorch", got_local)):
            diff = (got[:length, row] - want[:length, row]).abs().max().item()
            assert diff <= 4 * BF16_EPS * scale, (name, row, diff, scale)


def test_triton_logprobs_and_gae_match_pytorch():
    import triton  # noqa: F401  (missing Triton fails)
    from megatron_rlhf.kernels import _dispatch, gae, pytorch_only, token_logprobs

    assert _dispatch.triton_launches(), "Triton is installed but cannot launch a kernel"
    generator = torch.Generator(device="cuda").manual_seed(1)
    batch, seq, vocab = 3, 77, 50_257  # not a multiple of any block size
    logits = torch.randn(batch, seq, vocab, device="cuda", generator=generator) * 3
    logits = logits.bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), device="cuda", generator=generator)
    weights = torch.randn(batch, seq, device="cuda", generator=generator)

    def run():
        logprobs, entropy = token_logprobs(logits, targets, 0.7, return_entropy=True)
        (grad,) = torch.autograd.grad((logprobs * weights).sum() + entropy.sum(), logits)
        return logprobs, entropy, grad.float()

    triton_out = run()
    with pytorch_only():
        torch_out = run()
    for name, got, want in zip(("logprobs", "entropy", "grad"), triton_out, torch_out):
        # fp32 statistics from bf16 logits: a few bf16 steps of the largest value compared
        tolerance = 2 * BF16_EPS * want.abs().max().item()
        assert (got - want).abs().max().item() <= tolerance, name

    rewards = torch.randn(64, 1000, device="cuda", generator=generator)
    values = torch.randn(64, 1000, device="cuda", generator=generator)
    lengths = torch.randint(0, 1001, (64,), device="cuda", generator=generator)
    mask = (torch.arange(1000, device="cuda")[None] < lengths[:, None]).float()
    triton_adv, triton_ret = gae(rewards, values, mask, 1.0, 0.95)
    with pytorch_only():
        torch_adv, torch_ret = gae(rewards, values, mask, 1.0, 0.95)
    assert (triton_adv - torch_adv).abs().max().item() < 1e-3
    assert (triton_ret - torch_ret).abs().max().item() < 1e-3


def _engine(arch, seed: int):
    from megatron.core import tensor_parallel

    from megatron_rlhf.models.bloom.model import BloomModel
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.config import OptimConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = BloomModel(arch, head="scalar", params_dtype=torch.bfloat16)  # on cuda:0 by itself
    assert all(p.is_cuda for p in model.parameters())
    engine = TrainEngine(model, OptimConfig(lr=1e-3, warmup_fraction=0.0), total_steps=10)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    assert all(isinstance(optimizer, DistributedOptimizer) for optimizer in optimizers)
    return engine


def _batch(step: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(4, vocab, (4, 32), generator=generator)
    return [{"input_ids": ids, "padding_mask": torch.ones_like(ids)}]


def _loss(output, microbatch):
    return output[..., 0].float().pow(2).mean(), {}


def test_distributed_optimizer_resume_is_exact(single_gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # bitwise-repeatable steps
    try:
        _resume_is_exact(tmp_path)
    finally:  # the tests after this one run in the default mode
        torch.use_deterministic_algorithms(False)


def _resume_is_exact(tmp_path):
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.training.checkpointing import (
        load_training_checkpoint,
        save_training_checkpoint,
    )

    arch = BloomArchitecture(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4)
    straight = _engine(arch, seed=0)
    for step in range(2):
        straight.step(_batch(step, arch.vocab_size), _loss)
    save_training_checkpoint(tmp_path, 2, {"model": straight}, {"test": True}, {"step": 2})
    before = [p.detach().clone() for p in straight.module.parameters()]
    want = straight.step(_batch(2, arch.vocab_size), _loss)
    moved = max((a - b).abs().max().item() for a, b in zip(straight.module.parameters(), before))
    assert moved > 5e-4  # the compared step really updates the weights

    resumed = _engine(arch, seed=1)  # different init: everything must come from the checkpoint
    state = load_training_checkpoint(tmp_path / "step_0000002", {"model": resumed})
    assert state == {"step": 2}
    got = resumed.step(_batch(2, arch.vocab_size), _loss)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for (name, a), b in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(a, b), name


def test_bf16_bloom_logits_match_transformers(single_gpu, tmp_path):
    from transformers import BloomForCausalLM

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    arch = BloomArchitecture(vocab_size=1000, hidden_size=256, num_layers=4, num_heads=8)
    random_hf_bloom(arch, seed=0, init_std=0.1).to(torch.bfloat16).save_pretrained(tmp_path)
    # fp32 reference (transformers in bf16 adds the absolute ALiBi bias in bf16: not a reference)
    reference = BloomForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).cuda().eval()
    ours = load_bloom(tmp_path, params_dtype=torch.bfloat16).eval()  # no .cuda(): it loads there
    generator = torch.Generator().manual_seed(2)
    lengths = [48, 30, 7, 1]
    ids = torch.randint(4, arch.vocab_size, (4, 48), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):  # left-padded, as generation feeds them
        mask[row, 48 - length :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits.float()
        got = ours(ids, mask)[..., : arch.vocab_size].float()
    real = mask.bool()
    assert want[real].abs().max() > 1.0
    # bf16 weights and activations through 4 layers: a few bf16 steps of the logit scale (3.7
    # measured with this model on the CPU)
    assert (got - want)[real].abs().max().item() <= 8 * BF16_EPS * want[real].abs().max().item()
    assert (got[real].argmax(-1) == want[real].argmax(-1)).float().mean() > 0.95
