"""Refuse a run that cannot fit, before any model is built (``--skip-memory-check`` overrides).

Every trainer asks the planner (planning/memory.py) for the peak bytes of its fullest rank, adds
the step's collated inputs (all micro-batches of a step are built before the first forward), and
compares the sum with what this rank can have: on a GPU the device's memory, on the CPU the host
RAM available now divided by the ranks of this launch on this host. Only a clear excess is
refused (``MARGIN``: the planner's figures are estimates); the message gives the figure, its
largest term and the config key that changes it.
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch

from megatron_rlhf.planning.memory import GB, Memory
from megatron_rlhf.utils import InputError

MARGIN = 1.25
"""Refused only when the prediction exceeds the available memory by this factor."""
INPUT_BYTES_PER_TOKEN = 4 * 8
"""Collated inputs per token: token ids, attention/padding mask, labels or loss mask and
positions, int64 each."""


def input_bytes(rows: int, seq_len: int) -> float:
    """Host bytes of ``rows`` collated sequences of ``seq_len`` tokens."""
    return float(rows) * seq_len * INPUT_BYTES_PER_TOKEN


def available_bytes() -> tuple[float, str]:
    """(bytes this rank may use, what they are)."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return float(total), f"the {torch.cuda.get_device_name()}'s {total / GB:.1f} GB"
    import psutil

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = psutil.virtual_memory().available
    return free / ranks, f"{free / GB:.1f} GB of host RAM available / {ranks} rank(s) on this host"


def check_fits(memory: Memory, inputs: float, keys: dict[str, str], skip: bool = False) -> None:
    """Raise InputError when ``memory`` (the planner's peak of the fullest rank) plus ``inputs``
    clearly exceeds :func:`available_bytes`. ``keys`` maps a term (``weights``, ``grads``,
    ``optimizer``, ``activations``, ``logits``, ``kv_cache``, ``inputs``) to the config keys
    that shrink it."""
    if skip:
        return
    terms = {f.name: getattr(memory, f.name) for f in fields(memory)} | {"inputs": inputs}
    need = sum(terms.values())
    have, what = available_bytes()
    if need <= MARGIN * have:
        return
    largest = max(terms, key=terms.get)
    parts = ", ".join(f"{name} {value / GB:.3g}" for name, value in terms.items() if value)
    raise InputError(
        f"the planner predicts {need / GB:.3g} GB per rank ({parts} GB), more than "
        f"{what}; the largest part is {largest}: lower it with {keys[largest]}, or pass "
        "--skip-memory-check to start anyway"
    )


