"""Model definitions: one BLOOM trunk on Megatron-Core with a head per RLHF role."""
