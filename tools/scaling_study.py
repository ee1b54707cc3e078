"""Scaling study: tokens/s, peak memory (measured vs planned) and MFU across sizes and layouts.

    python tools/scaling_study.py --quick --output-dir study/

Every option is documented in megatron_rlhf/planner/sweep.py; ``--quick`` is the CPU sweep the
README's table comes from (tiny -> 560m-shaped over 2 gloo ranks, <= 5 min on 2 cores).
"""

import sys

from megatron_rlhf.planner.sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
