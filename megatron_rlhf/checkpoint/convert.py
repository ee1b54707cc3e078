"""Hugging Face BLOOM <-> Megatron-Core checkpoints (``tools/convert_checkpoint.py``).

hf-to-megatron: every process of a tp*pp launch builds its own stage/shard of the model, reads
only its slices from the safetensors files, and Megatron-Core's ``dist_checkpointing`` writes
the shards. The result loads at any TP/PP layout. Started without torchrun and tp*pp > 1, the
command relaunches itself under torchrun with tp*pp processes.

megatron-to-hf: the checkpoint is loaded at TP=1 and PP=--pp (resharded by dist_checkpointing);
each pipeline stage writes its own layers as one safetensors shard, so a process holds 1/pp of
the model. Padded vocab rows are dropped; rank 0 writes the index, config and tokenizer. A
``train-ppo`` checkpoint holds two models: ``--role actor`` (the default) exports the trained
policy as a ``BloomForCausalLM``, ``--role critic`` the value model as a 1-label
``BloomForSequenceClassification`` (as a reward-model export).
A ``train-reward backend=deepspeed`` checkpoint already holds HF safetensors: megatron-to-hf
copies them out, and hf-to-megatron reads it like any HF directory.

Scalar heads (reward, advantage and value models) travel as ``BloomForSequenceClassification``'s
``score.weight`` plus a ``score.bias``; hf-to-megatron takes the head type and width from
``config.json`` (``architectures``, ``num_labels``) unless --head is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_rlhf.distributed.layouts import (
    add_parallel_arguments,
    parallel_from_args,
    validate_layouts,
)
from megatron_rlhf.utils import InputError, check_writable_parent, print_summary, run_command


def hf_to_megatron(args) -> int:
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint.hf_io import HFReader, load_hf_into_model
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.runtime import locks

    _default_head(args)
    reader = HFReader(args.load, head=args.head)
    arch = reader.arch
    validate_layouts({"": (args.tp, args.pp)}, args.tp * args.pp, {"": arch})  # before a launch
    _check_tokenizer_vocab(args.load, arch.vocab_size)
    _check_save(args)
    if "WORLD_SIZE" not in os.environ and args.tp * args.pp > 1:
        return _relaunch_under_torchrun(args.tp * args.pp)
    locks.lock_output(args.save, "--save")  # rank 0 of the (re)launched processes
    if int(os.environ.get("WORLD_SIZE", "1")) != args.tp * args.pp:
        raise InputError(
            f"launched with {os.environ.get('WORLD_SIZE')} processes; hf-to-megatron needs "
            f"exactly tp*pp = {args.tp * args.pp}"
        )
    start = time.time()
    initialize(args.tp, args.pp, arch=arch)
    model = BloomModel(
        arch, head=args.head, num_scalar_outputs=args.num_scalar_outputs, init_weights=False
    )
    load_hf_into_model(model, reader)
    hf_dtype = reader.get_rows("word_embeddings.weight", 0, 1).dtype  # megatron-to-hf restores it
    meta = dist_ckpt.model_metadata(
        model,
        source=str(Path(args.load).resolve()),
        hf_dtype=str(hf_dtype).removeprefix("torch."),
    )
    dist_ckpt.save(
        args.save, model.sharded_state_dict(), meta, tokenizer_dir=args.load,
        overwrite=args.overwrite,
    )  # fmt: skip
    destroy()
    print_summary(
        "hf-to-megatron",
        save=args.save,
        tp=args.tp,
        pp=args.pp,
        layers=arch.num_layers,
        seconds=round(time.time() - start, 2),
    )
    return 0


def _default_head(args) -> None:
    """--head / --num-scalar-outputs from the HF config when not given (a sequence classifier
    is a scalar head with ``num_labels`` outputs)."""
    config_path = Path(args.load) / "config.json"
    hf_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    classifier = "BloomForSequenceClassification" in hf_config.get("architectures", [])
    if args.head is None:
        args.head = "scalar" if classifier else "lm"
    if args.num_scalar_outputs is None:
        args.num_scalar_outputs = hf_config.get("num_labels", 1) if classifier else 1


def _check_tokenizer_vocab(directory, vocab_size: int) -> None:
    tokenizer_json = Path(directory) / "tokenizer.json"
    if not tokenizer_json.exists():
        return
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    added = json.loads(tokenizer_json.read_text()).get("added_tokens", [])
    largest = max([*vocab.values(), *(t["id"] for t in added)], default=-1)
    if largest >= vocab_size:
        raise InputError(
            f"{tokenizer_json}: token id {largest} does not fit the model's vocab_size "
            f"{vocab_size} (config.json); the tokenizer belongs to another model"
        )


def _check_save(args) -> None:
    """Refuse an existing ``--save`` (unless ``--overwrite``) or one inside a file."""
    save = Path(args.save)
    if save.exists() and not args.overwrite:
        raise InputError(
            f"--save {save}: already exists; choose another directory or pass --overwrite"
        )
    if save.exists() and not save.is_dir():
        raise InputError(f"--save {save}: is a file; give a directory")
    check_writable_parent(save, "--save")


def _relaunch_under_torchrun(nproc: int) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--standalone", *sys.argv]  # a rendezvous on a port the OS picks: no race
    return subprocess.call(cmd)


def megatron_to_hf(args) -> int:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_rlhf.checkpoint import HF_FORMAT, role_view
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint.hf_io import INDEX_FILE, stage_layer_offset
    from megatron_rlhf.checkpoint.hf_names import full_hf_name, mapping_for
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.runtime import locks

    saved = dist_ckpt.read_metadata(args.load)
    if saved.get("format") == HF_FORMAT:
        return _copy_hf_format(args)
    meta, prefix = role_view(saved, args.role, args.load)
    arch, head = dist_ckpt.architecture_of(args.load), meta["head"]
    validate_layouts({"": (1, args.pp)}, args.pp, {"": arch})  # before a launch
    _check_save(args)
    if "WORLD_SIZE" not in os.environ and args.pp > 1:
        return _relaunch_under_torchrun(args.pp)
    locks.lock_output(args.save, "--save")
    if int(os.environ.get("WORLD_SIZE", "1")) != args.pp:  # each rank writes one stage's shard
        raise InputError(
            f"launched with {os.environ.get('WORLD_SIZE')} processes; megatron-to-hf needs "
            f"exactly --pp = {args.pp}"
        )
    start = time.time()
    initialize(pp=args.pp, arch=arch)
    model = BloomModel(
        arch,
        head=head,
        num_scalar_outputs=meta["num_scalar_outputs"] or 1,
        params_dtype=getattr(torch, meta.get("dtype", "float32")),
        init_weights=False,
    )
    loaded = dist_ckpt.load(args.load, model.sharded_state_dict(prefix=prefix))
    model.load_state_dict({name.removeprefix(prefix): value for name, value in loaded.items()})
    stage, offset = dist.get_rank(), stage_layer_offset(model)
    # A converted HF model goes back in its own dtype (bf16 -> fp32 -> bf16 is exact).
    export_dtype = meta.get("hf_dtype", meta.get("dtype", "float32"))
    to_dtype = getattr(torch, export_dtype)
    tensors = {}
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            continue  # tied to the word embedding, which the first stage writes
        mapping = mapping_for(name, head, offset)
        tensor = param.detach()[: arch.vocab_size] if mapping.is_vocab else param.detach()
        tensors[full_hf_name(mapping.hf_name)] = tensor.to(to_dtype).contiguous()
    final, partial = Path(args.save), Path(args.save + ".tmp-partial")
    if stage == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    file = f"model-{stage + 1:05d}-of-{args.pp:05d}.safetensors"
    save_file(tensors, partial / file, {"format": "pt"})
    weight_maps = [None] * args.pp
    dist.all_gather_object(weight_maps, {name: file for name in tensors})
    if stage == 0:
        weight_map = {name: f for stage_map in weight_maps for name, f in stage_map.items()}
        total = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        hf_config = arch.to_hf_dict()
        hf_config["torch_dtype"] = export_dtype
        if head == "scalar":
            hf_config["architectures"] = ["BloomForSequenceClassification"]
            hf_config["num_labels"] = meta["num_scalar_outputs"]
        (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        dist_ckpt.copy_tokenizer_files(args.load, partial)
        if final.exists():  # --overwrite: the old export goes only once the new one is complete
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    destroy()
    print_summary(
        "megatron-to-hf",
        save=args.save,
        pp=args.pp,
        layers=arch.num_layers,
        seconds=round(time.time() - start, 2),
    )
    return 0


def _copy_hf_format(args) -> int:
    """megatron-to-hf of a checkpoint already in HF safetensors: copy the model files out."""
    from megatron_rlhf.checkpoint.dist import copy_tokenizer_files

    _check_save(args)
    start = time.time()
    source, partial = Path(args.load), Path(args.save + ".tmp-partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for file in [source / "config.json", *source.glob("model*.safetensors*")]:
        shutil.copy2(file, partial / file.name)
    copy_tokenizer_files(source, partial)
    partial.rename(args.save)
    print_summary("megatron-to-hf", save=args.save, copied="hf-format checkpoint",
                  seconds=round(time.time() - start, 2))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/convert_checkpoint.py",
        description="Convert BLOOM checkpoints between Hugging Face and Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron dist checkpoint")
    to_mcore.add_argument("--load", required=True, help="Hugging Face BLOOM directory")
    to_mcore.add_argument("--save", required=True, help="output checkpoint directory (new)")
    add_parallel_arguments(to_mcore)  # the layout to convert at
    to_mcore.add_argument(
        "--head",
        choices=("lm", "scalar"),
        default=None,
        help="default: scalar for a BloomForSequenceClassification config.json, else lm",
    )
    to_mcore.add_argument(
        "--num-scalar-outputs",
        type=int,
        default=None,
        help="scalar head width (AM: 2); default: config.json's num_labels, else 1",
    )
    to_mcore.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    to_hf = sub.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--load", required=True, help="megatron-rlhf checkpoint directory")
    to_hf.add_argument("--save", required=True, help="output Hugging Face directory (new)")
    add_parallel_arguments(to_hf)  # pp: processes to split the layers over (each writes 1/pp)
    to_hf.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    to_hf.add_argument(
        "--role",
        choices=("actor", "critic"),
        help="train-ppo checkpoints: export the policy (actor, the default) or the value model "
        "(critic, as a 1-label BloomForSequenceClassification)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    convert = hf_to_megatron if args.direction == "hf-to-megatron" else megatron_to_hf
    return run_command(args.direction, lambda: convert(_layout(args)), distributed=True)


def _layout(args):
    """``--parallel``/``--tp``/``--pp`` into ``args.tp``/``args.pp``; megatron-to-hf splits
    layers only (each process writes the safetensors shard of its stage)."""
    parallel_from_args(args)
    if args.direction == "megatron-to-hf" and args.tp != 1:
        raise InputError(
            f"megatron-to-hf: tp={args.tp}: the export splits layers only; give pp=N "
            "(the checkpoint loads at any layout)"
        )
    return args
