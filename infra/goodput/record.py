"""Reading a run's timings from its Redis stream and its S3 history (`diloco simulate --record RUN`).

The reading is all here; what is made of it is `timings.timings_from_run`, a pure function.
Reads the whole announcements stream (the project never trims it) and every manifest: meant for
the runs of a benchmark or a demo, not for a run of millions of contributions.
"""

from __future__ import annotations

from diloco.infra.goodput.timings import Timings, timings_from_run
from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError
from diloco.storage.history import list_versions, read_manifest, read_run_spec
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement, Manifest
from diloco.storage.settings import Endpoints


def record_run(endpoints: Endpoints, run: str) -> Timings:
    store, bus = ObjectStore(endpoints), Bus(endpoints, run)
    spec = read_run_spec(store, bus.keys)
    if spec is None:
        raise ConfigError(f"run {run!r} does not exist in bucket {endpoints.bucket!r}")
    # A malformed entry (a Refused) was refused by the coordinator: it says nothing about timing.
    entries = [(eid, a) for eid, a in bus.announcement_entries() if isinstance(a, Announcement) and a.kind == "delta"]
    manifests: list[Manifest] = [read_manifest(store, bus.keys, f, v) for f in range(spec.num_fragments)
                                 for v in list_versions(store, bus.keys, f)]
    return timings_from_run(spec, entries, manifests)
