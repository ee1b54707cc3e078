"""No code from a checkpoint, and no checkpoint from outside its run (issue 24, items 3-4).

Each tampered checkpoint here is *manifest-consistent*: its ``manifest.json`` entry is rewritten
to the tampered file's size and SHA-256, as an attacker who can write the directory would, so the
checksum check passes and only the unpickling rules stand between the file and its payload. The
payload would create a marker file; every test asserts that the load is refused with the file's
name and that the marker does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint_integrity import reward_argv as integrity_reward_argv
from test_checkpoint_integrity import reward_setup  # noqa: F401  (fixture)

ARCH = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, max_sequence_length=32)


class Payload:
    """Unpickling this writes ``marker``: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory) -> Path:
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    root = tmp_path_factory.mktemp("safety")
    random_hf_bloom(BloomArchitecture(**ARCH), seed=0).save_pretrained(root / "hf")
    assert convert(["hf-to-megatron", "--load", str(root / "hf"), "--save", str(root / "lm")]) == 0
    return root / "lm"


def rewrite_manifest_entry(checkpoint: Path, name: str) -> None:
    """Make ``manifest.json`` agree with the (tampered) file ``name``."""
    path = checkpoint / "manifest.json"
    manifest = json.loads(path.read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def tampered_copy(source: Path, target: Path, name: str, marker: Path) -> Path:
    """A copy of ``source`` whose ``name`` carries a :class:`Payload` beside its real content."""
    shutil.copytree(source, target)
    if name == ".metadata":
        from megatron_rlhf.checkpoint.safe_pickle import load_metadata

        metadata = load_metadata(target / name)  # the restricted reader: no raw unpickling
        metadata.planner_data = {"payload": Payload(marker)}
        (target / name).write_bytes(pickle.dumps(metadata))
    else:
        common = torch.load(target / name, weights_only=True)
        torch.save({**common, "payload": Payload(marker)}, target / name)
    rewrite_manifest_entry(target, name)
    return target


def load_lm(directory: Path):
    """``load_bloom`` in a one-rank Megatron world, torn down afterwards."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import parallel

    parallel.initialize()
    try:
        return load_bloom(directory)
    finally:
        parallel.destroy()


def test_metadata_pickle_with_a_payload_is_refused_and_nothing_runs(lm_checkpoint, tmp_path):
    from megatron_rlhf.utils import InputError

    marker = tmp_path / "ran"
    bad = tampered_copy(lm_checkpoint, tmp_path / "ckpt", ".metadata", marker)
    with pytest.raises(InputError, match=r"ckpt/\.metadata: refers to builtins\.exec, which"):
        load_lm(bad)
    assert not marker.exists()


def test_every_torch_reader_of_metadata_is_restricted(lm_checkpoint, tmp_path):
    """Megatron and torch read ``.metadata`` through ``FileSystemReader`` in several places
    (load_tensors_metadata, the cached reader): all of them go through the restricted reader."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rlhf.checkpoint import dist  # noqa: F401  (installs the restricted reader)
    from megatron_rlhf.checkpoint.safe_pickle import UnsafeCheckpointError

    marker = tmp_path / "ran"
    bad = tampered_copy(lm_checkpoint, tmp_path / "ckpt", ".metadata", marker)
    for reader in (FileSystemReader(str(bad)), CachedMetadataFileSystemReader(str(bad))):
        with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
            reader.read_metadata()
    assert not marker.exists()
    good = FileSystemReader(str(lm_checkpoint)).read_metadata()
    assert good.state_dict_metadata and good.storage_data


def test_common_pt_with_a_payload_is_refused_and_nothing_runs(lm_checkpoint, tmp_path):
    from megatron_rlhf.utils import InputError

    marker = tmp_path / "ran"
    bad = tampered_copy(lm_checkpoint, tmp_path / "ckpt", "common.pt", marker)
    with pytest.raises(InputError, match=r"ckpt/common\.pt: refers to exec, which"):
        load_lm(bad)
    assert not marker.exists()


def test_loading_refuses_to_run_while_torch_load_unpickles_everything(
    lm_checkpoint, tmp_path, monkeypatch
):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD would make Megatron's ``torch.load(common.pt)`` run
    the payload: loading refuses instead."""
    from megatron_rlhf.utils import InputError

    marker = tmp_path / "ran"
    bad = tampered_copy(lm_checkpoint, tmp_path / "ckpt", "common.pt", marker)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(InputError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"):
        load_lm(bad)
    assert not marker.exists()


def test_generate_command_refuses_a_tampered_metadata_with_one_line(
    lm_checkpoint, tmp_path, capsys
):
    from megatron_rlhf.generation.cli import main as generate

    marker = tmp_path / "ran"
    bad = tampered_copy(lm_checkpoint, tmp_path / "ckpt", ".metadata", marker)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    argv = ["--load", str(bad), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    assert generate([*argv, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ckpt/.metadata: refers to builtins.exec" in err
    assert not marker.exists() and not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- paths stay inside the run


def reward_argv(setup, output: Path, steps: int) -> list[str]:
    """train-reward for ``steps`` steps, a checkpoint every step."""
    return integrity_reward_argv(setup, output, f"train.steps={steps}", "train.save_interval=1")


def test_a_step_that_is_a_symlink_to_another_run_is_not_resumed(
    reward_setup,  # noqa: F811
    tmp_path,
    capsys,
):
    from megatron_rlhf.reward.train import main

    other, run = tmp_path / "other", tmp_path / "run"
    assert main(reward_argv(reward_setup, other, steps=2)) == 0
    assert main(reward_argv(reward_setup, run, steps=1)) == 0
    shutil.rmtree(run / "step_0000001")
    (run / "step_0000001").symlink_to(other / "step_0000002", target_is_directory=True)
    capsys.readouterr()
    assert main(reward_argv(reward_setup, run, steps=3)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{run / 'step_0000001'}: resolves to {other / 'step_0000002'}, outside {run}" in err
    assert "symlinks out of it are refused" in err
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_0000001"]


def test_latest_pointing_at_a_symlinked_step_is_refused(lm_checkpoint, tmp_path):
    from megatron_rlhf.training.checkpointing import checkpoint_in, latest_checkpoint
    from megatron_rlhf.utils import InputError

    run = tmp_path / "run"
    run.mkdir()
    (run / "step_0000005").symlink_to(lm_checkpoint, target_is_directory=True)
    (run / "latest_checkpoint.txt").write_text("step_0000005\n")
    for read in (latest_checkpoint, checkpoint_in):
        with pytest.raises(InputError, match=r"step_0000005: resolves to .*/lm, outside"):
            read(run)


def test_a_shard_that_is_a_symlink_out_of_the_checkpoint_is_refused(lm_checkpoint, tmp_path):
    """The shard's content is identical, so its manifest entry still matches: only the path
    check stands in the way."""
    from megatron_rlhf.utils import InputError

    shutil.copytree(lm_checkpoint, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    shutil.move(shard, tmp_path / "elsewhere.distcp")
    shard.symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(InputError, match=r"ckpt/__0_0\.distcp: resolves to .*elsewhere\.distcp"):
        load_lm(tmp_path / "ckpt")
    (tmp_path / "linked").symlink_to(lm_checkpoint, target_is_directory=True)
    assert load_lm(tmp_path / "linked") is not None  # a --load that is itself a symlink is fine


@pytest.mark.chaos
def test_deepspeed_states_with_a_payload_are_refused_on_resume(
    reward_setup,  # noqa: F811
    tmp_path,
):
    """DeepSpeed's own loader unpickles ``*_states.pt`` with ``weights_only=False``; resuming
    a backend=deepspeed run goes through a weights-only loader instead."""
    import subprocess
    import sys

    from megatron_rlhf.checkpoint.safe_pickle import DEEPSPEED_GLOBALS, weights_only_load

    run, marker = tmp_path / "run", tmp_path / "ran"
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)

    def launch(steps: int):
        argv = [*reward_argv(reward_setup, run, steps), "backend=deepspeed"]
        command = [sys.executable, "-m", "megatron_rlhf", "train-reward", *argv]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)

    assert launch(1).returncode == 0
    checkpoint = run / "step_0000001"
    [states] = checkpoint.glob("deepspeed/*/*optim_states.pt")
    name = str(states.relative_to(checkpoint))
    saved = weights_only_load(states, "cpu", DEEPSPEED_GLOBALS)
    torch.save({**saved, "payload": Payload(marker)}, states)
    rewrite_manifest_entry(checkpoint, name)
    resumed = launch(2)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"{states}: refers to exec, which" in resumed.stderr
    assert not marker.exists()
