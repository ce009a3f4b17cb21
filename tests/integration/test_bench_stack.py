"""A benchmark's local stack: its servers' data goes once the figures are read, unless kept."""

from __future__ import annotations

import pytest

from diloco.infra.bench.trial import bench_stack
from diloco.storage.objects import ObjectStore

pytestmark = pytest.mark.slow  # three stacks started: a benchmark's harness, `make test-all`


def test_a_bench_removes_its_stacks_data_after_it_and_keeps_it_when_asked_or_when_the_bench_failed(tmp_path):
    done, kept, failed = (tmp_path / name for name in ("done", "kept", "failed"))
    with bench_stack(done) as stack:
        ObjectStore(stack.endpoints).put("figures", b"x" * 1000)
        assert any((done / "stack").rglob("*"))
    assert not (done / "stack").exists() and done.is_dir()  # the folder for the logs stays

    with bench_stack(kept, keep=True) as stack:
        ObjectStore(stack.endpoints).put("figures", b"x" * 1000)
    assert (kept / "stack" / "redis").is_dir()

    with pytest.raises(RuntimeError, match="a bench that failed"), bench_stack(failed):
        raise RuntimeError("a bench that failed")
    assert (failed / "stack" / "redis").is_dir()  # left for a look
