"""Megatron-Core distributed checkpoints: saved at one TP/PP layout, loaded at any other.

A checkpoint directory holds Megatron-Core's ``torch_dist`` files plus ``megatron_rlhf.json``
(architecture, head type, how it was made), when known the tokenizer files, and
``manifest.json`` (every file's size and SHA-256, verified before loading). Saving writes into
``<dir>.tmp-partial`` and renames it when every rank has finished, so an interrupted save never
leaves a directory that looks complete; a save that runs out of space removes the partial and
says so (:class:`DiskFullError`). Nothing of ours is pickled; torch's ``.metadata`` and
Megatron's ``common.pt`` are pickles (upstream): the manifest is checked first, ``.metadata`` is
read through a restricted unpickler (checkpoint/safe_pickle.py) and ``common.pt`` only with
``torch.load``'s ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import multiprocessing
import pickle
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rlhf.checkpoint import manifest, safe_pickle
from megatron_rlhf.checkpoint.containment import require_contained
from megatron_rlhf.distributed.parallel import world_max
from megatron_rlhf.models.bloom.config import BloomArchitecture
from megatron_rlhf.runtime.processes import die_with_parent, forks_die_with_parent
from megatron_rlhf.utils import InputError, NonFiniteError, error_chain

METADATA_FILE = "megatron_rlhf.json"
GLOBAL_TENSORS_FILE = "global_tensors.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
safe_pickle.install()  # every torch FileSystemReader reads .metadata without running code


# What dist_checkpointing raises on a checkpoint with a missing, truncated or corrupt file
# (torch's CheckpointException wraps each rank's error; it derives from BaseException).
DAMAGED_CHECKPOINT_ERRORS = (
    CheckpointException,
    CheckpointingException,
    OSError,
    EOFError,
    RuntimeError,
    pickle.UnpicklingError,
)


def _first_failure(err: BaseException) -> str:
    """``Type: first line`` of the innermost error a checkpoint load failed with."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines() or [""]
    return f"{type(err).__name__}: {lines[0][:200]}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    directory: str | Path,
    sharded_state_dict: dict,
    metadata: dict,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    rank_state: dict | None = None,
    global_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``sharded_state_dict`` (model, optimizer, ...) atomically; collective over ranks.

    ``rank_state`` (RNG states, counters: JSON-able values) is written per global rank as
    ``rank_state/<rank>.json``. ``global_tensors`` (tensors every rank holds alike, such as
    the rollouts in flight of ``async.max_staleness``) are written once, by rank 0, as
    safetensors (:data:`GLOBAL_TENSORS_FILE`; no pickle). Last, every file's size and SHA-256 go into ``manifest.json``
    (checkpoint/manifest.py), which :func:`load` verifies before anything is unpickled.
    """
    final = Path(directory)
    partial = final.with_name(final.name + ".tmp-partial")
    # Checked on every rank: if rank 0 alone raised, the others would wait at the barrier.
    if final.exists() and not overwrite:
        raise InputError(f"{final}: already exists; choose another --save directory")
    require_finite_state(_named_tensors(sharded_state_dict), str(final))
    if tokenizer_dir is not None and "tokenizer" not in metadata:
        metadata = {**metadata, "tokenizer": tokenizer_of(tokenizer_dir)}
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    try:
        _write(partial, sharded_state_dict, metadata, tokenizer_dir, rank_state, global_tensors)
    except BaseException as err:  # torch's CheckpointException derives from BaseException
        full = out_of_space(err, partial, sharded_state_dict)
        if full is None:
            raise
        if _rank() == 0:  # give the space back; the checkpoints before it are untouched
            shutil.rmtree(partial, ignore_errors=True)
        raise full from None
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def _write(partial: Path, sharded_state_dict, metadata, tokenizer_dir, rank_state, tensors):
    """Every file of a checkpoint into ``partial`` (collective): :func:`save`'s body."""
    _results_queue_without_spawn()
    with _quiet_upstream_deprecations(), forks_die_with_parent():
        dist_checkpointing.save(sharded_state_dict, str(partial))
    if rank_state is not None:
        (partial / "rank_state").mkdir(exist_ok=True)
        (partial / "rank_state" / f"{_rank():05d}.json").write_text(json.dumps(rank_state))
    if _rank() == 0 and tensors:
        from safetensors.torch import save_file

        tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
        save_file(tensors, str(partial / GLOBAL_TENSORS_FILE))
    if _rank() == 0:
        (partial / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, partial)
    _barrier()
    manifest.write_manifest(partial)


class DiskFullError(InputError):
    """A checkpoint save ran out of disk space (exit code 2, one line, no traceback). The
    partial save is removed, so nothing the run wrote before it changes."""


