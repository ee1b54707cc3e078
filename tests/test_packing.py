"""Sequence packing helpers (pure): packs by token budget and the packed layout."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.data.packing import pack_by_budget, pack_rows


def test_packs_are_consecutive_rows_within_the_budget():
    lengths = [5, 3, 9, 1, 1, 12, 4]
    packs = pack_by_budget(lengths, 10)
    assert packs == [[0, 1], [2, 3], [4], [5], [6]]
    assert [row for pack in packs for row in pack] == list(range(len(lengths)))  # order kept
    for pack in packs:  # within budget, or one row longer than it alone
        assert sum(lengths[r] for r in pack) <= 10 or len(pack) == 1
    assert pack_by_budget(lengths, 1000) == [list(range(7))]
    assert pack_by_budget(lengths, 1) == [[r] for r in range(7)]
    with pytest.raises(ValueError, match=">= 1"):
        pack_by_budget(lengths, 0)


def test_pack_rows_concatenates_real_tokens_with_sequence_ids():
    ids = torch.tensor([[3, 3, 10, 11, 12], [20, 21, 3, 3, 3], [3, 30, 31, 32, 3]])
    mask = (ids != 3).long()
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32]]
    assert packed.segments.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]
    assert packed.starts.tolist() == [0, 3, 5] and packed.lengths.tolist() == [3, 2, 3]
    with pytest.raises(ValueError, match="at least one real token"):
        pack_rows(ids, torch.zeros_like(mask))
