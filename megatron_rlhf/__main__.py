from megatron_rlhf.cli import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a helper process
    raise SystemExit(main())
