"""What ``setup.py`` declares: extras spelled as pip < 23.3 reads them, pins that hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# The extras transformer-engine 2.20.2 declares (its wheel's METADATA, Provides-Extra lines).
TE_2_20_2_EXTRAS = {"core", "core-cu12", "core-cu13", "pytorch", "jax"}


def setup_arguments() -> dict:
    """The keyword arguments ``setup.py`` passes to ``setup()`` (nothing is built)."""
    import setuptools

    with (
        mock.patch.object(setuptools, "setup") as setup,
        mock.patch.object(sys, "argv", ["setup.py"]),
    ):
        code = compile((REPO / "setup.py").read_text(), str(REPO / "setup.py"), "exec")
        exec(code, {"__name__": "__main__", "__file__": str(REPO / "setup.py")})
    ((_, kwargs),) = [(c.args, c.kwargs) for c in setup.call_args_list]
    return kwargs


def pep685(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_requested_extra_is_normalised_and_declared_by_its_package():
    """pip < 23.3 compares extras as written: `transformer-engine[core_cu12]` matched none of
    TE's declared `core-cu12` and installed TE without its core library."""
    kwargs = setup_arguments()
    requirements = [Requirement(r) for r in kwargs["install_requires"]]
    for extra, items in kwargs["extras_require"].items():
        assert extra == pep685(extra), extra
        requirements += [Requirement(r) for r in items]
    for requirement in requirements:
        for extra in requirement.extras:
            assert extra == pep685(extra), f"{requirement}: extra {extra!r} is not normalised"
        if requirement.name == "transformer-engine":
            assert requirement.extras <= TE_2_20_2_EXTRAS, requirement
            assert str(requirement.specifier) == "==2.20.2", requirement


def test_torch_range_admits_the_gpu_image_and_ci():
    kwargs = setup_arguments()
    (torch,) = [Requirement(r) for r in kwargs["install_requires"] if r.startswith("torch")]
    for version in ("2.11.0", "2.13.0"):
        assert torch.specifier.contains(version), (torch, version)
    assert not torch.specifier.contains("2.10.0")


# Run in a fresh interpreter whose working directory is the repo root, as the README's commands
# are: the current directory is then first on sys.path, so a regular package named `kernels` at
# the root would be found before Hugging Face's (transformers >= 5.20 imports it).
_WHICH_KERNELS = """
import importlib.metadata, pathlib, sys
import kernels
import megatron_rlhf.kernels as ours
print(sys.path[0] in ("", str(pathlib.Path.cwd())))
print(importlib.metadata.version("kernels"))
print(pathlib.Path(kernels.__file__ or "<namespace>").resolve())
print(pathlib.Path(ours.__file__).resolve())
"""


def _hugging_face_kernels_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip('Hugging Face\'s `kernels` is not installed: pip install -e ".[test]"')


