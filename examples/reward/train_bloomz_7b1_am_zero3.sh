#!/usr/bin/env bash
# The paper's Advantage Model on BLOOMZ-7B1 under DeepSpeed ZeRO-3
# (examples/reward/bloomz_7b1_am_zero3.yaml): plain torchrun, no deepspeed launcher; 6 GPUs of
# one node by default (the global batch of 180 must divide by the number of ranks).
# Extra arguments are config overrides, e.g. deepspeed.offload_optimizer=true, or
#   GPUS_PER_NODE=8 examples/reward/train_bloomz_7b1_am_zero3.sh train.global_batch_size=184
# A killed run resumes from its latest checkpoint when launched again with the same output_dir
# and the same number of ranks (DeepSpeed's partitioned state is tied to it).
set -euo pipefail
cd "$(dirname "$0")/../.."
torchrun \
    --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${GPUS_PER_NODE:-6}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    -m megatron_rlhf train-reward --config examples/reward/bloomz_7b1_am_zero3.yaml "$@"
