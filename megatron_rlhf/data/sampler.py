"""A data-parallel, seeded, exactly resumable sampler, and the loader built on it.

The *global* sample order is one endless stream: epoch e is a permutation of all samples drawn
from ``numpy.random.default_rng([seed, e])`` (or 0..N-1 without shuffling), and the epochs follow
each other back to back, so a global batch may straddle an epoch boundary. Position p of the
stream is sample ``order(p // N)[p % N]``; nothing depends on the data-parallel layout.

Sharding, as Megatron's pretraining samplers do: the stream is cut into global micro-steps of
``micro_batch_size * dp_size`` consecutive positions, and rank r takes the r-th slice of
``micro_batch_size`` of each. So concatenating the ranks' micro-batches of a step rebuilds the
single-process order, and ``consumed_samples`` (counted globally, as in Megatron) is simply the
stream position to start from: a run stopped after any number of steps and restarted with
``consumed_samples = steps * micro_batch_size * dp_size`` yields exactly the samples an
uninterrupted run would have yielded next, even with another dp_size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import torch


class ShardedSampler(torch.utils.data.Sampler[int]):
    """Yield this rank's sample indices, from global position ``consumed_samples`` on.

    ``total_samples`` ends the stream at that global position (None: never ends). With
    ``drop_last`` the stream instead ends at the last whole global micro-step before it, so every
    rank yields the same number of micro-batches; without it the last step may be short and
    some ranks may get fewer (or no) samples in it.
    """

    def __init__(
        self,
        num_samples: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        consumed_samples: int = 0,
        shuffle: bool = True,
        micro_batch_size: int = 1,
        total_samples: int | None = None,
        drop_last: bool = True,
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: the dataset is empty")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if micro_batch_size < 1 or consumed_samples < 0:
            raise ValueError("micro_batch_size must be >= 1 and consumed_samples >= 0")
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.shuffle = shuffle
        self.micro_batch_size = micro_batch_size
        self.total_samples = total_samples
        self.drop_last = drop_last
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of samples in ``epoch`` (a permutation of 0..N-1)."""
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._cached_epoch = (epoch, order)
        return self._cached_epoch[1]

    def global_index(self, position: int) -> int:
        """The sample at global stream position ``position``."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self.epoch_order(epoch)[offset])

    def end_position(self) -> int | None:
        """Global position where this sampler stops (None: endless)."""
        if self.total_samples is None:
            return None
        if not self.drop_last:
            return self.total_samples
        step = self.micro_batch_size * self.dp_size
        return self.total_samples // step * step

    def __iter__(self) -> Iterator[int]:
        for position in self._positions():
            yield self.global_index(position)

    def __len__(self) -> int:
        end = self.end_position()
        if end is None:
            raise TypeError("an endless ShardedSampler (total_samples=None) has no length")
        return sum(last - first for first, last in self._slices(end))

    def _positions(self) -> Iterator[int]:
        for first, last in self._slices(self.end_position()):
            yield from range(first, last)

    def _slices(self, end: int | None) -> Iterator[tuple[int, int]]:
        """This rank's [first, last) global positions in each global micro-step."""
        step = self.micro_batch_size * self.dp_size
        starts = (
            itertools.count(self.consumed_samples, step)
            if end is None
            else range(self.consumed_samples, end, step)
        )
        for start in starts:
            first = start + self.dp_rank * self.micro_batch_size
            last = first + self.micro_batch_size
            if end is not None:
                first, last = min(first, end), min(last, end)
            yield first, last


def build_loader(
    dataset: torch.utils.data.Dataset,
    micro_batch_size: int,
    collate_fn: Callable[[list], dict] | None,
    dp_rank: int,
    dp_size: int,
    seed: int,
    consumed_samples: int = 0,
    *,
    shuffle: bool = True,
    total_samples: int | None = None,
    drop_last: bool = True,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """A DataLoader yielding this rank's micro-batches of ``micro_batch_size`` samples.

    ``collate_fn=None`` picks the collator of the dataset's kind with the sidecar's pad id.
    The loader is endless unless ``total_samples`` is given; resume it by passing the global
    ``consumed_samples`` of the stopped run.
    """
    sampler = ShardedSampler(
        len(dataset),
        dp_rank,
        dp_size,
        seed,
        consumed_samples=consumed_samples,
        shuffle=shuffle,
        micro_batch_size=micro_batch_size,
        total_samples=total_samples,
        drop_last=drop_last,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn or default_collator(dataset),
        num_workers=num_workers,
    )


def default_collator(dataset) -> Callable[[list], dict]:
    """The collator matching a Prompt/SFT/PreferenceDataset, padding with its pad id."""
    import functools

    from megatron_rlhf.data.collate import collate_preference, collate_prompts, collate_sft

    collate = {"prompt": collate_prompts, "sft": collate_sft, "preference": collate_preference}
    kind = getattr(dataset, "kind", None)
    if kind not in collate:
        raise ValueError("give a collate_fn: the dataset is not a Prompt/SFT/PreferenceDataset")
    return functools.partial(collate[kind], pad_id=dataset.pad_id)