@pytest.mark.launch  # starts Python in the repo root
def test_a_process_started_in_the_repo_root_imports_hugging_faces_kernels_and_ours(tmp_path):
    """`python -m megatron_rlhf demo` from the repo root failed with transformers 5.25 ("cannot
    import name 'CUDAProperties' from 'kernels' (<repo>/kernels/__init__.py)"): our top-level
    folder hid the installed package. Both `python -c` and `python -m` put the root first."""
    version = _hugging_face_kernels_version()
    (tmp_path / "which_kernels.py").write_text(_WHICH_KERNELS)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))  # after the root: -m finds the probe there
    for argv in (["-c", _WHICH_KERNELS], ["-m", "which_kernels"]):
        proc = subprocess.run(
            [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        root_first, seen_version, theirs, ours = proc.stdout.split()
        assert root_first == "True", "the probe did not run with the repo root first on sys.path"
        assert seen_version == version
        assert REPO not in Path(theirs).parents, f"`import kernels` found {theirs}, not HF's"
        assert Path(ours) == REPO / "kernels" / "fused" / "__init__.py" or "site-packages" in ours


# Megatron-Core's `jit_fuser` helpers (megatron_rlhf/__init__.py): what a process that imports
# our package first gets, and whether our BLOOM reaches any helper with Megatron's default kept.
_JIT_OFF_PROBE = """
import json, sys
import megatron_rlhf.models.bloom.model, megatron_rlhf.ppo.train_cli
import megatron.core.jit, megatron.core.transformer.utils as utils
print(json.dumps({
    "jit_fuser": megatron.core.jit.jit_fuser.__name__,
    "gelu_impl_plain": not hasattr(utils.gelu_impl, "_torchdynamo_orig_callable"),
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": sorted(m for m in sys.modules if m.startswith("torch._inductor"))[:3],
}))
"""

# Megatron's default kept: `torch.compile` is replaced, before Megatron-Core is imported, by a
# decorator that records each helper it wraps and each call of one; then a tiny BLOOM's lm and
# scalar models run a training forward and backward on a ragged batch and a sampled generation.
_JIT_CALLS_PROBE = """
import functools, json, torch
wrapped, called = [], []
def record(fn=None, **kwargs):
    if fn is None:
        return record
    wrapped.append(fn.__qualname__)
    @functools.wraps(fn)
    def helper(*args, **kw):
        called.append(fn.__qualname__)
        return fn(*args, **kw)
    return helper
torch.compile = record
from megatron_rlhf.distributed import destroy, initialize
from megatron_rlhf.generation import SamplingConfig, generate
from megatron_rlhf.models.bloom import BloomModel
from megatron_rlhf.models.bloom.tiny import tiny_architecture
initialize()
arch = tiny_architecture(vocab_size=97)
torch.manual_seed(0)
ids = torch.randint(0, 97, (3, 7))
mask = torch.ones(3, 7, dtype=torch.long)
mask[0, :4] = 0
mask[2, :1] = 0
for head in ("lm", "scalar"):
    model = BloomModel(arch, head=head, num_scalar_outputs=1).train()
    model(ids, mask).float().square().mean().backward()
model = BloomModel(arch, head="lm")
generate(model, ids, mask, SamplingConfig(max_new_tokens=4, seed=1))
destroy()
print(json.dumps({"wrapped": wrapped, "called": sorted(set(called))}))
"""


def _probe(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (the switch as this caller sets it, not as the
    environment running the tests does); return the JSON it prints last."""
    import json

    from megatron_rlhf import MEGATRON_JIT_ENV

    inherited = {k: v for k, v in os.environ.items() if k != MEGATRON_JIT_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(inherited, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.launch  # fresh interpreters: the switch acts as Megatron-Core is first imported
def test_megatron_helpers_stay_uncompiled_and_bloom_calls_none_of_them():
    """Megatron-Core wraps its small helpers in torch.compile at import, which imports TorchDynamo
    and Inductor (~2 s of every process's start-up here); our package turns Megatron's own
    `jit_fuser` off first. That is only free if our BLOOM never calls one of those helpers:
    checked with Megatron's default kept and every wrapped helper recorded."""
    seen = _probe(_JIT_OFF_PROBE)
    assert seen["jit_fuser"] == "noop_decorator", seen
    assert seen["gelu_impl_plain"], seen
    assert not seen["dynamo"] and not seen["inductor"], seen

    calls = _probe(_JIT_CALLS_PROBE, MEGATRON_RLHF_MEGATRON_JIT="compile")
    assert "gelu_impl" in calls["wrapped"] and len(calls["wrapped"]) >= 8, calls["wrapped"]
    assert calls["called"] == [], f"our BLOOM calls Megatron-Core's compiled helpers: {calls}"


def test_the_megatron_jit_switch_is_kept_off_where_asked_or_too_late(monkeypatch):
    """`MEGATRON_RLHF_MEGATRON_JIT=compile` keeps Megatron-Core's default, and a process that
    imported Megatron-Core before our package (this one) is left as it is."""
    import megatron.core  # noqa: F401

    import megatron_rlhf

    before = list(sys.meta_path)
    monkeypatch.setenv(megatron_rlhf.MEGATRON_JIT_ENV, "compile")
    assert megatron_rlhf._megatron_helpers_uncompiled() is False
    monkeypatch.delenv(megatron_rlhf.MEGATRON_JIT_ENV)
    assert megatron_rlhf._megatron_helpers_uncompiled() is False  # megatron.core.jit is loaded
    assert sys.meta_path == before


def test_this_pytest_process_sees_hugging_faces_kernels():
    """The README's test command runs pytest from the repo root (root on sys.path)."""
    import importlib.util

    _hugging_face_kernels_version()
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin not in (None, "namespace"), spec
    assert REPO not in Path(spec.origin).resolve().parents, spec.origin


def test_no_regular_package_at_the_root_shares_a_name_with_an_installed_distribution():
    """Any root folder with an `__init__.py` is importable under its own name from the root: only
    our own package may be one (`kernels/`, `tools/`, `tests/`... must not)."""
    packages = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["megatron_rlhf"], packages


def _locked() -> dict[str, str]:
    pins = {}
    for number, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt:{number}: {line!r} is not NAME==VERSION"
            pins[pep685(name)] = version
    return pins


def test_the_lock_pins_every_requirement_of_both_readme_installs_within_setup_py():
    """Both README commands install through constraints.txt: every package the `cpu`, `test` and
    `vllm` installs ask for is pinned there, at a version setup.py admits (refresh with
    `bash .ci/refresh-lock` after changing a requirement)."""
    kwargs, locked = setup_arguments(), _locked()
    wanted = list(kwargs["install_requires"])
    for extra in ("cpu", "test", "vllm"):
        wanted += kwargs["extras_require"][extra]
    for requirement in map(Requirement, wanted):
        name = pep685(requirement.name)
        assert name in locked, f"{name} is not in constraints.txt: bash .ci/refresh-lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"constraints.txt pins {name}=={locked[name]}, outside setup.py's {requirement}"
        )


def test_both_readme_commands_install_through_the_lock():
    readme = (REPO / "README.md").read_text()
    commands = [
        line.strip() for line in readme.splitlines()
        if line.startswith("    pip install torch==")
        and ("megatron_rlhf demo" in line or "python -m pytest" in line)
    ]  # fmt: skip
    assert len(commands) == 2, commands
    for command in commands:
        assert '" -c constraints.txt &&' in command, command
