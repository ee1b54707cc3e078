"""Write many output files so that either all of them appear or none does.

Each output is first written to a hidden temporary name beside its final path; only when every
one is complete are they renamed into place. An exception (bad input found late, a full disk,
Ctrl-C) deletes the temporaries and leaves any earlier outputs untouched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


class StagedOutputs:
    """Temporary paths to write to, renamed onto their final paths by ``commit``."""

    def __init__(self) -> None:
        self._tag = f"tmp-{os.getpid()}"
        self._files: list[tuple[Path, Path]] = []  # (temporary, final)
        self._prefixes: list[tuple[Path, Path]] = []  # (temporary prefix, final prefix)

    def file(self, final: str | os.PathLike) -> Path:
        """A temporary path for one output file."""
        final = Path(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(f".{final.name}.{self._tag}")
        self._files.append((temporary, final))
        return temporary

    def prefix(self, final: str | os.PathLike) -> Path:
        """A temporary prefix for a writer that creates several ``PREFIX*`` files."""
        final = Path(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(f".{final.name}.{self._tag}")
        self._prefixes.append((temporary, final))
        return temporary

    def _pending(self) -> list[tuple[Path, Path]]:
        """Every (temporary, final) pair; a prefix's ``PREFIX.json`` sidecar comes last, as the
        data layer treats it as the mark of a complete dataset."""
        pending, sidecars = list(self._files), []
        for temporary, final in self._prefixes:
            for path in sorted(temporary.parent.glob(f"{temporary.name}*")):
                suffix = path.name[len(temporary.name) :]
                pair = (path, final.with_name(final.name + suffix))
                (sidecars if suffix == ".json" else pending).append(pair)
        return pending + sidecars

    def commit(self) -> list[Path]:
        """Rename every temporary onto its final path; return the final paths."""
        pending = self._pending()
        missing = [str(final) for temporary, final in pending if not temporary.exists()]
        if missing:
            raise RuntimeError(f"outputs were never written: {', '.join(missing)}")
        for temporary, final in pending:
            os.replace(temporary, final)
        return [final for _, final in pending]

    def discard(self) -> None:
        """Delete every temporary written so far."""
        for temporary, _ in self._pending():
            temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_outputs() -> Iterator[StagedOutputs]:
    """Yield a ``StagedOutputs``; commit on success, discard on any exception."""
    staging = StagedOutputs()
    try:
        yield staging
    except BaseException:
        staging.discard()
        raise
    staging.commit()
