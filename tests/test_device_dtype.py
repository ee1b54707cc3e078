"""Device and dtype discipline, bf16 ALiBi numerics and TransformerEngine checkpoints, on the CPU.

The GPU path cannot run here, so what it depends on is proven another way:
- **Device**: ``compute_device()`` is pointed at the ``meta`` device and every model kind is built
  through the real constructor and the HF loader, then run forward and through its trainer's
  loss with inputs on ``meta``. (torch's distributed checkpoint cannot load into meta tensors; a
  Megatron checkpoint loads into the tensors this same constructor made, on their device, and
  ``benchmarks/gpu_check.py`` loads one on a GPU.) A parameter or buffer created on the CPU, or a CPU
  tensor made inside ``forward``, lands beside meta tensors and fails (the GPU's device
  mismatch, without a GPU).
- **dtype**: a bf16 model holds bf16 parameters only; the fp32 tensors are the ALiBi slopes.
- **ALiBi in bf16**: against float64 transformers, the logit error at 1,024 tokens stays within
  3x the error at 64 tokens (absolute-position biases in bf16 gave 8x: 3.4 against 0.4).
- **TE's ``_extra_state``**: a stand-in for TE's ``DotProductAttention`` carrying extra state, built
  through :class:`TEAlibiDotProductAttention`, saves and strictly reloads through ``load_bloom``.
"""

from __future__ import annotations

import pytest
import torch
from dist_bloom_common import ARCH_A, ARCH_B, left_padded_batch, save_hf_bloom
from test_bloom_units import single_process  # noqa: F401  (module-scoped fixture)

from megatron_rlhf.models.bloom.config import BloomArchitecture

META = torch.device("meta")
pytestmark = pytest.mark.usefixtures("single_process")  # Megatron-Core state at world size 1


@pytest.fixture
def on_meta(monkeypatch):
    """Every model built while this is active goes to the compute device ``meta``."""
    import megatron_rlhf.models.bloom.model as model_module

    monkeypatch.setattr(model_module, "compute_device", lambda: META)


def _placement(model) -> dict[str, tuple[torch.device, torch.dtype]]:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return {name: (tensor.device, tensor.dtype) for name, tensor in tensors}


def _forward_and_loss(model, head: str, num_scalar_outputs: int) -> torch.Tensor:
    """One forward on meta inputs (left-padded shape) and the loss its trainer takes."""
    from megatron_rlhf.ppo.scoring import response_logprobs
    from megatron_rlhf.reward.losses import advantage_model_loss, bradley_terry_loss
    from megatron_rlhf.reward.model import advantage_scores

    ids = torch.randint(4, ARCH_A.vocab_size, (4, 9), device=META)
    mask = torch.ones(4, 9, dtype=torch.long, device=META)
    output = model(ids, mask)
    assert output.device == META
    if head == "lm":
        logprobs = response_logprobs(output, ids, prompt_length=5, response_length=4, tp_group=None)
        return -logprobs.mean()
    # Rows are unpadded: r at the last token, e_tau at the last prompt token (read_scalars'
    # checks of the mask need data, which meta tensors do not have).
    rewards = output[:, -1, 0]
    if num_scalar_outputs == 1:
        return bradley_terry_loss(rewards[:2], rewards[2:])[0]
    scores = advantage_scores(rewards, output[:, 4, 1])
    return advantage_model_loss(scores[:2], scores[2:])[0]


