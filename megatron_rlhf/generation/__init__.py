"""Generation: batched, left-padded, KV-cached decoding at any TP/PP (``decode_loop``), the
rollout engines that choose which model generates in which layout (``rollout_engines``: our
decode, a resharded copy, vLLM), and reading prompts for the commands that generate
(``prompts``)."""

from megatron_rlhf.utils import lazy_exports

# Imported on first use, so the ``generate`` command parses its flags before torch loads.
_EXPORTS = {"GenerationOutput": "decode", "SamplingConfig": "decode", "generate": "decode_loop"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
