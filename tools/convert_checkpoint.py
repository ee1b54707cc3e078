#!/usr/bin/env python
"""Convert BLOOM checkpoints between Hugging Face and Megatron-Core (see --help).

python tools/convert_checkpoint.py hf-to-megatron --load HF_DIR --save DIR --tp T --pp P
python tools/convert_checkpoint.py megatron-to-hf --load DIR --save HF_DIR
"""

from megatron_rlhf.checkpoint.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
