"""Worker for test_data_loader.py: the loader on real gloo ranks (launched by torchrun).

Each rank reads the SFT dataset written by the test and builds its loader from its own
``torch.distributed`` rank; rank 0 gathers what every rank saw and checks it against a
single-process loader.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torchrun_harness import Harness

from megatron_rlhf.data import SFTDataset, build_loader

MBS, SEED, STEPS, STOP = 2, 7, 10, 4
harness = Harness(__doc__)
harness.parser.add_argument("--data", required=True)


def indices(loader, steps: int) -> list[list[int]]:
    return [batch["index"].tolist() for batch in itertools.islice(loader, steps)]


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@harness.check
def loader_over_ranks(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = SFTDataset(f"{args.data}/sft")
    mine = indices(build_loader(dataset, MBS, None, rank, world, SEED), STEPS)
    resumed = indices(
        build_loader(dataset, MBS, None, rank, world, SEED, consumed_samples=STOP * MBS * world),
        STEPS - STOP,
    )
    everyone, everyone_resumed = gather(mine), gather(resumed)
    if rank != 0:
        return
    single = sum(indices(build_loader(dataset, MBS, None, 0, 1, SEED), STEPS * world), [])
    interleaved = [i for step in zip(*everyone) for batch in step for i in batch]
    harness.record(
        "ranks_rebuild_the_single_process_order",
        interleaved == single,
        f"ranks {interleaved[:12]} vs single {single[:12]}",
    )
    first_epoch = interleaved[: len(dataset) // (MBS * world) * MBS * world]
    harness.record(
        "no_sample_twice_within_an_epoch",
        len(set(first_epoch)) == len(first_epoch),
        f"{len(first_epoch)} positions, {len(set(first_epoch))} distinct",
    )
    harness.record(
        "resume_on_every_rank_equals_uninterrupted",
        all(again == full[STOP:] for again, full in zip(everyone_resumed, everyone)),
        f"resumed {everyone_resumed[1][:2]} vs {everyone[1][STOP : STOP + 2]}",
    )


if __name__ == "__main__":
    harness.main()
