#!/usr/bin/env bash
# The paper's Advantage Model on BLOOMZ-7B1 (examples/reward/bloomz_7b1_am.yaml): one node of
# 8 GPUs by default; for several nodes set NNODES, NODE_RANK and MASTER_ADDR on each node.
# Extra arguments are config overrides, e.g. loss=rm for the Reward Model baseline:
#   examples/reward/train_bloomz_7b1_am.sh model.load=/models/bloomz-7b1 loss=rm \
#       train.output_dir=runs/bloomz_7b1_rm
# A killed run resumes from its latest checkpoint when launched again with the same output_dir.
set -euo pipefail
cd "$(dirname "$0")/../.."
torchrun \
    --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    -m megatron_rlhf train-reward --config examples/reward/bloomz_7b1_am.yaml "$@"
