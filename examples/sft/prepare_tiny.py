"""Make the inputs of ``tiny_cpu.yaml``: a tiny tokenizer, a tiny random BLOOM and SFT data.

    python examples/sft/prepare_tiny.py runs/tiny_sft

Everything is generated offline: the tokenizer is trained on the built-in English corpus, the
BLOOM is random (hidden 64, 2 layers), and the 4,000 (prompt, response) records come from
``megatron_rlhf.data.synthetic``, tokenized by ``tools/preprocess_data.py --kind sft``.
"""

import json
import sys
from pathlib import Path

from megatron_rlhf.data import synthetic_records, train_tiny_tokenizer
from megatron_rlhf.data.preprocess import main as preprocess
from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture


def main(root: Path) -> None:
    tokenizer = train_tiny_tokenizer(None, root / "tokenizer", vocab_size=1000)
    save_random_hf_bloom(
        root / "bloom", tiny_architecture(vocab_size=1024, hidden_size=64, num_heads=4)
    )
    source = root / "sft.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in synthetic_records("sft", 4000, seed=0)))
    argv = ["--input", str(source), "--kind", "sft", "--tokenizer", str(tokenizer)]
    preprocess([*argv, "--output-prefix", str(root / "sft"), "--max-length", "256"])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_sft"))
