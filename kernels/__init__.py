"""Fused kernels, installed as ``megatron_rlhf.kernels``."""
