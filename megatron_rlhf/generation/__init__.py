"""The rollout engine: batched, left-padded, KV-cached generation at any TP/PP."""

from megatron_rlhf.utils import lazy_exports

# Imported on first use, so the ``generate`` command parses its flags before torch loads.
_EXPORTS = {"GenerationOutput": "decode", "SamplingConfig": "decode", "generate": "engine"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