@pytest.mark.parametrize(
    "head, outputs, source",
    [
        ("lm", 1, "constructor"),  # actor, reference
        ("lm", 1, "hf"),
        ("scalar", 1, "constructor"),  # reward model, critic
        ("scalar", 2, "constructor"),  # advantage model (r, e_tau)
        ("scalar", 2, "hf"),  # from an HF trunk (train-reward's start)
    ],
)
def test_every_model_kind_builds_runs_and_trains_on_the_compute_device(
    tmp_path, monkeypatch, head, outputs, source
):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom import BloomModel

    if source == "hf":
        save_hf_bloom(tmp_path / "hf", ARCH_A)
    import megatron_rlhf.models.bloom.model as model_module

    monkeypatch.setattr(model_module, "compute_device", lambda: META)
    if source == "constructor":
        model = BloomModel(ARCH_A, head=head, num_scalar_outputs=outputs)
    else:
        model = load_bloom(tmp_path / "hf", head=head, num_scalar_outputs=outputs)
    off_device = {name: d for name, (d, _) in _placement(model).items() if d != META}
    assert not off_device, off_device
    loss = _forward_and_loss(model, head, outputs)
    loss.backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_forward_refuses_inputs_on_another_device(on_meta):
    from megatron_rlhf.models.bloom import BloomModel

    model = BloomModel(ARCH_A)
    ids = torch.randint(4, ARCH_A.vocab_size, (2, 5))  # on the CPU
    with pytest.raises(ValueError, match="input_ids is on cpu, the model on meta"):
        model(ids, torch.ones_like(ids))


@pytest.mark.parametrize("head", ["lm", "scalar"])
def test_bf16_model_is_bf16_except_the_alibi_slopes(tmp_path, head):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom import BloomModel

    save_hf_bloom(tmp_path, ARCH_B)
    for model in (
        BloomModel(ARCH_B, head=head, num_scalar_outputs=2, params_dtype=torch.bfloat16),
        load_bloom(tmp_path, head=head, num_scalar_outputs=2, params_dtype=torch.bfloat16),
    ):
        not_bf16 = {n for n, (_, dtype) in _placement(model).items() if dtype != torch.bfloat16}
        buffers = model.named_buffers(remove_duplicate=False)
        slopes = {n for n, _ in buffers if n.endswith("core_attention.slopes")}
        assert len(slopes) == ARCH_B.num_layers
        assert len({id(model.get_buffer(name)) for name in slopes}) == 1  # shared by the layers
        assert not_bf16 and not_bf16 <= slopes, not_bf16 - slopes
        assert all(model.get_buffer(name).dtype == torch.float32 for name in slopes)


def _max_bf16_logit_error(ours, reference, lengths: list[int], seed: int) -> float:
    """Max |bf16 logits - float64 transformers| over the real tokens of a left-padded batch;
    the reference runs each row alone (transformers' float64 left padding gives NaN rows)."""
    vocab = ours.arch.vocab_size
    ids, mask = left_padded_batch(vocab, lengths, seed=seed)
    with torch.no_grad():
        logits = ours(ids, mask)[..., :vocab].double()  # (B, S, V)
        errors = []
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            expected = reference(input_ids=ids[row][real][None]).logits[0]  # (L, V) float64
            errors.append((logits[row][real] - expected).abs().max().item())
    return max(errors)


def test_bf16_alibi_error_does_not_grow_with_length(tmp_path):
    from transformers import BloomForCausalLM

    from megatron_rlhf.checkpoint import load_bloom

    # 16 heads: the steepest slope is 2**-0.5, as in BLOOM-560m.
    arch = BloomArchitecture(
        vocab_size=256, hidden_size=128, num_layers=2, num_heads=16, max_sequence_length=1024
    )
    save_hf_bloom(tmp_path, arch, seed=5)
    reference = BloomForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    ours = load_bloom(tmp_path, params_dtype=torch.bfloat16).eval()
    short = _max_bf16_logit_error(ours, reference, [64, 41], seed=1)
    long = _max_bf16_logit_error(ours, reference, [1024, 1000], seed=2)
    assert 0 < short < 1.0, short  # bf16 weights and activations, not a broken model
    assert long <= 3 * short, (short, long)


