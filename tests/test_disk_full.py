"""A disk that fills during a checkpoint save says so (issue 47, item 7).

The save of step 2 fails for lack of space: the run ends with exit code 2 and one line that
names the partial directory, the bytes this rank's tensors need and the bytes free, and the
last checkpoint (step 1) that is intact and still ``latest``; the partial save is removed. Two
ways a full disk shows up: an ``OSError(ENOSPC)`` from a shard's ``open``/``write``, and torch's
zip writer's ``RuntimeError: ... unexpected pos 704 vs 598`` (its errno lost; told apart by
the free space). Both reach us wrapped in torch's ``CheckpointException``. Before, the first
gave one line without the last checkpoint or the sizes, the second a traceback.
"""

from __future__ import annotations

import errno
import shutil

import pytest
from ppo_fixtures import launcher_env_kept
from test_reward_train import save_hf_bloom, write_synthetic_pairs


@pytest.fixture(scope="module")
def reward_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_full")
    return {
        "data": write_synthetic_pairs(root / "pairs", pairs_per_task=10),
        "trunk": save_hf_bloom(root / "hf", num_outputs=None, seed=2),
    }


def reward_argv(setup, run, steps: int) -> list[str]:
    """A train-reward run in ``run`` saving after every step."""
    return [
        f"model.load={setup['trunk']}", f"data.train={setup['data']}",
        f"train.output_dir={run}", "train.global_batch_size=4", "train.micro_batch_size=4",
        "train.eval_interval=0", f"train.steps={steps}", "train.save_interval=1",
    ]  # fmt: skip


def _fail_step_2_shards(monkeypatch, error):
    """Every shard file of step 2 fails to open with ``error`` (Megatron's writer opens each
    through its module's ``open``); step 1's are written."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def opener(file_name, mode="r", *args, **kwargs):
        if "step_0000002" in str(file_name) and "w" in mode:
            raise error(file_name)
        return open(file_name, mode, *args, **kwargs)

    monkeypatch.setattr(filesystem_async, "open", opener, raising=False)


@pytest.mark.parametrize("failure", ["enospc", "unexpected_pos"])
def test_a_full_disk_during_a_save_says_so_and_keeps_the_last_checkpoint(
    failure, reward_setup, tmp_path, monkeypatch, capsys
):
    from megatron_rlhf.reward.train import main

    if failure == "enospc":
        _fail_step_2_shards(
            monkeypatch, lambda name: OSError(errno.ENOSPC, "No space left on device", name)
        )
    else:  # what a real full disk gives: the errno is lost inside torch's zip writer
        _fail_step_2_shards(
            monkeypatch, lambda name: RuntimeError("[enforce fail] unexpected pos 704 vs 598")
        )
        real = shutil.disk_usage
        monkeypatch.setattr(
            shutil, "disk_usage", lambda path: real(path)._replace(free=4096)
        )  # a disk with 4 KiB left
    run = tmp_path / "run"
    with launcher_env_kept():
        assert main(reward_argv(reward_setup, run, steps=2)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [row for row in err.splitlines() if "error:" in row]
    assert len(line) == 1, err
    line = line[0]
    assert f"{run / 'step_0000002.tmp-partial'}: no space left on device" in line
    assert "this rank's tensors need about " in line and " bytes were free there" in line
    if failure == "unexpected_pos":
        assert "4,096 bytes were free there" in line
    assert f"the last checkpoint {run / 'step_0000001'} is intact" in line
    assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000001"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0000001"]  # partial removed


def test_a_real_small_filesystem_fills_on_the_second_save(reward_setup, tmp_path, capsys):
    """The same on a 3.5 MB tmpfs (one ~2.2 MB checkpoint fits, two do not); needs the
    permission to mount, else skipped."""
    import subprocess

    from megatron_rlhf.reward.train import main

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3500k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = disk / "run"
        with launcher_env_kept():
            assert main(reward_argv(reward_setup, run, steps=3)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert f"{run / 'step_0000002.tmp-partial'}: no space left on device" in err
        assert f"the last checkpoint {run / 'step_0000001'} is intact" in err
        assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000001"
        assert sorted(p.name for p in run.glob("step_*")) == ["step_0000001"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_another_save_failure_is_not_called_a_full_disk(tmp_path):
    """A failure with space to spare and no ENOSPC stays what it was."""
    from megatron_rlhf.checkpoint.dist import out_of_space

    error = RuntimeError("[enforce fail] unexpected pos 704 vs 598")
    assert out_of_space(error, tmp_path / "step_1.tmp-partial", {}) is None
    denied = OSError(errno.EACCES, "Permission denied", str(tmp_path))
    assert out_of_space(denied, tmp_path / "step_1.tmp-partial", {}) is None
