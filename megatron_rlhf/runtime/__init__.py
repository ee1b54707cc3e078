"""What a command runs on, below every other package: the run and output locks (``locks``),
process helpers (``processes``) and the CPU allocator's setting (``memory``). Imports only
``utils`` and torch.distributed."""