def test_fp32_attention_matches_the_absolute_alibi_of_transformers():
    """The query-relative bias gives transformers' probabilities (softmax is shift-invariant):
    fp32 against an fp64 brute force of ``softmax(q.k/sqrt(d) + slope*pos_k)``, ragged rows."""
    from megatron_rlhf.models.bloom.alibi import alibi_slopes, positions_from_mask
    from megatron_rlhf.models.bloom.attention import alibi_attention
    from megatron_rlhf.models.bloom.model import attention_mask_for

    generator = torch.Generator().manual_seed(0)
    heads, dim = 6, 8
    _ids, key_valid = left_padded_batch(50, [11, 4, 9], seed=7)
    for query_length in (11, 1):  # a full forward and one decode step with a KV cache
        q, k, v = (
            torch.randn(s, 3, heads, dim, generator=generator, dtype=torch.float64)
            for s in (query_length, 11, 11)
        )
        positions = positions_from_mask(key_valid).double()
        mask = attention_mask_for(key_valid, query_length)  # (B, 1, Sq, Sk)
        slopes = alibi_slopes(heads).double()
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / dim**0.5
        scores = scores + slopes[None, :, None, None] * positions[:, None, None, :]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1).nan_to_num()
        expected = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(query_length, 3, -1)
        ours = alibi_attention(
            q.float(), k.float(), v.float(), mask, positions.float(), slopes.float(), dim**-0.5
        )
        real_queries = key_valid[:, 11 - query_length :].bool().T  # (Sq, B)
        diff = (ours.double() - expected)[real_queries].abs().max().item()
        assert diff < 1e-5, (query_length, diff)


class _ExtraStateAttention(torch.nn.Module):
    """Stands in for TE's DotProductAttention: no weights, a ``_extra_state`` in its state_dict
    (TE's FP8 metadata), and the constructor arguments TE takes."""

    def __init__(self, num_attention_heads, kv_channels, **kwargs):
        super().__init__()
        self.loaded_extra_state = None

    def get_extra_state(self):
        return torch.tensor([1.0])

    def set_extra_state(self, state):
        self.loaded_extra_state = state


def test_te_extra_state_does_not_break_strict_loads(tmp_path, monkeypatch):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom import attention as attention_module
    from megatron_rlhf.models.bloom import spec as spec_module

    for module in (attention_module, spec_module):
        monkeypatch.setattr(module, "te_attention_class", lambda: _ExtraStateAttention)
    saved = BloomModel(ARCH_A, use_te_attention=True)
    extra = [name for name in saved.state_dict() if name.endswith("te_attention._extra_state")]
    assert len(extra) == ARCH_A.num_layers, extra  # the hazard is present
    from megatron_rlhf.checkpoint import dist as dist_ckpt

    dist_ckpt.save(tmp_path / "ckpt", saved.sharded_state_dict(), dist_ckpt.model_metadata(saved))
    loaded = load_bloom(tmp_path / "ckpt", use_te_attention=True)  # strict load_state_dict
    for name, tensor in saved.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(loaded.state_dict()[name], tensor), name
    # Other missing keys are still reported: the hook drops only `_extra_state`.
    state = {k: v for k, v in saved.state_dict().items() if k not in extra}
    state.pop("decoder.final_layernorm.bias")
    with pytest.raises(RuntimeError, match="decoder.final_layernorm.bias"):
        loaded.load_state_dict(state)


