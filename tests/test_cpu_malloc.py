"""megatron_rlhf/runtime/memory.py: with ``keep_freed_memory`` a freed 128 MB block serves a 64 MB
one without page faults (glibc would have unmapped it and faulted a fresh one in);
``MEGATRON_RLHF_CPU_MALLOC=system`` keeps glibc's defaults. One fresh process for both cases
(the setting is process-wide and one-way): glibc's defaults first, then the setting. (What
this checks is the mmap setting: a mutation of it fails here; one of the trim threshold does
not, as the freed block does not end the heap.)"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.launch,  # a fresh Python process
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
        reason="the setting is glibc's (elsewhere keep_freed_memory changes nothing)",
    ),
]

SCRIPT = """
import json, os, resource, torch
from megatron_rlhf.runtime import memory
size = 64 << 20
def faults_filling_a_fresh_block(size):
    block = torch.empty(size // 4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def case():
    on = memory.keep_freed_memory()
    # the first block faults in either way; a larger one, as a freed block serves only what fits
    # in it (torch asks for 64-byte aligned blocks: a freed block of exactly the size does not)
    torch.empty(2 * size // 4).fill_(1.0)
    return {"on": on, "again": memory.keep_freed_memory(),
            "faults": faults_filling_a_fresh_block(size), "pages": size // 4096}
os.environ["MEGATRON_RLHF_CPU_MALLOC"] = "system"
system = case()
del os.environ["MEGATRON_RLHF_CPU_MALLOC"]
print(json.dumps({"system": system, "kept": case()}))
"""


@pytest.fixture(scope="module")
def cases() -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=dict(os.environ), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_freed_block_is_reused_without_page_faults(cases):
    kept = cases["kept"]
    assert kept["on"] and kept["again"]
    assert kept["faults"] < kept["pages"] // 100  # 16,384 pages; ~0 faults measured


def test_system_keeps_glibcs_defaults(cases):
    system = cases["system"]
    assert not system["on"] and not system["again"]
    assert system["faults"] > system["pages"] // 2  # every 4 KB page faulted in again
