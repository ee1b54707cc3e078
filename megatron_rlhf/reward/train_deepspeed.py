"""``train-reward`` with ``backend: deepspeed``: the model, its checkpoints and resume.

Everything else (data, losses, schedule, evaluation, logging) is reward/train.py's, shared with
the Megatron backend. The model is transformers' BLOOM trunk with a scalar head
(training/deepspeed_engine.py) under ZeRO stage ``deepspeed.zero_stage``, data parallel over
every rank of the launch (``parallel.tp`` and ``parallel.pp`` must be 1).

A checkpoint ``train.output_dir/step_N`` holds two things:
- the model, consolidated: ``model.safetensors`` with ``BloomForSequenceClassification``
  names (``score.weight`` and ``score.bias``: r, and e_τ for the AM), ``config.json``, the
  tokenizer and ``megatron_rlhf.json`` with ``"format": "hf"``. Every reader of reward
  checkpoints (``score``, ``eval-reward`` inputs, ``train-ppo`` ``models.reward`` and
  ``models.critic``, ``tools/convert_checkpoint.py``) loads it at any TP/PP through the
  Hugging Face import path (checkpoint/__init__.py ``load_bloom``);
- ``deepspeed/``: DeepSpeed's own partitioned model and optimizer states, and beside it
  ``trainer_state.json`` (step, data position, LR schedule) and ``rank_state/NNNNN.json``
  (each rank's RNG streams, as JSON): with them a run resumes exactly at the same world size.

Cost at scale: the consolidated copy is gathered one module at a time onto rank 0's CPU (ZeRO-3),
2 bytes per parameter in bf16: 14 GB of host memory for the 7B1 AM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.utils import InputError, is_rank0, write_json

DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
TRAINER_STATE = "trainer_state.json"


def config_problems(config) -> list[str]:
    """What in a ``backend: deepspeed`` config this backend cannot do."""
    layout, problems = config.parallel, []
    if layout.tp != 1 or layout.pp != 1 or layout.sequence_parallel:
        problems.append(
            f"backend=deepspeed is data parallel only (ZeRO shards over the ranks): set "
            f"parallel.tp=1 parallel.pp=1 parallel.sequence_parallel=false (got "
            f"tp={layout.tp}, pp={layout.pp}), or use backend=megatron for tensor/pipeline "
            "parallelism"
        )
    if config.deepspeed.zero_stage not in (1, 2, 3):
        problems.append(f"deepspeed.zero_stage={config.deepspeed.zero_stage} must be 1, 2 or 3")
    return problems


def build_train_engine(config, total_steps: int, num_microbatches: int, run):
    """(engine, consumed samples): the model from ``model.load``, or everything from the
    checkpoint ``run`` (training/run.py) resumes from."""
    from megatron_rlhf.checkpoint import safe_pickle
    from megatron_rlhf.checkpoint.containment import require_contained
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.reward.model import NUM_OUTPUTS
    from megatron_rlhf.training.command import use_bf16
    from megatron_rlhf.training.deepspeed_engine import DeepSpeedTrainEngine

    num_outputs = NUM_OUTPUTS[config.loss]
    bf16 = use_bf16(config.train.bf16)
    if bf16 and not torch.cuda.is_available():
        raise InputError(
            "train.bf16=true with train.backend=deepspeed needs a GPU (DeepSpeed's bf16 is "
            "CUDA's); use train.bf16=auto, or the megatron backend for bf16 on a CPU"
        )
    resume_from = run.resume_from
    if resume_from is not None:
        require_contained(resume_from)  # DeepSpeed's own files too: no symlink out of the run
        saved = read_metadata(resume_from)
        if saved.get("backend") != "deepspeed" or saved.get("num_scalar_outputs") != num_outputs:
            raise InputError(
                f"{resume_from}: was written by backend={saved.get('backend', 'megatron')!r} "
                f"with loss={saved.get('loss')!r}; backend=deepspeed loss={config.loss!r} "
                "cannot resume it; choose another train.output_dir"
            )
    source = resume_from if resume_from is not None else config.model.load
    model = load_scalar_bloom(source, num_outputs, torch.bfloat16 if bf16 else torch.float32)
    engine = DeepSpeedTrainEngine(
        model,
        config.optim,
        total_steps,
        config.deepspeed,
        micro_batch_size=config.train.micro_batch_size,
        num_microbatches=num_microbatches,
        bf16=bf16,
        activation_checkpointing=config.train.recompute_activations,
    )
    if resume_from is None:
        return engine, 0
    engine.engine.checkpoint_engine.load = safe_pickle.deepspeed_loader  # never weights_only=False
    engine.engine.load_checkpoint(
        str(resume_from / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, load_lr_scheduler_states=False
    )
    state = json.loads((resume_from / TRAINER_STATE).read_text())
    engine.load_scheduler_state(state["scheduler"])
    _restore_rng(resume_from)
    run.resumed(state)
    return engine, state["consumed_samples"]


def load_scalar_bloom(directory, num_outputs: int, dtype: torch.dtype):
    """A :class:`ScalarBloom` from a Hugging Face BLOOM directory (a fresh head unless it has a
    ``score`` head of this width) or from a checkpoint of this backend."""
    from megatron_rlhf.checkpoint import HF_FORMAT, is_hf_checkpoint
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.checkpoint.hf_io import HFReader
    from megatron_rlhf.checkpoint.hf_names import canonical_hf_name
    from megatron_rlhf.training.deepspeed_engine import ScalarBloom

    if not is_hf_checkpoint(directory) and read_metadata(directory).get("format") != HF_FORMAT:
        raise InputError(
            f"{directory}: a Megatron checkpoint; backend=deepspeed loads Hugging Face weights: "
            f"convert it with `tools/convert_checkpoint.py megatron-to-hf --load {directory} "
            "--save DIR` and set model.load=DIR"
        )
    reader = HFReader(directory, head="scalar")
    model = ScalarBloom(reader.arch, num_outputs, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            hf_name = canonical_hf_name(name)
            if hf_name.startswith("score.") and not reader.has(hf_name):
                continue  # a fresh head on a trunk
            tensor = reader.get_slice(hf_name, None, 0, 1)
            if tuple(tensor.shape) != tuple(param.shape):
                raise InputError(
                    f"{directory}: {hf_name} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(param.shape)}; a {'RM' if num_outputs == 1 else 'AM'} "
                    "needs a score head of that width (or none)"
                )
            param.copy_(tensor.to(dtype))
    return model


def save_checkpoint(
    engine, output_dir: Path, metadata: dict, trainer_state: dict, tokenizer_dir
) -> Path:
    """Write ``output_dir/step_N`` (see the module docstring; ``metadata`` goes into its
    ``megatron_rlhf.json``) atomically and point ``latest_checkpoint.txt`` at it; collective
    over every rank."""
    from megatron_rlhf.checkpoint import manifest
    from megatron_rlhf.checkpoint.dist import METADATA_FILE, copy_tokenizer_files
    from megatron_rlhf.training.checkpointing import point_latest, rng_state

    metadata = checkpoint_metadata(engine, **metadata)
    final = output_dir / f"step_{metadata['step']:07d}"
    partial = final.with_name(final.name + ".tmp-partial")
    if is_rank0():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    engine.engine.save_checkpoint(str(partial / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
    (partial / "rank_state").mkdir(exist_ok=True)
    write_json(partial / "rank_state" / f"{dist.get_rank():05d}.json", rng_state())
    weights = engine.consolidated_state_dict()  # collective; rank 0 only
    if is_rank0():
        from safetensors.torch import save_file

        save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
        hf_config = engine.module.arch.to_hf_dict()
        hf_config.update(
            architectures=["BloomForSequenceClassification"],
            num_labels=engine.module.num_scalar_outputs,
            torch_dtype=metadata["dtype"],
        )
        write_json(partial / "config.json", hf_config)
        write_json(
            partial / TRAINER_STATE, {**trainer_state, "scheduler": engine.scheduler_state()}
        )
        write_json(partial / METADATA_FILE, metadata)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, partial)
    dist.barrier()
    manifest.write_manifest(partial)  # collective: sizes and SHA-256 of every file, last
    if is_rank0():
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    point_latest(output_dir, final)
    return final


def checkpoint_metadata(engine, **extra) -> dict:
    """``megatron_rlhf.json`` of a checkpoint of this backend (as checkpoint.dist's, plus the
    format and backend)."""
    from megatron_rlhf.checkpoint import HF_FORMAT
    from megatron_rlhf.checkpoint.dist import model_metadata

    return model_metadata(engine.module, format=HF_FORMAT, backend="deepspeed", **extra)


def _restore_rng(directory: Path) -> None:
    from megatron_rlhf.training.checkpointing import set_rng_state

    path = directory / "rank_state" / f"{dist.get_rank():05d}.json"
    if path.exists():
        set_rng_state(json.loads(path.read_text()))