def test_te_alibi_cache_is_refreshed_when_another_models_slopes_are_in_it(monkeypatch):
    """TE keeps one process-wide ALiBi cache (slopes and its (B, H, S, S) bias) and refreshes it
    only in its layer 1: a second model with as many heads per rank (or a later pipeline stage)
    would reuse the first one's slopes. Our TE wrapper forces the refresh whenever the cached
    slopes are not its own, and every layer of one model shares one slopes tensor, so a forward
    refreshes the cache once (in its first layer), not once per layer."""
    import sys
    import types

    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom import attention as attention_module
    from megatron_rlhf.models.bloom import spec as spec_module
    from megatron_rlhf.models.bloom.config import transformer_config
    from megatron_rlhf.models.bloom.model import attention_mask_for

    te_module = types.ModuleType("fake_transformer_engine_attention")
    te_module._alibi_cache = {
        "_alibi_slopes": None,
        "_alibi_slopes_require_update": False,
        "_alibi_bias_require_update": False,
    }
    seen = []

    class FakeTEAttention(torch.nn.Module):  # what TE does with the cache, nothing more
        def __init__(self, num_attention_heads, kv_channels, layer_number, **kwargs):
            super().__init__()
            self.layer_number = layer_number

        def forward(self, query, key, value, attention_mask, alibi_slopes, **kwargs):
            cache = te_module._alibi_cache
            if self.layer_number == 1:
                cache["_alibi_slopes_require_update"] = True
            seen.append(bool(cache["_alibi_slopes_require_update"]))
            if cache["_alibi_slopes_require_update"]:
                cache["_alibi_slopes"] = alibi_slopes
                cache["_alibi_slopes_require_update"] = False
            return query.flatten(2)

    FakeTEAttention.__module__ = te_module.__name__
    monkeypatch.setitem(sys.modules, te_module.__name__, te_module)
    monkeypatch.setattr(attention_module, "te_attention_class", lambda: FakeTEAttention)
    monkeypatch.setattr(spec_module, "te_attention_class", lambda: FakeTEAttention)
    config = transformer_config(ARCH_A, tp=1, pp=1)
    first, second = (
        attention_module.TEAlibiDotProductAttention(config, 2, None, "self") for _ in range(2)
    )  # layer 2: TE itself would never refresh
    second.slopes = second.slopes * 0.5  # another model's slopes, same head count
    q = torch.randn(5, 2, ARCH_A.num_heads, 8)
    mask = attention_mask_for(torch.ones(2, 5), 5)
    for module in (first, first, second, second, first):
        module(q, q, q, mask)
    assert seen == [True, False, True, False, True]
    assert te_module._alibi_cache["_alibi_slopes"] is first.slopes

    # whole models: one slopes tensor per model, one refresh per forward (layer 1), not per layer
    models = [BloomModel(ARCH_A, attention_backend="te") for _ in range(2)]
    for model in models:
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        assert all(core.slopes is cores[0].slopes for core in cores)
    ids = torch.randint(4, ARCH_A.vocab_size, (2, 6))
    right_padded = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    seen.clear()
    for model in (models[0], models[1], models[0]):
        with torch.no_grad():
            model(ids, right_padded)
    assert seen == ([True] + [False] * (ARCH_A.num_layers - 1)) * 3
    assert (
        te_module._alibi_cache["_alibi_slopes"]
        is models[0].decoder.layers[0].self_attention.core_attention.slopes
    )


def _recording_optimizers(engine, calls: list) -> None:
    """Record the keyword arguments each inner Megatron optimizer's ``sharded_state_dict``
    receives (the distributed optimizer on a GPU, the FP32 one here)."""
    for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        real = inner.sharded_state_dict

        def recorded(model_state, is_loading=False, _real=real, **kwargs):
            calls.append((is_loading, kwargs.get("metadata")))
            return _real(model_state, is_loading, **kwargs)

        inner.sharded_state_dict = recorded


