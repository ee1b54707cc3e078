"""Plan a PPO run's layouts: per-role, per-GPU memory and estimated step time of each candidate.

    python tools/plan_parallelism.py --actor bloomz-176b --critic bloomz-7b1 --reward bloomz-7b1 \
        --gpus 80 --gpu-memory-gb 80 [--rollout-sequences 256 --max-length 2048] [--json]

Every option is documented in megatron_rlhf/planner/cli.py.
"""

import sys

from megatron_rlhf.planner.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
