"""Worker for test_data_loader.py: the loader on real gloo ranks (launched by torchrun).

Each rank reads the SFT dataset written by the test and builds its loader from its own
``torch.distributed`` rank; rank 0 gathers what every rank saw and checks it against a
single-process loader. Writes ``{check: {"ok", "detail"}}`` to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import traceback

import torch
import torch.distributed as dist

from megatron_rlhf.data import SFTDataset, build_loader

MBS, SEED, STEPS, STOP = 2, 7, 10, 4


def indices(loader, steps: int) -> list[list[int]]:
    return [batch["index"].tolist() for batch in itertools.islice(loader, steps)]


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_checks(data: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = SFTDataset(f"{data}/sft")
    mine = indices(build_loader(dataset, MBS, None, rank, world, SEED), STEPS)
    resumed = indices(
        build_loader(dataset, MBS, None, rank, world, SEED, consumed_samples=STOP * MBS * world),
        STEPS - STOP,
    )
    everyone, everyone_resumed = gather(mine), gather(resumed)
    checks = {}
    if rank == 0:
        single = sum(indices(build_loader(dataset, MBS, None, 0, 1, SEED), STEPS * world), [])
        interleaved = [i for step in zip(*everyone) for batch in step for i in batch]
        checks["ranks_rebuild_the_single_process_order"] = (
            interleaved == single,
            f"ranks {interleaved[:12]} vs single {single[:12]}",
        )
        first_epoch = interleaved[: len(dataset) // (MBS * world) * MBS * world]
        checks["no_sample_twice_within_an_epoch"] = (
            len(set(first_epoch)) == len(first_epoch),
            f"{len(first_epoch)} positions, {len(set(first_epoch))} distinct",
        )
        checks["resume_on_every_rank_equals_uninterrupted"] = (
            all(again == full[STOP:] for again, full in zip(everyone_resumed, everyone)),
            f"resumed {everyone_resumed[1][:2]} vs {everyone[1][STOP : STOP + 2]}",
        )
    return checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        results = {
            name: {"ok": bool(ok), "detail": detail}
            for name, (ok, detail) in run_checks(args.data).items()
        }
    except Exception:  # report, do not hang the other rank
        results = {"worker": {"ok": False, "detail": traceback.format_exc()}}
    if dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()
    torch.set_num_threads(1)


if __name__ == "__main__":
    main()
