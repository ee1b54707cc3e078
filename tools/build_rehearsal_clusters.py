"""Selective Rehearsal curation (paper §3.2): top-k SFT responses per prompt cluster -> D_R.

    python tools/build_rehearsal_clusters.py --input scored.jsonl --embedding-model DIR \\
        --tokenizer POLICY_TOKENIZER_DIR --clusters C --top-k K --output-prefix OUT

All options and outputs: ``megatron_rlhf/rehearsal/cli.py`` (or ``--help``).
"""

import sys

from megatron_rlhf.rehearsal.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
