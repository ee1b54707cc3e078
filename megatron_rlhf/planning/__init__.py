"""Plan a PPO run before renting the GPUs: parameters, memory per GPU, step time, layouts.

- ``shapes``: BLOOM presets (560m ... 176b) or an HF ``config.json``; exact parameter counts, per
  model and per (TP, PP) rank, as our Megatron-Core ``BloomModel`` holds them.
- ``hardware``: dense bf16 peak and memory bandwidth of known GPUs; FLOPs per token; MFU.
- ``memory``: per-role, per-GPU bytes (weights, gradients, Adam state with or without the
  distributed optimizer, activations with or without recompute, KV cache, logits working set).
- ``plan``: candidate layouts per role and for the rollout, the ones that fit, ranked by an
  estimated step time; JSON and a runnable ``train-ppo`` config.
- ``placement``: the disaggregated split of the GPUs into rollout and training sets and its
  predicted asynchronous step against the best colocated synchronous plan.

Pure arithmetic, used by training/ to check memory before a run; the tools that build models
(``megatron_rlhf/planner/``: the CLI, the scaling sweep and the measurements) sit above
training in the package order. ``tools/plan_parallelism.py`` answers in well under a second.
"""
