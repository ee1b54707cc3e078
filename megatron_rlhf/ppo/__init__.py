"""PPO with Selective Rehearsal: rollout -> score -> advantages -> update (train.py)."""
