"""What ``setup.py`` declares: extras spelled as pip < 23.3 reads them, pins that hold."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from unittest import mock

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
