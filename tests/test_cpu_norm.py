"""kernels/fused/cpu_norm.py: sums of squares accurate to fp32 rounding at any size (the kernel
and its PyTorch path), where torch's CPU norm loses up to ~3.6 % at BLOOM's vocabulary gradient;
and Megatron-Core's gradient norm on a CPU takes it (``distributed/cpu_compat.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_rlhf.kernels import cpu_norm


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each test on both paths: the C kernel (where it runs here) and the PyTorch blocking."""
    if request.param == "kernel" and cpu_norm._library() is None:
        pytest.skip("no AVX-512 or no C compiler: the kernel cannot run here")
    if request.param == "torch":
        monkeypatch.setattr(cpu_norm, "_library", lambda: None)
    return request.param


@pytest.fixture
def gen():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def ref(tensor: torch.Tensor) -> float:
    return (tensor.double() ** 2).sum().item()


def tolerance(path: str) -> float:
    """The kernel sums 64 values a lane in fp32; the PyTorch path's dot products up to 2^16."""
    return 1e-6 if path == "kernel" else 1e-5


@pytest.mark.parametrize("size", [0, 1, 15, 17, 63, 65, 4095, 4097, 3 * 4096 + 5, 2**20 + 3])
def test_sum_of_squares_equals_float64_at_awkward_sizes(size, path, gen):
    """Sizes off the 16-lane vector, the 64-value step and the 4,096-value block."""
    values = torch.randn(size, generator=gen) * 10.0 ** torch.randint(-3, 3, (1,), generator=gen)
    got, want = cpu_norm.sum_of_squares(values), ref(values)
    assert got == pytest.approx(want, rel=tolerance(path), abs=1e-30)


def test_at_a_vocabulary_gradients_size_torch_norm_drifts_and_this_does_not(path, gen):
    """64M values (a quarter of BLOOM's 257M-value vocabulary gradient): torch's fp32 norm is
    ~5e-3 low, this within 1e-6 of float64 (measured ~1e-8 on the kernel path)."""
    values = torch.randn(2**26, generator=gen) * 1e-3
    want = math.sqrt(ref(values))
    assert abs(torch.norm(values).item() / want - 1) > 1e-3  # the error this module exists for
    assert math.sqrt(cpu_norm.sum_of_squares(values)) == pytest.approx(want, rel=1e-6)


def test_strided_other_dtypes_and_non_finite_values(path, gen):
    matrix = torch.randn(300, 70, generator=gen)
    column_major = matrix.t()  # not contiguous: the PyTorch path on either side
    assert cpu_norm.sum_of_squares(column_major) == pytest.approx(ref(matrix), rel=1e-5)
    half = matrix.bfloat16()
    assert cpu_norm.sum_of_squares(half) == pytest.approx(ref(half.float()), rel=1e-5)
    for bad in (float("nan"), float("inf")):
        values = torch.randn(5000, generator=gen)
        values[4321] = bad
        assert not math.isfinite(cpu_norm.sum_of_squares(values))


def test_l2_norm_is_megatrons_multi_tensor_norm(path, gen):
    grads = [torch.randn(n, generator=gen) for n in (1, 4097, 123_457)]
    norm, per_tensor = cpu_norm.l2_norm(2048 * 32, None, [grads], True)
    assert norm.dtype == torch.float32 and norm.shape == (1,)
    want = math.sqrt(sum(ref(g) for g in grads))
    assert norm.item() == pytest.approx(want, rel=tolerance(path))
    assert per_tensor.tolist() == pytest.approx([math.sqrt(ref(g)) for g in grads], rel=1e-5)
    assert cpu_norm.l2_norm(2048 * 32, None, [grads], False)[1] is None


def test_megatrons_gradient_norm_on_a_cpu_takes_it(gen):
    """After the CPU layer is installed, Megatron-Core's ``get_grad_norm_fp32`` (what the
    optimizer's ``get_grad_norm`` calls) equals float64 over a 64M-value gradient."""
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads

    from megatron_rlhf.distributed import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the CPU layer is installed only without a GPU")
    cpu_compat.install()
    assert clip_grads.l2_norm_impl is cpu_norm.l2_norm
    grads = [torch.randn(2**26, generator=gen) * 1e-3, torch.randn(1000, generator=gen)]
    want = math.sqrt(sum(ref(g) for g in grads))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    try:
        got = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=dist.group.WORLD)
    finally:
        if created:
            dist.destroy_process_group()
    assert got == pytest.approx(want, rel=1e-6)
