"""`DirStore`: a directory that keeps the contracts of a bucket (create-only, bounded reads, key order)."""

from __future__ import annotations

import threading

import pytest

from diloco.storage.errors import Conflict, Refused
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ObjectMissing


def test_create_only_put_keeps_the_first_writer_and_accepts_its_own_retry(tmp_path):
    store = DirStore(tmp_path)
    store.put("p/run/a", b"one")
    store.put("p/run/a", b"one")  # a retry of the same bytes is success
    with pytest.raises(Conflict):
        store.put("p/run/a", b"two")
    assert store.get("p/run/a", max_bytes=10) == b"one"
    store.put("p/run/a", b"two", create_only=False)
    assert store.get("p/run/a", max_bytes=10) == b"two"


def test_concurrent_create_only_writers_get_one_winner(tmp_path):
    store, wins, errors = DirStore(tmp_path), [], []

    def write(i: int) -> None:
        try:
            store.put("k", f"writer-{i}".encode())
            wins.append(i)
        except Conflict:
            errors.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(errors) == 15
    assert store.get("k", max_bytes=100) == f"writer-{wins[0]}".encode()


def test_reads_are_bounded_and_missing_objects_say_so(tmp_path):
    store = DirStore(tmp_path)
    store.put("x/y", b"0123456789")
    with pytest.raises(Refused) as exc:
        store.get("x/y", max_bytes=9)
    assert exc.value.code == "too_large"
    with pytest.raises(ObjectMissing):
        store.get("x/z", max_bytes=9)
    with pytest.raises(ObjectMissing):
        store.get("x", max_bytes=9)  # a directory is not an object
    assert store.exists("x/y") and not store.exists("x")


@pytest.mark.parametrize("key", ["../outside", "a/../../b", "/etc/passwd", "a//b", "a/./b", "", ".diloco-tmp/x"])
def test_keys_cannot_reach_outside_the_directory(tmp_path, key):
    store = DirStore(tmp_path / "store")
    with pytest.raises(Refused) as exc:
        store.put(key, b"x")
    assert exc.value.code == "misaddressed"
    assert not (tmp_path / "outside").exists()


def test_listing_is_in_key_order_with_sizes_and_ignores_staging(tmp_path):
    store = DirStore(tmp_path)
    for key in ("r/b/2", "r/a-b", "r/a/1", "r/a/10", "q/x", "r/a/0"):
        store.put(key, key.encode())
    (tmp_path / ".diloco-tmp").mkdir(exist_ok=True)
    (tmp_path / ".diloco-tmp" / "junk").write_bytes(b"partial")
    assert list(store.list("r/")) == sorted(["r/b/2", "r/a-b", "r/a/1", "r/a/10", "r/a/0"])
    assert list(store.list("r/a/1")) == ["r/a/1", "r/a/10"]
    assert dict(store.list_sizes("r/a/")) == {"r/a/0": 5, "r/a/1": 5, "r/a/10": 6}
    sizes, times = dict(store.list_sizes("r/a/")), dict(store.list_modified("r/a/"))
    assert list(store.list_stat("r/a/")) == [(key, sizes[key], times[key]) for key in sorted(sizes)]
    assert list(store.list("nothing/")) == []
    store.delete(["r/a/0", "r/a/404"])
    assert "r/a/0" not in list(store.list("r/"))
