"""What a test starts decides its marker, and its marker decides where it runs.

The markers (declared in ``pyproject.toml``) say what a test launches:

- ``launch``: it starts another Python process of one rank (a command, a script, the Triton
  interpreter's subprocess).
- ``e2e``: it runs one of our commands end to end (the demo, the study, a converter).
- ``chaos``: it signals or kills a running job and checks what is left and the resume.

``ranks=N`` on any of them (``launch(ranks=4)``) says it runs a torchrun launch of N ranks.
Each of them implies ``slow``, so ``-m "not slow"`` stays the quick, in-process subset.

**The guard.** A test that starts a Python interpreter (``subprocess`` or a ``multiprocessing``
spawn), in its body or in a fixture it sets up, fails unless it carries one of the three markers:
a launch costs seconds of imports, and the quick tier must stay quick as the suite grows.

**Parallel runs** (``pytest -n 2 --dist loadgroup``, the README's test command): every test
of more than 2 ranks or marked ``chaos`` joins one ``xdist_group``, so those run one at a time
on one worker (they size their timeouts and signal timing for a machine they share with one
other test at most, of 2 processes at most: a 2-rank launch, or the study's ``--jobs 2``), and
so does any test of their files that shares a module-scoped run with one of them (the run is
built once); every other test, 2-rank launches included, is grouped by its file. With the
2-rank launches in it the serial group was ~55% of the suite's time, the long pole of both
workers; without them the other worker takes them and finishes with it. Groups are handed out
longest first (the serial group, then the files that run a command end to end, then the rest),
so the last minutes are short tests on both workers, not one long test on one.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one torch thread each (set before torch is imported; the
    # processes a test launches inherit it, as launch_env gives them anyway). Two threads a
    # worker would put four spinning OpenMP threads on two cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

LAUNCH_MARKERS = ("launch", "e2e", "chaos")
SERIAL_GROUP = "ranks"
SERIAL_ABOVE_RANKS = 2  # launches of more ranks run one at a time, in SERIAL_GROUP

_current: pytest.Item | None = None  # the test whose setup, call or teardown is running


def _ranks(item: pytest.Item) -> int:
    marks = (m for name in LAUNCH_MARKERS for m in item.iter_markers(name))
    return max((int(m.kwargs.get("ranks", 1)) for m in marks), default=1)


def _shared_fixtures(item: pytest.Item) -> set[tuple]:
    """The module-scoped fixtures of ``item``'s file that it uses (pytest's own, such as
    ``tmp_path_factory``, are not among them): what it shares with the file's other tests."""
    module = item.nodeid.split("::")[0]
    return {
        (module, name)
        for name, defs in item._fixtureinfo.name2fixturedefs.items()
        if defs and defs[-1].scope != "function" and defs[-1].baseid == module
    }


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # xdist hands groups out in the collection's order (set below), not by their size
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's hook, which reads the groups off the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    serial = set()
    for item in items:
        if any(item.get_closest_marker(name) for name in LAUNCH_MARKERS):
            item.add_marker(pytest.mark.slow)
        if _ranks(item) > SERIAL_ABOVE_RANKS or item.get_closest_marker("chaos") is not None:
            serial.add(item)
    # a test that shares a module-scoped run with a serial test joins it: the run is built once
    shared = set().union(*(_shared_fixtures(item) for item in serial))
    serial |= {item for item in items if _shared_fixtures(item) & shared}
    e2e_files = {item.path for item in items if item.get_closest_marker("e2e")}
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = SERIAL_GROUP if item in serial else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
    # longest first: the serial group, then the files with a command end to end, then the rest
    items.sort(key=lambda item: 0 if item in serial else 1 if item.path in e2e_files else 2)


_ungrouped = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after xdist's hook, which writes a test's group into its node id
def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail a parallel run whose groups did not take effect, rather than run it ungrouped.

    pytest-xdist tells its scheduler a test's group by appending ``@group`` to the node id; pytest
    9.2 ignores that write (pytest-dev/pytest-xdist#1386), and nothing else notices: each test is
    then scheduled alone, a module-scoped launch runs once on each worker, and the one-at-a-time
    tests run beside other launches (in the 2026-12-05 runs: ~4 min of duplicated launches).
    An error raised here would reach the user as xdist's INTERNALERROR without this message, so
    the first test of each worker fails with it and stops the run.
    """
    if not getattr(session.config.option, "loadgroup", False):  # set on xdist's workers only
        return
    lost = [
        i.nodeid
        for i in session.items
        if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
    ]
    if lost:
        session.config.stash[_ungrouped] = (
            f"pytest-xdist's --dist loadgroup did not group {len(lost)} tests: pytest "
            f"{pytest.__version__} drops the group xdist writes into a node id "
            "(pytest-dev/pytest-xdist#1386). Install the tested versions: "
            'pip install -e ".[test]" -c constraints.txt'
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    message = item.config.stash.get(_ungrouped, None)
    if message:
        item.session.shouldstop = message
        pytest.fail(message, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    global _current
    _current = item
    try:
        yield
    finally:
        _current = None


def _starts_python(args) -> bool:
    if isinstance(args, (str, bytes, os.PathLike)):
        words = [os.fsdecode(args)]
    else:
        words = [os.fsdecode(a) for a in list(args)[:1]]
    first = words[0].split()[0] if words and words[0].split() else ""
    name = os.path.basename(first)
    return first == sys.executable or name.startswith(("python", "torchrun"))


def _check_launch(what: str) -> None:
    item = _current
    if item is None or any(item.get_closest_marker(name) for name in LAUNCH_MARKERS):
        return
    raise pytest.fail.Exception(
        f"{item.nodeid.split('@')[0]} starts a Python process ({what}) but is not marked "
        f"{' / '.join(LAUNCH_MARKERS)}: mark it (tests/conftest.py says which marker means what)"
    )


_popen_init = subprocess.Popen.__init__
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _guarded_popen_init(self, args, *rest, **kwargs):
    if _starts_python(args):
        _check_launch(f"subprocess: {args if isinstance(args, str) else list(args)[:4]}")
    _popen_init(self, args, *rest, **kwargs)


def _guarded_spawnv_passfds(path, args, passfds):
    _check_launch(f"multiprocessing spawn: {path}")
    return _spawnv_passfds(path, args, passfds)


subprocess.Popen.__init__ = _guarded_popen_init
multiprocessing.util.spawnv_passfds = _guarded_spawnv_passfds
