"""GPUs, FLOPs per token and model FLOPs utilisation (MFU) counted the standard way.

Training FLOPs per token (Kaplan et al. 2020; Narayanan et al. 2021): ``6 N`` for the weight
matmuls (forward 2N, backward 4N) plus the attention scores and context matmuls,
``6 * 2 * l * s * h`` per token at sequence length s (forward ``2 * 2 * s * h`` per layer, backward
twice that). Forward-only (scoring, generation): ``2 N + 2 * 2 * l * s * h``. N counts every
parameter except the embedding lookup, whose tied LM-head matmul is counted (so N = all params).
Full recompute runs the forward twice, but MFU counts model FLOPs only (recompute excluded), as
Megatron and PaLM report it. MFU = achieved model FLOP/s / (GPUs x dense bf16 peak).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator's published figures (dense, no sparsity)."""

    name: str
    """Marketing name as ``torch.cuda.get_device_name`` reports it (matched by substring)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    memory_gb: float
    """HBM capacity, GB."""
    hbm_tb_per_s: float
    """HBM bandwidth, TB/s (bounds KV-cached decoding)."""
    nvlink_gb_per_s: float
    """Per-GPU NVLink bandwidth one way, GB/s (TP collectives inside a node)."""


GPUS = (
    # The PCIe/NVL cards first: their names contain the SXM parts' ("NVIDIA H200 NVL").
    GPU(name="H200 NVL", bf16_tflops=835.0, memory_gb=141, hbm_tb_per_s=4.8, nvlink_gb_per_s=450),
    GPU(name="H100 NVL", bf16_tflops=835.0, memory_gb=94, hbm_tb_per_s=3.9, nvlink_gb_per_s=300),
    GPU(name="H200", bf16_tflops=989.0, memory_gb=141, hbm_tb_per_s=4.8, nvlink_gb_per_s=450),
    GPU(name="H100 PCIe", bf16_tflops=756.0, memory_gb=80, hbm_tb_per_s=2.0, nvlink_gb_per_s=300),
    GPU(name="H100", bf16_tflops=989.0, memory_gb=80, hbm_tb_per_s=3.35, nvlink_gb_per_s=450),
    GPU(name="A100", bf16_tflops=312.0, memory_gb=80, hbm_tb_per_s=2.0, nvlink_gb_per_s=300),
    GPU(name="L40S", bf16_tflops=362.0, memory_gb=48, hbm_tb_per_s=0.86, nvlink_gb_per_s=32),
    GPU(name="A10", bf16_tflops=125.0, memory_gb=24, hbm_tb_per_s=0.6, nvlink_gb_per_s=32),
)
"""Dense bf16 peaks from NVIDIA's data sheets (H100/H200 SXM: 989 TFLOP/s; NVL: 835; A100: 312)."""

DEFAULT_GPU = next(
    gpu for gpu in GPUS if gpu.name == "H100"
)  # H100 SXM 80 GB: the planner's default hardware
INTER_NODE_GB_PER_S = 50.0  # per GPU, one way: 400 Gb/s InfiniBand NDR per GPU
GPUS_PER_NODE = 8


def gpu_by_name(device_name: str) -> GPU | None:
    """The table entry whose name occurs in ``device_name`` (e.g. 'NVIDIA H200'), else None."""
    for gpu in GPUS:  # "H100 PCIe"/"H200 NVL" come before "H100"/"H200": the longer match wins
        if gpu.name.lower() in device_name.lower():
            return gpu
    return None


def train_flops_per_token(params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs of one trained token: forward + backward of the weights and the attention."""
    return 6.0 * params + 12.0 * num_layers * hidden * seq_len


def forward_flops_per_token(params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs of one token's forward pass (scoring; generation at context ``seq_len``)."""
    return 2.0 * params + 4.0 * num_layers * hidden * seq_len


def mfu(flops: float, seconds: float, num_gpus: int, gpu: GPU) -> float:
    """Achieved model FLOP/s over ``num_gpus`` x the GPU's dense bf16 peak."""
    return flops / max(seconds, 1e-12) / (num_gpus * gpu.bf16_tflops * 1e12)


def cuda_gpu() -> GPU | None:
    """This process's GPU from the table (None on CPU or an unknown GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return gpu_by_name(torch.cuda.get_device_name())
