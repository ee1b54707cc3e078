"""Tokenize prompt / SFT / preference data into Megatron-Core indexed .bin/.idx files.

    python tools/preprocess_data.py --input data.jsonl --kind preference \
        --tokenizer path/to/tokenizer --output-prefix data/hh --workers 8 --max-length 2048

The implementation and every option are documented in megatron_rlhf/data/preprocess.py.
"""

import sys

from megatron_rlhf.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
