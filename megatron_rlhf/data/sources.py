"""Input sources for preprocessing: JSONL files, parquet files, local Hugging Face datasets.

Each source yields ``(line_number, payload)`` in file order: for JSONL the raw bytes of the line
(decoded and parsed later, in the worker processes, so bad UTF-8 and bad JSON are reported per
line), for parquet and ``datasets`` directories one dict per row (row numbers from 1).

``--input`` may name: a ``.jsonl``/``.json`` file (JSON Lines), a ``.parquet`` file, a directory
written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (pick a split with
``--split`` when there are several), or a directory of ``.jsonl``/``.json``/``.parquet`` files
(read in sorted name order).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.utils import InputError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Source:
    """One input to read."""

    path: Path
    """File or directory."""
    format: str
    """'jsonl', 'parquet' or 'hf' (a ``save_to_disk`` directory)."""
    split: str | None = None
    """Split of a saved ``DatasetDict``; None for everything else."""

    def where(self, line_number: int) -> str:
        """How errors name a position: ``file:LINE`` for JSONL, ``file:row N`` otherwise."""
        if self.format == "jsonl":
            return f"{self.path}:{line_number}"
        name = f"{self.path}[{self.split}]" if self.split else str(self.path)
        return f"{name}:row {line_number}"


def expand_inputs(inputs: list[str], split: str | None = None) -> list[Source]:
    """Resolve ``--input`` paths to sources, in the order given."""
    sources: list[Source] = []
    for text in inputs:
        path = Path(text)
        if not path.exists():
            raise InputError(f"--input {text}: no such file or directory")
        if path.is_dir():
            sources += _directory_sources(path, split)
        elif path.suffix in JSONL_SUFFIXES:
            sources.append(Source(path, "jsonl"))
        elif path.suffix in PARQUET_SUFFIXES:
            sources.append(Source(path, "parquet"))
        else:
            raise InputError(
                f"--input {text}: unknown file type {path.suffix!r}; give .jsonl/.json (JSON "
                "Lines), .parquet, or a directory saved by datasets' save_to_disk"
            )
    return sources


def _directory_sources(path: Path, split: str | None) -> list[Source]:
    if (path / "dataset_dict.json").exists():
        import json

        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise InputError(f"--input {path}: pick a split with --split (one of {splits})")
        return [Source(path, "hf", split)]
    if (path / "state.json").exists() and (path / "dataset_info.json").exists():
        return [Source(path, "hf")]
    files = sorted(p for p in path.iterdir() if p.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if not files:
        raise InputError(
            f"--input {path}: directory holds no .jsonl/.json/.parquet files and is not a "
            "datasets save_to_disk directory"
        )
    return [Source(p, "jsonl" if p.suffix in JSONL_SUFFIXES else "parquet") for p in files]


def count_items(source: Source) -> int:
    """Lines (JSONL) or rows (parquet, datasets) in a source, for the progress bar."""
    if source.format == "jsonl":
        count, last = 0, b"\n"
        with open(source.path, "rb") as handle:
            while block := handle.read(1 << 24):
                count += block.count(b"\n")
                last = block[-1:]
        return count + (last != b"\n")
    if source.format == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(source.path).metadata.num_rows
    return len(_load_hf(source))


def iter_items(source: Source) -> Iterator[tuple[int, bytes | dict]]:
    """Yield ``(line_number, payload)`` in order, numbering from 1."""
    if source.format == "jsonl":
        with open(source.path, "rb") as handle:
            yield from enumerate(handle, start=1)
    elif source.format == "parquet":
        import pyarrow.parquet as pq

        rows = (
            row
            for batch in pq.ParquetFile(source.path).iter_batches(4096)
            for row in batch.to_pylist()
        )
        yield from enumerate(rows, start=1)
    else:
        dataset = _load_hf(source)
        rows = (
            dict(zip(batch, values))
            for batch in dataset.iter(batch_size=4096)
            for values in zip(*batch.values())
        )
        yield from enumerate(rows, start=1)


def _load_hf(source: Source):
    try:
        from datasets import load_from_disk
    except ImportError:
        raise InputError(
            f"--input {source.path}: reading a datasets directory needs `pip install datasets`"
        ) from None
    dataset = load_from_disk(str(source.path))
    return dataset[source.split] if source.split else dataset
