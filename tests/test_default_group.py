"""``distributed.parallel.default_group`` swaps torch's private ``_world.default_pg`` (issue 47,
item 5): train-ppo's training ranks of the disaggregated placement run Megatron-Core's
optimizer set-up and checkpoint reads and writes, which take no group, over their own group.
Nothing in torch promises that attribute, so this pins what the swap relies on, on the torch
installed: the attribute exists, a collective without a group goes to the swapped-in group
(its size and rank), and the world comes back after the block, also when the block raises.
Known to hold on torch 2.11 (the GPU image) and 2.13 (the CPU install).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def world(tmp_path):
    """A one-rank gloo world in this process (the one that is there, if any)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_private_default_group_is_where_default_group_expects_it(world):
    c10d = dist.distributed_c10d
    assert hasattr(getattr(c10d, "_world", None), "default_pg"), (
        f"torch {torch.__version__} has no torch.distributed.distributed_c10d._world.default_pg, "
        "which distributed.parallel.default_group swaps (known to work on torch 2.11 and 2.13): "
        "find where this torch keeps the default process group and swap that instead"
    )
    assert c10d._world.default_pg is c10d._get_default_group(), torch.__version__
    assert dist.group.WORLD is c10d._world.default_pg, torch.__version__


def test_collectives_without_a_group_use_the_swapped_group_and_the_world_returns(world):
    from megatron_rlhf.distributed.parallel import default_group

    group = dist.new_group([0])
    before = dist.distributed_c10d._get_default_group()
    with default_group(group):
        assert dist.distributed_c10d._get_default_group() is group
        assert dist.group.WORLD is group  # torch's name for the world, read at each use
        assert (dist.get_world_size(), dist.get_rank()) == (1, 0)
        tensor = torch.ones(2)
        dist.all_reduce(tensor)  # no group: the swapped-in one
        dist.barrier()
        assert tensor.tolist() == [1.0, 1.0]
    assert dist.distributed_c10d._get_default_group() is before
    with pytest.raises(RuntimeError, match="inside"), default_group(group):
        raise RuntimeError("inside")
    assert dist.distributed_c10d._get_default_group() is before
    with default_group(None):  # None: the world, untouched
        assert dist.distributed_c10d._get_default_group() is before
