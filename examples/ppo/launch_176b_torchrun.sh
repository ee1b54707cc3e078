#!/usr/bin/env bash
# AM-PPO-SR, BLOOMZ-176B policy + BLOOMZ-7B1 AM, on 20 nodes x 8 GPUs (per-role layouts in the YAML).
# Run this same script on every node (e.g. with pdsh); MASTER_ADDR is the first node.
#   NNODES=20 MASTER_ADDR=node001 bash examples/ppo/launch_176b_torchrun.sh
set -euo pipefail
NNODES=${NNODES:-20}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first node}
MASTER_PORT=${MASTER_PORT:-29500}
export CUDA_DEVICE_MAX_CONNECTIONS=1     # sequence-parallel overlap ordering (Megatron-Core)
export NCCL_ASYNC_ERROR_HANDLING=1

torchrun \
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id bloomz176b-ppo \
  -m megatron_rlhf train-ppo --config examples/ppo/bloomz_176b_am_ppo_sr.yaml "$@"
