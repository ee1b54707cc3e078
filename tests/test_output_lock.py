"""One command per output: every command that writes outside a training run locks its output
(``.<name>.lock`` beside it, runtime/locks.py) right after checking it, so a second command
on the same output exits 2 naming the holder, before it loads anything or writes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def held(tmp_path):
    """Hold the lock of an output path from another process (as a running command would)."""
    children = []

    def hold(path: Path, flag: str):
        script = (
            "import sys, time\n"
            "from megatron_rlhf.runtime.locks import lock_output\n"
            f"lock_output({str(path)!r}, {flag!r})\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        children.append(child)
        assert child.stdout.readline().strip() == "locked"
        return child

    yield hold
    for child in children:
        child.kill()
        child.wait()


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.launch
@pytest.mark.parametrize(
    "command, flag",
    [
        (["-m", "megatron_rlhf", "score", "--load", "{missing}", "--input", "{missing}"], "--output"),
        (["-m", "megatron_rlhf", "generate", "--load", "{missing}", "--prompts", "{missing}"],
         "--output"),
        (["-m", "megatron_rlhf", "eval-reward", "--scores", "{missing}"], "--output-dir"),
        (["tools/preprocess_data.py", "--input", "{missing}", "--kind", "sft", "--tokenizer", "{missing}"],
         "--output-prefix"),
    ],
)  # fmt: skip
def test_a_second_command_on_a_locked_output_exits_2_naming_the_holder(
    tmp_path, held, command, flag
):
    output = tmp_path / "out"
    holder = held(output, flag)
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in command]
    start = time.time()
    proc = _run([*argv, flag, str(output)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{flag} {output}: another run is using this output" in proc.stderr, proc.stderr
    assert f"pid {holder.pid}" in proc.stderr
    assert not output.exists()
    assert time.time() - start < 120


@pytest.mark.launch
def test_the_lock_is_released_when_the_command_ends(tmp_path):
    """A command that ends (here with a bad input after taking the lock) leaves no lock file,
    and the next command on the same output gets past the lock."""
    output = tmp_path / "scores.jsonl"
    argv = ["-m", "megatron_rlhf", "eval-reward", "--scores", str(tmp_path / "missing")]
    for _ in range(2):
        proc = _run([*argv, "--output-dir", str(output)])
        assert proc.returncode == 2 and "another run" not in proc.stderr, proc.stderr
    assert not list(tmp_path.glob(".*.lock"))
