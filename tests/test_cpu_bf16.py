"""bf16 on the CPU (models/precision.py): fp32 master weights, bf16 products under autocast.

Against the fp32 step (itself equal to float64 to ~1e-6, test_bloom_units.py), one training
step of a marked model stays within bf16's rounding (relative gradient error a few 1e-3) and
differs from it by more than fp32's (so the products did run in bf16), through both of our
vocabulary paths (the gradient into ``main_grad``) and Megatron-Core's own layers; the weights
stay fp32; a marked model's logits agree with fp32's to bf16 rounding, in every region.
"""

from __future__ import annotations

import pytest
import torch
from dist_bloom_common import ARCH_A, left_padded_batch, save_hf_bloom
from test_bloom_units import regression_step, single_process  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_bloom_bf16")
    save_hf_bloom(directory, ARCH_A, seed=0)
    return directory


def _step(hf_dir, head: str, bf16: bool, fused: bool):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.vocab import OPT_IN
    from megatron_rlhf.models.precision import mark_cpu_bf16
    from megatron_rlhf.training import OptimConfig, TrainEngine

    microbatches, loss_fn = regression_step(head)
    model = mark_cpu_bf16(load_bloom(hf_dir, head=head), bf16)
    engine = TrainEngine(model, OptimConfig(lr=1e-3, warmup_fraction=0.0), total_steps=2)
    if not fused:
        for param in model.parameters():
            setattr(param, OPT_IN, False)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = engine.step(microbatches, loss_fn)
    moves = {n: p.detach() - initial[n] for n, p in model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights
    return metrics, moves


@pytest.mark.parametrize("head,fused", [("lm", True), ("lm", False), ("scalar", True)])
def test_a_bf16_step_on_the_cpu_is_the_fp32_step_to_bf16_rounding(hf_dir, head, fused):
    fp32, fp32_moves = _step(hf_dir, head, bf16=False, fused=fused)
    bf16, bf16_moves = _step(hf_dir, head, bf16=True, fused=fused)
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2)
    gap = abs(bf16["grad_norm"] - fp32["grad_norm"]) / fp32["grad_norm"]
    assert 1e-5 < gap < 2e-2, gap  # bf16 products, not fp32's, and within their rounding
    # Adam's first step moves each weight by ~lr * sign(grad): compare the moves as a whole
    num = sum((bf16_moves[n] - m).pow(2).sum() for n, m in fp32_moves.items())
    den = sum(m.pow(2).sum() for m in fp32_moves.values())
    assert float((num / den).sqrt()) < 0.2


def test_a_marked_models_logits_are_the_fp32_logits_to_bf16_rounding(hf_dir):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.precision import compute_precision, mark_cpu_bf16, params_dtype

    assert params_dtype(True) == params_dtype(False) == torch.float32  # this machine: no GPU
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 4, 7], seed=8)
    with torch.no_grad():
        reference = load_bloom(hf_dir).eval()(ids, mask).double()
        scale = reference.abs().max()
        marked = mark_cpu_bf16(load_bloom(hf_dir), True).eval()
        autocast = marked(ids, mask)  # its forward is a region of its own
        with compute_precision(marked):
            assert torch.is_autocast_enabled("cpu")
            assert torch.equal(marked(ids, mask), autocast)
        unmarked = load_bloom(hf_dir).eval()(ids, mask)
    assert autocast.dtype == torch.bfloat16 and unmarked.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    error = float((autocast.double() - reference).abs().max() / scale)
    assert 1e-4 < error < 3e-2, error
    assert float((unmarked.double() - reference).abs().max() / scale) < 1e-5
    with compute_precision(load_bloom(hf_dir)):  # an unmarked model: no region
        assert not torch.is_autocast_enabled("cpu")
