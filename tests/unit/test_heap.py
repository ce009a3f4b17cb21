"""`storage.heap`: freed fragment-sized buffers are reused, not faulted in again; a user's own choice stands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diloco.storage.heap import reuse_freed_memory

# Six 4 MiB buffers made, touched and freed together, three times over (a piece's tensors, decoded
# and merged): the page faults of the third time. glibc's default trims the heap after each time.
_CHILD = """
import resource, sys
from diloco.storage.heap import reuse_freed_memory
if sys.argv[1] == "tuned":
    print(reuse_freed_memory({}), file=sys.stderr)
for _ in range(2):
    bufs = [bytearray(4 << 20) for _ in range(6)]
    del bufs
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bufs = [bytearray(4 << 20) for _ in range(6)]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True, timeout=60)
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_a_fragments_worth_of_buffers_freed_together_is_reused_without_faulting_pages_in_again() -> None:
    pages = 6 * (4 << 20) // 4096
    tuned = _faults("tuned")
    assert tuned < pages // 10, f"{tuned} page faults making {pages} pages again"
    print(f"page faults on the third time: tuned {tuned}, glibc's default {_faults('default')} (of {pages} pages)")


def test_a_users_own_allocator_settings_stand() -> None:
    assert "MALLOC_TRIM_THRESHOLD_ set" in reuse_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert "MALLOC_MMAP_THRESHOLD_" in reuse_freed_memory({"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TOP_PAD_": "0"})
    assert "another allocator" in reuse_freed_memory({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})


def test_every_command_but_learner_tunes_malloc_at_start_and_a_learner_leaves_it_to_its_config(monkeypatch, caplog):
    from diloco.infra.cli import main

    for name in ("DILOCO_REDIS_URL", "DILOCO_S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)  # each command stops at once: no servers
    caplog.set_level("DEBUG", logger="diloco")
    assert main(["-v", "status", "--run", "r"]) == 1
    assert "malloc: heap allocations up to 32 MiB" in caplog.text
    caplog.clear()
    main(["-v", "learner", "--run", "r", "--id", "x", "--steps", "1"])
    assert "malloc:" not in caplog.text  # `Learner` decides when it joins (LearnerConfig.reuse_freed_memory)