@pytest.mark.parametrize("saved_as", ["fully_reshardable", "dp_reshardable"])
def test_training_checkpoints_pass_the_distributed_optimizer_a_format_it_can_save(
    tmp_path, saved_as
):
    """Without ``distrib_optim_sharding_type`` Megatron-Core 0.16.1's distributed optimizer (GPU
    only) builds ``fully_sharded_model_space`` tensors that its own validation refuses
    ("ShardedTensor.flattened_range is not supported"): every GPU save raised. The format is
    passed on save and on load, recorded in the checkpoint, and a resume reads the recorded one
    whatever the resuming run is configured with."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.checkpointing import (
        OPTIMIZER_SHARDING_KEY,
        load_training_checkpoint,
        save_training_checkpoint,
    )
    from megatron_rlhf.training.config import OPTIMIZER_CHECKPOINT_SHARDINGS, OptimConfig

    assert "fully_sharded_model_space" not in OPTIMIZER_CHECKPOINT_SHARDINGS
    assert set(OPTIMIZER_CHECKPOINT_SHARDINGS) <= {
        "fully_reshardable",
        "dp_reshardable",
    }  # the formats DistributedOptimizer.sharded_state_dict builds without flattened_range
    assert hasattr(DistributedOptimizer, "load_parameter_state_from_fully_reshardable")
    assert hasattr(DistributedOptimizer, "load_parameter_state_from_dp_reshardable")
    torch.manual_seed(0)
    saver = TrainEngine(
        BloomModel(ARCH_A, head="scalar"), OptimConfig(checkpoint_sharding=saved_as), 2
    )
    ids = torch.randint(4, ARCH_A.vocab_size, (2, 7))
    batch = [{"input_ids": ids, "padding_mask": torch.ones_like(ids)}]
    saver.step(batch, lambda output, mb: (output.float().pow(2).mean(), {}))  # Adam state exists
    saved_calls, loaded_calls = [], []
    _recording_optimizers(saver, saved_calls)
    save_training_checkpoint(
        tmp_path, 1, {"critic": saver}, dist_ckpt.model_metadata(saver.module), {}
    )
    assert saved_calls == [(False, {"distrib_optim_sharding_type": saved_as})]
    step = tmp_path / "step_0000001"
    assert dist_ckpt.read_metadata(step)[OPTIMIZER_SHARDING_KEY] == {"critic": saved_as}

    other = "dp_reshardable" if saved_as == "fully_reshardable" else "fully_reshardable"
    loader = TrainEngine(
        BloomModel(ARCH_A, head="scalar"), OptimConfig(checkpoint_sharding=other), 2
    )
    _recording_optimizers(loader, loaded_calls)
    load_training_checkpoint(step, {"critic": loader})
    assert loaded_calls == [(True, {"distrib_optim_sharding_type": saved_as})]
    for a, b in zip(saver.module.parameters(), loader.module.parameters()):
        assert torch.equal(a, b)


def test_optimizer_checkpoint_sharding_is_validated():
    from megatron_rlhf.training.config import OptimConfig, optim_problems

    assert optim_problems(OptimConfig(), "train.optim") == []
    problems = optim_problems(OptimConfig(checkpoint_sharding="fully_sharded_model_space"), "x")
    assert problems == [
        "x.checkpoint_sharding='fully_sharded_model_space' must be one of fully_reshardable, "
        "dp_reshardable"
    ]


def test_vllm_replicas_agree_on_calls_with_a_tensor_on_the_collective_device(monkeypatch):
    """vLLM with rollout DP > 1 on NCCL all-reduced a CPU tensor ("No backend type associated
    with device type cpu"). The tensor must be on the collective's device: pointed at ``meta``
    here, a CPU tensor is caught."""
    import megatron_rlhf.distributed.parallel as parallel
    from megatron_rlhf.generation.rollout_engines import VLLMRolloutEngine

    class Stop(Exception):
        pass

    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device, group))
        raise Stop

    class TwoRanks:
        def size(self):
            return 2

    dp = TwoRanks()
    monkeypatch.setattr(parallel, "collective_device", lambda group=None: META)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(parallel.dist, "all_reduce", all_reduce)
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # no vLLM: only the agreement runs
    engine.groups = type("Groups", (), {"dp": dp})()
    with pytest.raises(Stop):
        engine.idle_calls(3)
    assert seen == [(META, dp)]


def test_vllm_is_given_the_share_of_the_gpu_that_is_free():
    """vLLM refuses to start unless gpu_memory_utilization x total is free; its default 0.9
    failed once the training roles held more than ~14 GB of an H200."""
    from transformers import BloomConfig, BloomForCausalLM

    from megatron_rlhf.generation.vllm_engine import (
        GPU_MEMORY_MARGIN_BYTES,
        gpu_memory_fraction,
        weight_bytes,
    )
    from megatron_rlhf.utils import InputError

    hf = BloomForCausalLM(
        BloomConfig(vocab_size=ARCH_A.vocab_size, hidden_size=ARCH_A.hidden_size,
                    n_layer=ARCH_A.num_layers, n_head=ARCH_A.num_heads)
    )  # fmt: skip
    assert weight_bytes(ARCH_A, 1, torch.float32) == 4 * sum(p.numel() for p in hf.parameters())
    assert weight_bytes(ARCH_A, 2, torch.bfloat16) == weight_bytes(ARCH_A, 1, torch.float32) // 4
    gib = 2**30
    # an H200 (141 GB) whose actor, reference, critic and reward already hold 60 GiB
    fraction = gpu_memory_fraction(free=71 * gib, total=131 * gib, needed=30 * gib)
    assert fraction == pytest.approx((71 * gib - GPU_MEMORY_MARGIN_BYTES) / (131 * gib))
    assert fraction < 0.9
    with pytest.raises(InputError, match=r"needs 70.0 GiB .* 71.0 GiB are free of 131.0 GiB"):
        gpu_memory_fraction(free=71 * gib, total=131 * gib, needed=70 * gib)


def test_te_that_fails_to_import_on_cuda_warns_once(monkeypatch):
    """TE installed but broken (a cuDNN or driver mismatch) on a CUDA machine: a loud warning
    naming the error, once, instead of TE silently off in every command."""
    import importlib.util
    import warnings

    from megatron_rlhf.models.bloom import attention as attention_module

    def broken_te():
        raise OSError("libcudnn.so.9: cannot open shared object file")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(attention_module, "_import_te_attention", broken_te)
    monkeypatch.setattr(attention_module, "_te_import_failure_warned", False)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (
            object() if name == "transformer_engine" else real_find_spec(name, *args)
        ),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(RuntimeWarning, match="OSError: libcudnn.so.9"):
        assert attention_module.te_attention_class() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_module.te_attention_class() is None  # once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(attention_module, "_te_import_failure_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_module.te_attention_class() is None  # a CPU machine: quiet


def test_attention_backend_resolution():
    """auto: PyTorch on the CPU; the older use_te_attention switch maps onto te/torch; a
    contradiction, an unknown name and TE without TE are errors that say what to write."""
    from megatron_rlhf.models.bloom.spec import resolve_attention_backend

    cpu = torch.device("cpu")
    assert resolve_attention_backend(None, cpu) == "torch"
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("triton", cpu) == "triton"  # construction is device-agnostic
    assert resolve_attention_backend(None, cpu, use_te_attention=False) == "torch"
    with pytest.raises(ValueError, match="contradicts"):
        resolve_attention_backend("triton", cpu, use_te_attention=False)
    with pytest.raises(ValueError, match="one of"):
        resolve_attention_backend("flash", cpu)
    with pytest.raises(ImportError, match="'triton', 'torch' or 'auto'"):
        resolve_attention_backend("te", cpu)  # no transformer-engine here


def test_auto_gives_an_fp32_model_with_wide_heads_pytorch_attention_on_a_gpu(monkeypatch):
    """The fp32 Triton attention spills 10-20 KB a thread at head dim 64 and 128 on sm_90 (its
    D=128 backward took 67 s to compile), yet ``auto`` chose it for any CUDA model. Here Triton
    is taken to launch (no GPU on this machine): bf16, and fp32 at head dim 16, keep Triton."""
    import megatron_rlhf.models.bloom.spec as spec

    monkeypatch.setattr(spec, "triton_launches", lambda: True)
    monkeypatch.setattr(spec, "HAVE_TRITON", True)
    cuda = torch.device("cuda")

    def auto(dtype, head_dim):
        return spec.resolve_attention_backend("auto", cuda, dtype=dtype, head_dim=head_dim)

    assert [auto(torch.float32, d) for d in (16, 64, 80, 128)] == [
        "triton", "torch", "torch", "torch",
    ]  # fmt: skip
    assert [auto(torch.bfloat16, d) for d in (16, 64, 128)] == ["triton"] * 3
    assert spec.resolve_attention_backend("triton", cuda, dtype=torch.float32, head_dim=128) == (
        "triton"
    )  # asked for by name


def test_triton_backend_without_a_usable_triton_takes_the_pytorch_path():
    """attention_backend='triton' on the CPU without the interpreter: the same logits as 'torch'
    (the model then builds the mask and the core attention falls back), padded and packed."""
    from megatron_rlhf.models.bloom import BloomModel

    ids = torch.randint(4, ARCH_A.vocab_size, (2, 7))
    padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    packed = torch.tensor([[1, 1, 2, 2, 2, 3, 0]])
    logits = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = BloomModel(ARCH_A, attention_backend=backend)
        with torch.no_grad():
            logits[backend] = (model(ids, padded), model(ids[:1], packed))
    for got, want in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
