"""`storage.heap`: freed fragment-sized buffers are reused, not faulted in again; a user's own choice stands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diloco.storage.heap import SPARE_SHARE, _read_cgroup, memory_left, reuse_freed_memory, spare_memory

# Six 4 MiB buffers made, touched and freed together, three times over (a piece's tensors, decoded
# and merged): the page faults of the third time. glibc's default trims the heap after each time.
_CHILD = """
import resource, sys
from diloco.storage.heap import SPARE_SHARE, _read_cgroup, memory_left, reuse_freed_memory, spare_memory
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


# 64 MiB of blocks under the mmap threshold made and freed: the tuned heap keeps them; memory short
# (`fit(False)`), they go back to the OS; plentiful again (`fit(True)`), the next ones are kept again.
_FIT_CHILD = """
import os
from diloco.storage import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def made_and_freed():
    bufs = [bytearray(8 << 20) for _ in range(8)]
    del bufs
print(heap.reuse_freed_memory({}))
made_and_freed()
kept = rss()
assert heap.fit(False) is False
given = rss()
assert heap.fit(True) is True
made_and_freed()
print(kept - given, rss() - given)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_while_memory_is_short_a_tuned_heap_gives_freed_memory_back_and_keeps_it_again_once_plentiful() -> None:
    done = subprocess.run([sys.executable, "-c", _FIT_CHILD], capture_output=True, text=True, check=True, timeout=60)
    given, kept_again = (int(x) for x in done.stdout.split()[-2:])
    assert given >= 48 << 20, f"only {given >> 20} MiB of 64 given back"
    assert kept_again >= 48 << 20, f"only {kept_again >> 20} MiB of 64 kept once memory is plentiful again"


def test_fit_leaves_an_untuned_process_alone() -> None:
    code = "from diloco.storage import heap; print(heap.fit(False), heap._tuning.giving_back)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["False", "False"]


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo: Linux only")
def test_the_memory_left_is_read_from_the_machine():
    left, total = memory_left()
    assert 0 <= left <= total and total > 1 << 20
    assert spare_memory() == (left >= SPARE_SHARE * total)


def test_a_memory_cgroups_limit_less_its_working_set_is_what_is_left(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000000\n")
    (v2 / "memory.current").write_text("700000000\n")
    (v2 / "memory.stat").write_text("anon 500000000\nfile 200000000\ninactive_file 150000000\n")
    missing = str(tmp_path / "not-mounted-here")  # the cgroup's own path, outside a cgroup namespace
    assert _read_cgroup((missing, str(v2)), "memory.max", "memory.current", "inactive_file") == (450000000, 1000000000)
    (v2 / "memory.max").write_text("max\n")
    assert _read_cgroup((str(v2),), "memory.max", "memory.current", "inactive_file") is None  # no limit
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1500000000\n")
    (v1 / "memory.stat").write_text("cache 600000000\ntotal_inactive_file 400000000\n")
    assert _read_cgroup((str(v1),), "memory.limit_in_bytes", "memory.usage_in_bytes",
                        "total_inactive_file") == (900000000, 2000000000)