def out_of_space(err: BaseException, partial: Path, sharded_state_dict) -> DiskFullError | None:
    """A :class:`DiskFullError` for ``partial`` when ``err`` ended its save for lack of space,
    else None. Lack of space is ``ENOSPC`` / ``EDQUOT`` anywhere in ``err``, as an OSError or
    in a message (torch's ``CheckpointException`` wraps each rank's failure, and Megatron's
    writer re-raises a worker's OSError as ``RuntimeError: Worker failure: [Errno 28] ...``),
    or, since torch's zip writer loses the errno (a full disk reads ``unexpected pos 704 vs
    598``), fewer bytes free on that disk than this rank's tensors take. The message gives
    both numbers."""
    needed = sum(t.numel() * t.element_size() for _, t in _named_tensors(sharded_state_dict))
    free = shutil.disk_usage(partial.parent).free
    if not (_says_no_space(err) or free < needed and not _has_os_error(err)):
        return None
    return DiskFullError(
        f"{partial}: no space left on device while saving a checkpoint (this rank's tensors "
        f"need about {needed:,} bytes; {free:,} bytes were free there); the partial save was "
        "removed; free space or save elsewhere"
    )


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _says_no_space(err: BaseException) -> bool:
    marks = [f"[Errno {code}]" for code in _NO_SPACE]
    return any(
        (isinstance(e, OSError) and e.errno in _NO_SPACE) or any(m in str(e) for m in marks)
        for e in error_chain(err)
    )


def _has_os_error(err: BaseException) -> bool:
    """Whether ``err`` holds an OSError (some other one than no space: a named cause)."""
    return any(isinstance(e, OSError) for e in error_chain(err))


def _results_queue_without_spawn() -> None:
    """Megatron's checkpoint writer takes its results queue from a *spawn* ``Manager``, whose
    server process re-imports the caller's ``__main__``: a script that calls a command's
    ``main()`` without an ``if __name__ == "__main__":`` guard would run itself again at the first
    save. A *fork* ``Manager`` serves the same queue and re-imports nothing (the writer processes
    are forked too); the kernel kills it when this process dies (runtime/processes.py)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=die_with_parent)  # no orphan if the trainer is killed
        filesystem_async._results_queue = manager.Queue()


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite, in one reading pass: a NaN or an
    infinity makes the sum non-finite and nothing added after it makes it finite again, so a
    finite sum proves every element finite. A non-finite sum (a NaN or infinity, or finite
    values whose sum overflows the dtype, e.g. fp16 past 65,504) gets the elementwise check.
    (``torch.isfinite(t).all()`` alone is ``abs``, two comparisons and an ``all`` over fresh
    bool tensors: ~7 s of a BLOOM-560m-shaped PPO save's state on the 2-core CPU.)"""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def require_finite_state(named_tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Raise :class:`NonFiniteError` naming the first non-finite floating tensor (collective).

    Cost at scale: one summing pass over each rank's state (~35 GB per GPU for a 176B actor on
    80 GPUs: a few tens of ms at HBM bandwidth) per save (:func:`all_finite`)."""
    first_bad = None
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and not all_finite(tensor):
            first_bad = name
            break
    if world_max(int(first_bad is not None)):
        raise NonFiniteError(
            f"{where}: refusing to save a checkpoint with non-finite values "
            f"({first_bad or 'on another rank'}); the previous checkpoint is unchanged"
        )


def _named_tensors(tree, name: str = ""):
    """(key, tensor) for every tensor leaf of a (sharded) state dict."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _named_tensors(value, f"{name}.{key}" if name else str(key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _named_tensors(value, f"{name}.{index}")
    elif torch.is_tensor(tree):
        yield name, tree
    elif torch.is_tensor(getattr(tree, "data", None)):  # ShardedTensor and friends
        yield getattr(tree, "key", name), tree.data


def load(directory: str | Path, sharded_state_dict: dict, partial: bool = False) -> dict:
    """Load a checkpoint into the given sharded state dict (any TP/PP layout).

    ``partial=True`` allows loading a slice of the tensors (e.g. one layer at a time).
    """
    directory = Path(directory)
    read_metadata(directory)  # a clear error for a directory that is not our checkpoint
    require_contained(directory)  # no file of it is a symlink to somewhere else
    manifest.verify(directory)  # before torch's .metadata and common.pt are unpickled
    for name in ("metadata.json", "common.pt", ".metadata"):  # what every torch_dist save writes
        if not (directory / name).is_file():
            raise InputError(
                f"{directory / name}: missing, the checkpoint is incomplete; re-save or "
                "re-convert it"
            )
    safe_pickle.require_weights_only_default()
    safe_pickle.load_metadata(directory / ".metadata")  # refused here, named, before Megatron
    safe_pickle.check_weights_only(directory / "common.pt")
    try:
        with _quiet_upstream_deprecations():
            loaded = dist_checkpointing.load(
                sharded_state_dict, str(directory), validate_access_integrity=not partial
            )
    except DAMAGED_CHECKPOINT_ERRORS as err:
        raise InputError(
            f"{directory}: cannot be loaded, a file is missing, truncated or corrupt "
            f"({_first_failure(err)}); re-save or re-convert the checkpoint"
        ) from None
    # The checkpoint's common (non-tensor) state comes back too, e.g. a training checkpoint's
    # optimizer param groups under its role name: return only the keys that were asked for.
    return {key: value for key, value in loaded.items() if key in sharded_state_dict}