def check_trainer(
    arch,
    config,
    layout,
    seq_len: int,
    rows_per_example: int,
    head: str,
    element_bytes: int,
    sharded_optimizer: bool,
    skip: bool = False,
    max_tokens: int | None = None,
) -> None:
    """:func:`check_fits` for one trained model (``train-sft``, ``train-reward``) in ``layout``
    (the ``distributed.layouts.Layout`` that ``initialize`` returned): ``config`` has
    ``train`` (recompute, batch sizes); ``rows_per_example``: 2 for a
    preference pair; ``max_tokens``: packed micro-batches of this many tokens (one row) instead
    of ``micro_batch_size`` padded examples."""
    from megatron_rlhf.planning.memory import Workload, train_memory
    from megatron_rlhf.planning.shapes import shape_of

    train, dp = config.train, layout.dp
    rows, width, sequence = train.micro_batch_size * rows_per_example, seq_len, None
    if max_tokens is not None:  # one row; each sequence attended alone unless under SP
        rows, width = 1, max_tokens
        sequence = None if layout.sequence_parallel else seq_len
    work = Workload(
        micro_batch=rows,
        seq_len=width,
        response_len=width,
        num_microbatches=max(1, train.global_batch_size // (train.micro_batch_size * dp)),
        element_bytes=element_bytes,
        recompute=train.recompute_activations,
        sequence_parallel=layout.sequence_parallel,
        distributed_optimizer=sharded_optimizer,
        packed_sequence_len=sequence,
    )
    per_rank_rows = -(-train.global_batch_size // dp) * rows_per_example
    batch_keys = "train.micro_batch_size, data.max_length or train.recompute_activations=true"
    if max_tokens is not None:
        batch_keys = (
            "train.micro_batch_size or train.max_tokens_per_micro_batch (the packed micro-batch's "
            "budget), data.max_length or train.recompute_activations=true"
        )
    keys = _term_keys(
        layout="parallel.tp or parallel.pp (or more ranks)",
        batch=batch_keys,
        kv_cache=batch_keys,
        inputs="train.global_batch_size or data.max_length",
    )
    memory = train_memory(shape_of(arch), layout, head, work)
    check_fits(memory, input_bytes(per_rank_rows, seq_len), keys, skip)


def check_ppo(config, archs: dict, layouts: dict, skip: bool = False) -> None:
    """:func:`check_fits` for ``train-ppo``: colocated, every role spans every rank, so a rank
    holds a share of each role's weights (and the actor's and critic's gradients and Adam
    state) at once, plus the largest working set of one pass (training, scoring or
    generation); disaggregated, a training rank holds the four roles and a rollout rank the
    rollout copy alone: the fuller of the two is checked."""
    from megatron_rlhf.planning.memory import (
        Workload,
        forward_memory,
        generate_memory,
        train_memory,
    )
    from megatron_rlhf.planning.shapes import shape_of
    from megatron_rlhf.training.command import element_bytes, use_bf16

    cuda = torch.cuda.is_available()
    e = element_bytes(use_bf16(config.train.bf16))
    new_tokens = config.rollout.max_new_tokens
    seq = config.data.max_prompt_length + new_tokens
    rows = config.rollout.prompts_per_step
    if config.ppo.algorithm == "rejection_sampling":
        rows *= config.ppo.rejection_samples_per_prompt
    work = Workload(
        micro_batch=config.train.micro_batch_size,
        seq_len=seq,
        response_len=new_tokens,
        element_bytes=e,
        recompute=config.train.recompute_activations,
        distributed_optimizer=cuda,
    )
    roles = {
        "actor": train_memory(shape_of(archs["actor"]), layouts["actor"], "lm", work),
        "critic": train_memory(shape_of(archs["critic"]), layouts["critic"], "scalar", work),
        "reference": forward_memory(shape_of(archs["reference"]), layouts["reference"], "lm", work),
        "rollout": generate_memory(
            shape_of(archs["actor"]),
            layouts["rollout"],
            -(-rows // layouts["rollout"].dp),
            config.data.max_prompt_length,
            new_tokens,
            e,
            decode_batch=config.rollout.decode_batch,
        ),
    }
    if "reward" in archs:
        roles["reward"] = forward_memory(
            shape_of(archs["reward"]), layouts["reward"], "scalar", work
        )
    if config.placement.mode == "disaggregated":  # each side holds its own roles only
        sides = [{r: m for r, m in roles.items() if r != "rollout"}, {"rollout": roles["rollout"]}]
        memory, busiest = max((_rank_memory(side) for side in sides), key=lambda m: m[0].total)
    else:
        memory, busiest = _rank_memory(roles)
    pass_keys = "train.micro_batch_size or train.recompute_activations=true"
    if busiest == "rollout":  # generation passes every rollout row of the replica at once
        pass_keys = "rollout.prompts_per_step or parallel.rollout.tp/pp"
    keys = _term_keys(
        layout="parallel.<role>.tp or parallel.<role>.pp (or more ranks)",
        batch=pass_keys,
        kv_cache="rollout.prompts_per_step, rollout.decode_batch or rollout.max_new_tokens",
        inputs="rollout.prompts_per_step, data.max_prompt_length or rollout.max_new_tokens",
    )
    experience = input_bytes(rows, seq) * 3  # rollout rows, their log-probs, values, advantages
    check_fits(memory, experience, keys, skip)


def _rank_memory(roles: dict) -> tuple[Memory, str]:
    """(what a rank holding a share of every role in ``roles`` needs, the role whose pass is
    the largest working set): every role's weights, gradients and optimizer state at once,
    plus one pass."""
    held = ("weights", "grads", "optimizer")
    memory = Memory(**{name: sum(getattr(m, name) for m in roles.values()) for name in held})
    busiest = max(roles, key=lambda r: roles[r].activations + roles[r].logits + roles[r].kv_cache)
    memory.activations, memory.logits = roles[busiest].activations, roles[busiest].logits
    memory.kv_cache = roles[busiest].kv_cache
    return memory, busiest


def _term_keys(*, layout: str, batch: str, kv_cache: str, inputs: str) -> dict[str, str]:
    """The config keys that shrink each term of a :class:`Memory` (for :func:`check_fits`)."""
    return dict(
        weights=layout, grads=layout, optimizer=layout, activations=batch, logits=batch,
        kv_cache=kv_cache, inputs=inputs,
    )  # fmt: skip
