"""The settings of one rehearsal-set curation run (``tools/build_rehearsal_clusters.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class RehearsalConfig:
    """Everything one curation run depends on; written into every report."""

    input: str
    """Scored JSONL: one {"prompt", "response", "score"} per line (extra fields carried)."""
    embedding_model: str
    """Local sentence-transformers model directory (paper: SimCSE roberta-base)."""
    tokenizer: str
    """The policy's Hugging Face tokenizer directory, used to write D_R."""
    output_prefix: str
    """OUT: the prefix every output file name starts with."""
    clusters: list[int]
    """Cluster counts c; more than one is a sweep (one rehearsal set per count)."""
    top_k: int
    """k: records kept per cluster."""
    seed: int = 0
    """Seeds k-means initialisation and the shuffle of D_R."""
    device: str = "auto"
    """auto | cpu | cuda: for embeddings and (with faiss-gpu) k-means."""
    batch_size: int = 64
    """Prompts per embedding batch."""
    niter: int = 50
    """K-means (Lloyd) iterations."""
    normalize: bool = True
    """L2-normalise embeddings (cosine geometry) before k-means."""
    min_score: float | None = None
    """Filter: drop candidates scored below this."""
    max_response_tokens: int | None = None
    """Filter: drop candidates whose response is longer (policy-tokenizer tokens)."""
    max_entropy: float | None = None
    """Filter: drop candidates whose mean token entropy is higher (needs entropy_field)."""
    rank_by: str = "score"
    """score: highest score first (the paper) | entropy: lowest mean token entropy first."""
    entropy_field: str = "entropy"
    """Record field holding the response's mean token entropy."""
    dedupe: bool = False
    """Keep the highest-scored record of duplicate prompts instead of failing."""
    overwrite: bool = False
    """Replace the outputs of an earlier run at ``output_prefix`` (else an existing one stops
    the run before any work)."""
    truncated: str = "no_eos"
    """Responses cut at the generation limit (no EOS; see records.response_finished): no_eos
    keeps them in D_R without an EOS, so rehearsal never teaches stopping where the limit cut;
    drop makes them ineligible for selection. Counted in the report either way."""