@contextlib.contextmanager
def _quiet_upstream_deprecations():
    """torch 2.13 deprecates ShardedTensor and ``torch.distributed.checkpoint.load_state_dict``,
    which Megatron-Core 0.16.1's dist_checkpointing uses on every load (its strategies/torch.py:799
    calls ``load_state_dict``; its planner builds ShardedTensors). No argument of ours picks
    either, so their FutureWarnings are silenced around its calls, until Megatron-Core moves to
    DTensor and ``dcp.load``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`load_state_dict` is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        yield


def load_rank_state(directory: str | Path) -> dict | None:
    """This rank's ``rank_state`` (JSON, never a pickle) from a checkpoint saved at the same
    world size, else None."""
    path = Path(directory) / "rank_state" / f"{_rank():05d}.json"
    if path.exists():
        manifest.verify(directory)
        return json.loads(path.read_text())
    if path.with_suffix(".pt").exists():
        raise InputError(
            f"{path.with_suffix('.pt')}: rank state in the old pickle format, which is not "
            "loaded (unpickling can run code); resume from a checkpoint of this version"
        )
    return None


def load_global_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The ``global_tensors`` :func:`save` wrote (on the CPU; ``{}`` when none were), after
    the manifest verifies. Every rank reads the one file, so any world size resumes them."""
    from safetensors.torch import load_file

    path = Path(directory) / GLOBAL_TENSORS_FILE
    if not path.exists():
        return {}
    manifest.verify(directory)
    return load_file(str(path))


def read_metadata(directory: str | Path) -> dict:
    path = Path(directory) / METADATA_FILE
    if not path.exists():
        raise InputError(
            f"{directory}: not a megatron-rlhf checkpoint (no {METADATA_FILE}); convert a "
            "Hugging Face model with `tools/convert_checkpoint.py hf-to-megatron`"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(
            f"{path}: not valid JSON ({err}); the checkpoint is damaged: re-save or re-convert it"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("architecture"), dict):
        raise InputError(f"{path}: has no 'architecture' section; re-save or re-convert it")
    return meta


def architecture_of(directory: str | Path) -> BloomArchitecture:
    return BloomArchitecture(**read_metadata(directory)["architecture"])


def model_metadata(model, **extra) -> dict:
    """What ``megatron_rlhf.json`` records about a model."""
    meta = {
        "architecture": model.arch.to_dict(),
        "head": model.head,
        "num_scalar_outputs": model.num_scalar_outputs,
        "padded_vocab_size": model.vocab_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    meta.update(extra)
    return meta


def tokenizer_of(directory: str | Path, meta: dict | None = None) -> dict | None:
    """{"name", "fingerprint"} of the tokenizer of a checkpoint (recorded in its
    ``megatron_rlhf.json``, or in ``meta`` when it was read already) or of any directory
    holding tokenizer files; None if unknown."""
    directory = Path(directory)
    if meta is None and (directory / METADATA_FILE).exists():
        meta = read_metadata(directory)
    if meta is not None:
        recorded = meta.get("tokenizer")
        if recorded is not None:
            return recorded
    if not (directory / "tokenizer.json").exists():
        return None
    from megatron_rlhf.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(directory)
    return {"name": str(directory), "fingerprint": tokenizer_fingerprint(tokenizer)}


def check_tokenizer_matches(tokenizer_dir, model_dir, flag: str = "--tokenizer") -> None:
    """A tokenizer directory given beside a model is the model's own (when both are known)."""
    from megatron_rlhf.data.tokenizer import check_same_tokenizer

    if tokenizer_dir is None or Path(tokenizer_dir) == Path(model_dir):
        return
    given = tokenizer_of(tokenizer_dir)
    if given is not None:
        named = {"path": str(tokenizer_dir), **given}
        check_same_tokenizer(named, f"{flag} {tokenizer_dir}", tokenizer_of(model_dir), model_dir)


def copy_tokenizer_files(source: str | Path, target: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copy2(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied
