"""The wheels the GPU check carries to the bare CUDA image (no network there, 64 MiB carried).

    python benchmarks/gpu_wheelhouse.py --build      # download/build into .whl/ and verify
    python benchmarks/gpu_wheelhouse.py --check      # verify an existing .whl/ against the lock
    python benchmarks/gpu_wheelhouse.py --plan       # what would be carried, from the lock alone

The image (Python 3.12, torch 2.11+cu130, Triton 3.6, transformers 5.17, numpy, psutil, einops,
msgpack, ninja, py-cpuinfo, tqdm, matplotlib, tensorboard, pytest, …) lacks megatron-core,
DeepSpeed and DeepSpeed's hjson and pydantic (with pydantic-core, annotated-types,
typing-inspection and a recent typing-extensions). ``benchmarks/gpu_wheelhouse.json`` pins each:
name, version, file, SHA-256 and size. Binary wheels are downloaded for CPython 3.12 on manylinux
x86-64; DeepSpeed publishes only an sdist, which is built here into a pure-Python wheel
(``DS_BUILD_OPS=0``: its CUDA ops are JIT-compiled on the GPU when used), its sdist's SHA-256
pinned. Transformer Engine (its cu13 core wheel alone is 276.5 MB; ``transformer_engine_torch``
is source only), faiss-gpu (no installable cu13 file) and vLLM do not fit or do not exist for
that image: the checks that need them report "not on this machine".

``.whl/`` is git-ignored; on the device machine name it in ``carry``. ``benchmarks/gpu_check.py``
installs it with ``pip install --no-index --no-deps --target``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "benchmarks" / "gpu_wheelhouse.json"
TARGET = {"python": "3.12", "implementation": "cp", "abi": "cp312"}
PLATFORMS = [
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64",
]  # fmt: skip
CARRY_LIMIT_BYTES = 64 * 2**20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_lock() -> dict:
    return json.loads(LOCK.read_text())


def _pip(*args: str, cwd: Path | None = None, env: dict | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"]
    try:  # a build of DeepSpeed's wheel takes ~1 min; a hung index or build must not hang us
        proc = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {' '.join(command)} did not finish in 900 s") from None
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {proc.returncode}:\n{proc.stderr}")


def fetch(wheel: dict, folder: Path) -> Path:
    """Download (or build from its pinned sdist) one locked wheel into ``folder``."""
    spec = f"{wheel['name']}=={wheel['version']}"
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if "sdist_sha256" not in wheel:
            platforms = [f"--platform={p}" for p in PLATFORMS]
            _pip("download", "--no-deps", "--only-binary=:all:", f"--python-version={TARGET['python']}",
                 f"--implementation={TARGET['implementation']}", f"--abi={TARGET['abi']}", "--abi=none",
                 "--abi=abi3", *platforms, "--platform=any", "-d", str(scratch), spec)  # fmt: skip
        else:
            _pip("download", "--no-deps", "--no-binary=:all:", "-d", str(scratch), spec)
            (sdist,) = scratch.glob("*.tar.gz")
            if sha256(sdist) != wheel["sdist_sha256"]:
                raise SystemExit(f"error: {sdist.name}: SHA-256 differs from {LOCK.name}")
            env = dict(os.environ, DS_BUILD_OPS="0")
            _pip(
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(scratch),
                str(sdist),
                env=env,
            )
        (built,) = scratch.glob(wheel["file"])
        target = folder / built.name
        shutil.move(str(built), target)
    return target


def verify(folder: Path, lock: dict) -> list[str]:
    """What in ``folder`` differs from the lock (missing files, other hashes, extra wheels)."""
    problems = []
    expected = {w["file"] for w in lock["wheels"]}
    for wheel in lock["wheels"]:
        path = folder / wheel["file"]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif "sha256" in wheel and sha256(path) != wheel["sha256"]:
            problems.append(f"{path}: SHA-256 differs from {LOCK.name}")
    problems += [f"{p}: not in {LOCK.name}" for p in folder.glob("*.whl") if p.name not in expected]
    return problems


def plan(lock: dict) -> int:
    total = sum(w["bytes"] for w in lock["wheels"])
    for wheel in lock["wheels"]:
        print(
            f"  {wheel['name']:<20} {wheel['version']:<10} {wheel['bytes'] / 2**20:6.2f} MiB  {wheel['why']}"
        )
    print(f"[gpu_wheelhouse] {len(lock['wheels'])} wheels, {total / 2**20:.1f} MiB "
          f"(the tree and the wheels share {CARRY_LIMIT_BYTES // 2**20} MiB)")  # fmt: skip
    return 0 if total < CARRY_LIMIT_BYTES else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_wheelhouse.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--build", action="store_true", help="download/build into --output")
    action.add_argument("--check", action="store_true", help="verify --output against the lock")
    action.add_argument("--plan", action="store_true", help="print what would be carried")
    parser.add_argument("--output", default=str(REPO / ".whl"), help="the wheelhouse folder")
    args = parser.parse_args(argv)
    lock = load_lock()
    if args.plan:
        return plan(lock)
    folder = Path(args.output)
    if args.build:
        folder.mkdir(parents=True, exist_ok=True)
        for wheel in lock["wheels"]:
            if not (folder / wheel["file"]).is_file():
                print(f"[gpu_wheelhouse] {wheel['name']}=={wheel['version']}", flush=True)
                fetch(wheel, folder)
    problems = verify(folder, lock)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"[gpu_wheelhouse] {folder}: {len(list(folder.glob('*.whl')))} wheels, "
          f"{size / 2**20:.1f} MiB, {len(problems)} problem(s)")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
