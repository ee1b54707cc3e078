"""Launch a worker script under torchrun once and read back the results of many checks.

A torchrun launch costs 10-15 s of imports on these machines, so each worker script runs many
checks in one launch and rank 0 writes ``{check_name: {"ok": bool, "detail": str}}`` as JSON.
Tests are then parametrised over the check names and read that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script: str | Path, nproc: int, out_json: Path, *args: str, timeout: int = 900):
    """Run ``torchrun --nproc-per-node nproc script --out out_json args`` on the CPU over gloo.

    Returns the parsed JSON written by rank 0; raises with the full log if the launch failed.
    """
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_free_port()),
        str(script),
        "--out",
        str(out_json),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out_json.exists():
        raise RuntimeError(
            f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    return json.loads(out_json.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
