"""Make the inputs of ``tiny_cpu.yaml``: a tiny tokenizer, a tiny random BLOOM and preference data.

    python examples/reward/prepare_tiny.py runs/tiny

Everything is generated offline: the tokenizer is trained on the built-in English corpus, the
BLOOM is random (hidden 64, 2 layers), and the 4,000 preference pairs come from
``megatron_rlhf.data.synthetic`` (the chosen answer is on topic and polite), tokenized by
``tools/preprocess_data.py``.
"""

import json
import sys
from pathlib import Path

from megatron_rlhf.data import synthetic_records, train_tiny_tokenizer
from megatron_rlhf.data.preprocess import main as preprocess
from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture


def main(root: Path) -> None:
    tokenizer = train_tiny_tokenizer(None, root / "tokenizer", vocab_size=1000)
    model = root / "bloom"
    save_random_hf_bloom(model, tiny_architecture(vocab_size=1024, hidden_size=64, num_heads=4))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            (model / name).write_bytes((tokenizer / name).read_bytes())
    source = root / "prefs.jsonl"
    lines = (json.dumps(r) for r in synthetic_records("preference", 4000, seed=0))
    source.write_text("\n".join(lines) + "\n")
    argv = ["--input", str(source), "--kind", "preference", "--tokenizer", str(tokenizer)]
    preprocess(
        [*argv, "--output-prefix", str(root / "prefs"), "--max-length", "256", "--overwrite"]
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny"))
