"""A bucket kept as files in a local directory: what `diloco export` writes and the history tools read.

`DirStore` has the read and write methods of `ObjectStore` with the same contracts (create-only
puts that raise `Conflict` on other bytes, size-bounded gets, `ObjectMissing`, key-ordered
listings), so replay, inspect and blame run unchanged on a live bucket or on an export. Object key
`k` is the file `root/k`; keys are refused unless every `/`-separated part is a plain name, so no
key can reach outside `root`. A put writes a temporary file and links it into place, so a reader
never sees half an object and two writers of one key get exactly one winner.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from diloco.storage.errors import Conflict, Refused
from diloco.storage.objects import Body, ObjectMissing, same_stream, views_of

TMP_DIR = ".diloco-tmp"
"""Where puts stage their bytes, under `root` (same file system, so the final link is atomic)."""


class DirStore:
    """A directory standing in for a bucket. Thread-safe (every write is one link or rename)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.bucket = str(self.root)
        """For messages that name the bucket."""

    def url(self, key: str) -> str:
        return str(self.root / key)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or "\\" in p or p.startswith(TMP_DIR) for p in parts):
            raise Refused("misaddressed", f"object key {key!r} is not a plain relative path")
        return self.root.joinpath(*parts)

    def ensure_bucket(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes | Body, *, create_only: bool = True) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / TMP_DIR / uuid.uuid4().hex
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            for view in views_of(data):  # a body is written view by view, never joined
                f.write(view)
        try:
            if not create_only:
                os.replace(tmp, path)
                return
            try:
                os.link(tmp, path)
            except FileExistsError:
                if not self._same_bytes(path, data):
                    raise Conflict(f"{path} already exists with other contents") from None
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _same_bytes(path: Path, data: bytes | Body) -> bool:
        """Whether the file holds exactly `data`, compared chunk by chunk (memory: one chunk)."""
        if path.stat().st_size != len(data):
            return False
        with path.open("rb") as f:
            return same_stream(f.read, views_of(data))

    def get(self, key: str, *, max_bytes: int) -> bytes:
        return self._read(key, max_bytes, lambda f, _size: f.read(max_bytes + 1))

    def get_buffer(self, key: str, *, max_bytes: int) -> bytearray:
        def into_buffer(f: BinaryIO, size: int) -> bytearray:
            data = bytearray(size)
            if f.readinto(data) != size:
                raise Refused("bad_framing", f"{self._path(key)}: shorter than its {size} bytes (changed while read?)")
            return data

        return self._read(key, max_bytes, into_buffer)

    def _read(self, key: str, max_bytes: int, read: Callable[[BinaryIO, int], Any]) -> Any:
        """`read(file, size)` of the file at `key`, refused if it is (or grew to) over `max_bytes`."""
        path = self._path(key)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise Refused("too_large", f"{path} is {size} bytes, over the {max_bytes}-byte limit")
                data = read(f, size)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(f"{path} does not exist") from None
        if len(data) > max_bytes:
            raise Refused("too_large", f"{path} is over the {max_bytes}-byte limit")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under prefix, in key order (as S3 lists them)."""
        for key, _modified in self.list_modified(prefix):
            yield key

    def list_modified(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, file modification time) under prefix, in key order."""
        for key, stat in self._list(prefix):
            yield key, stat.st_mtime

    def list_sizes(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) under prefix, in key order."""
        for key, stat in self._list(prefix):
            yield key, stat.st_size

    def list_stat(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size in bytes, file modification time) under prefix, in key order, one stat per file."""
        for key, stat in self._list(prefix):
            yield key, stat.st_size, stat.st_mtime

    def _list(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        top = self.root.joinpath(*prefix.split("/")[:-1]) if "/" in prefix else self.root
        found = []
        for dirpath, dirnames, filenames in os.walk(top):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            if rel == ".":
                dirnames[:] = [d for d in dirnames if d != TMP_DIR]
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        for key in sorted(found):
            try:
                yield key, self._path(key).stat()
            except FileNotFoundError:  # deleted since the walk
                continue

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)
