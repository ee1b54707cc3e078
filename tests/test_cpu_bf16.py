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


def _logit_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest error of the real vocabulary's logits relative to their largest magnitude
    (the padded vocabulary's rows hold the dtype's lowest value, which differs by dtype)."""
    real = reference > torch.finfo(torch.float32).min / 2
    assert real.any() and not real.all()
    gap = (logits.double() - reference).abs()[real].max()
    return float(gap / reference.abs()[real].max())


def test_a_marked_models_logits_are_the_fp32_logits_to_bf16_rounding(hf_dir):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.precision import compute_precision, mark_cpu_bf16, params_dtype

    assert params_dtype(True) == params_dtype(False) == torch.float32  # this machine: no GPU
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 4, 7], seed=8)
    with torch.no_grad():
        reference = load_bloom(hf_dir).eval()(ids, mask).double()
        marked = mark_cpu_bf16(load_bloom(hf_dir), True).eval()
        autocast = marked(ids, mask)  # its forward is a region of its own
        with compute_precision(marked):
            assert torch.is_autocast_enabled("cpu")
            assert torch.equal(marked(ids, mask), autocast)
        unmarked = load_bloom(hf_dir).eval()(ids, mask)
    assert autocast.dtype == torch.bfloat16 and unmarked.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    error = _logit_error(autocast, reference)
    assert 1e-4 < error < 3e-2, error
    assert _logit_error(unmarked, reference) < 1e-5
    with compute_precision(load_bloom(hf_dir)):  # an unmarked model: no region
        assert not torch.is_autocast_enabled("cpu")


def test_the_lm_heads_bf16_weight_gradient_lands_in_main_grad_slice_by_slice(monkeypatch):
    """The tied LM head's weight gradient under CPU autocast: bf16 products a vocabulary slice
    at a time into the fp32 ``main_grad`` (models/bloom/vocab.py), the last slice short, on top
    of what the buffer already held; against float64."""
    from megatron_rlhf.models.bloom import vocab

    monkeypatch.setattr(vocab, "VOCAB_SLICE", 64)
    generator = torch.Generator().manual_seed(3)
    vocab_size, hidden_size, tokens = 64 * 3 + 5, 24, 7
    weight = torch.randn(vocab_size, hidden_size, generator=generator).requires_grad_()
    weight.main_grad = torch.randn(vocab_size, hidden_size, generator=generator)
    held = weight.main_grad.clone()
    hidden = torch.randn(1, tokens, hidden_size, generator=generator).requires_grad_()
    upstream = torch.randn(1, tokens, vocab_size, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = vocab.linear(hidden, weight)
        assert logits.dtype == torch.bfloat16
        logits.backward(upstream)
    assert weight.grad is None  # nothing for DDP to add: it went into main_grad
    expected = held.double() + upstream[0].double().t() @ hidden[0].detach().double()
    scale = float((expected - held.double()).abs().max())
    error = float((weight.main_grad.double() - expected).abs().max()) / scale
    assert 1e-5 < error < 2e-2, error  # bf16 products, in every slice, the short one too
    reference = upstream.double() @ weight.detach().double()
    input_error = float((hidden.grad.double() - reference).abs().max() / reference.abs().max())
    assert input_error < 2e-2, input_error


def test_the_kept_bf16_copy_follows_every_write_a_region_can_miss():
    """``bf16_copy`` (models/precision.py): one bf16 buffer per weight, reused inside a region;
    a trained weight's is refreshed in every new region (a write through ``.data``, as the
    rollout weight sync and the distributed optimizer make, moves no version counter), a frozen
    model's only after a tracked write (a load); outside a region of ours, the weight itself."""
    from megatron_rlhf.models.precision import FROZEN, bf16_copy, compute_precision, mark_cpu_bf16

    generator = torch.Generator().manual_seed(5)
    trained = torch.nn.Linear(12, 40, bias=False)
    frozen = torch.nn.Linear(12, 40, bias=False)
    mark_cpu_bf16(trained, True)
    mark_cpu_bf16(frozen, True, frozen=True)
    assert getattr(frozen.weight, FROZEN) and not hasattr(trained.weight, FROZEN)
    assert bf16_copy(trained.weight) is trained.weight  # no region
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a region this module did not open
        assert bf16_copy(trained.weight) is trained.weight
    for module in (trained, frozen):
        with compute_precision(module):
            first = bf16_copy(module.weight)
            assert first.dtype == torch.bfloat16 and bf16_copy(module.weight) is first
            assert torch.equal(first, module.weight.detach().bfloat16())
        module.weight.data.copy_(torch.randn(40, 12, generator=generator))  # untracked
        with compute_precision(module):
            again = bf16_copy(module.weight)
            assert again is first  # the same buffer, refreshed in place or not
            fresh = torch.equal(again, module.weight.detach().bfloat16())
        assert fresh == (module is trained)  # a frozen model's weights are never written so
        with torch.no_grad():
            module.weight.copy_(torch.randn(40, 12, generator=generator))  # a load: tracked
        with compute_precision(module):
            assert torch.equal(bf16_copy(module.weight), module.weight.detach().bfloat16())


def test_a_trained_models_logits_follow_its_weights_from_region_to_region(hf_dir):
    """The LM head's kept bf16 copy through a model: each forward of a marked model is a
    region, so after the weights change (here through ``.data``) its logits are those of the
    new weights to bf16 rounding, in training mode without grad (scoring) and in eval."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.precision import mark_cpu_bf16

    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 4, 7], seed=8)
    marked = mark_cpu_bf16(load_bloom(hf_dir), True)
    plain = load_bloom(hf_dir)
    with torch.no_grad():
        before = marked(ids, mask)
        for model in (marked, plain):
            head = model.output_layer.weight if model.output_layer.weight is not None else None
            head = head if head is not None else model.embedding.word_embeddings.weight
            head.data.mul_(1.5)
        reference = plain.eval()(ids, mask).double()
        for mode in (True, False):
            assert _logit_error(marked.train(mode)(ids, mask), reference) < 3e-2
        assert _logit_error(before, reference) > 0.1
