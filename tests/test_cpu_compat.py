"""The CPU compatibility layer is pinned to megatron-core 0.16.1 and must fail loudly if that
changes: the version, every call site it claims to cover (snippet and file:line), and the
patches ``install()`` puts in place."""

from __future__ import annotations

import importlib
import inspect
import re

import megatron.core
import pytest
import torch

from megatron_rlhf.distributed import cpu_compat

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive on GPUs")


def missing_call_sites(expected: dict[str, list[str]], source_of) -> dict[str, list[str]]:
    """``{module: [snippets absent from its source]}`` for every module with a missing one."""
    missing = {}
    for module, snippets in expected.items():
        source = source_of(module)
        absent = [snippet for snippet in snippets if snippet not in source]
        if absent:
            missing[module] = absent
    return missing


def _source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def test_installed_megatron_core_is_the_pinned_version():
    assert megatron.core.__version__ == cpu_compat.PINNED_MEGATRON_CORE == "0.16.1", (
        f"megatron-core {megatron.core.__version__} is installed; re-check every call site in "
        "megatron_rlhf/distributed/cpu_compat.py against it before changing the pin"
    )


def test_every_expected_call_site_is_still_in_megatron_core():
    assert missing_call_sites(cpu_compat.EXPECTED_CALL_SITES, _source) == {}
    assert set(cpu_compat.PATCHED_MODULES) <= set(cpu_compat.EXPECTED_CALL_SITES)


def test_documented_line_numbers_still_point_at_cuda_code():
    """Each ``file.py:N[,M|-K]`` in PATCHED_MODULES names lines that still mention cuda."""
    for module, entries in cpu_compat.PATCHED_MODULES.items():
        lines = _source(module).splitlines()
        file_name = module.rsplit(".", 1)[-1] + ".py"
        for entry in entries:
            match = re.match(rf"{re.escape(file_name)}:([\d,\-]+)", entry)
            assert match, f"{module}: entry {entry!r} does not start with {file_name}:LINE"
            for part in match.group(1).strip(",").split(","):
                line = int(part.split("-")[0])
                assert "cuda" in lines[line - 1], f"{module}:{line} is now {lines[line - 1]!r}"


def test_a_mismatched_expectation_is_reported(tmp_path, monkeypatch):
    """A module whose source lost a call site (as after an upgrade) is reported, by name."""
    (tmp_path / "fake_megatron_module.py").write_text(
        "import torch\n\ndef buffer():\n    return torch.zeros(1, device=torch.cuda.current_device())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {"fake_megatron_module": ["torch.cuda.current_device()", 'device="cuda"']}
    assert missing_call_sites(expected, _source) == {"fake_megatron_module": ['device="cuda"']}
    expected = {"fake_megatron_module": ["torch.cuda.current_device()"]}
    assert missing_call_sites(expected, _source) == {}


@cpu_only
def test_install_patches_every_listed_module():
    assert cpu_compat.install() is True
    assert cpu_compat.install() is True  # idempotent
    for name in cpu_compat.PATCHED_MODULES:
        patched = importlib.import_module(name).torch
        assert isinstance(patched, cpu_compat._CpuTorch), name
        assert patched.cuda.current_device() == torch.device("cpu")
        assert patched.zeros(2, device="cuda").device.type == "cpu"
        assert patched.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert patched.empty(3, device=0, pin_memory=True).device.type == "cpu"
        assert patched.float32 is torch.float32 and patched.nn is torch.nn
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    assert random._get_cuda_rng_state is cpu_compat._rng_state_get
    assert random._set_cuda_rng_state is cpu_compat._rng_state_set
    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads"):
        module = importlib.import_module(name)
        assert module.clip_grad_by_total_norm_fp32 is cpu_compat._clip_grad_by_total_norm_fp32
    assert not isinstance(torch.cuda, cpu_compat._CpuCuda)  # the global torch is untouched


@cpu_only
def test_install_refuses_another_megatron_core_version(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_installed", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core==0\.16\.1 but 0\.17\.0"):
        cpu_compat.install()


@cpu_only
def test_cpu_rng_tracker_and_clip_grads_behave_like_their_cuda_versions():
    cpu_compat.install()
    from megatron.core.tensor_parallel import random

    tracker = random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # fork restores the default stream
    torch.manual_seed(123)
    assert torch.equal(first, torch.rand(3))  # the tracked stream was seeded with 123

    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((4,), 3.0)
    total_norm = torch.cat([p.grad for p in params]).norm().item()
    cpu_compat._clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)
    clipped = torch.cat([p.grad for p in params]).norm().item()
    assert abs(clipped - 1.0) < 1e-5
    cpu_compat._clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=clipped)
    assert abs(torch.cat([p.grad for p in params]).norm().item() - clipped) < 1e-7


@cpu_only
def test_tensor_cuda_is_identity_only_inside_its_scope():
    original = torch.Tensor.cuda
    tensor = torch.ones(2)
    with cpu_compat.tensor_cuda_is_identity():
        assert tensor.cuda() is tensor
    assert torch.Tensor.cuda is original
    with pytest.raises(RuntimeError), cpu_compat.tensor_cuda_is_identity():
        raise RuntimeError("boom")
    assert torch.Tensor.cuda is original
