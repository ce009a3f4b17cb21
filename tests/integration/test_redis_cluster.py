"""A run on a real Redis Cluster: three masters started here as `redis-server --cluster-enabled yes`.

Every key of a run shares one hash tag (`diloco:{<prefix>/<run>}:...`), so the Lua scripts and
transactions, which touch several keys at once, run on the node that holds the run's slot. The URL
(`redis+cluster://`) names another node on purpose: the client must follow the cluster's map. Two
coordinator shards and two learners then run a whole run on it, exactly once, to its end.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from diloco.infra.local.fleet import Proc
from diloco.infra.local.stack import find_redis_server
from diloco.infra.watch.status import read_status
from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError
from diloco.storage.keys import RunKeys, Shard
from diloco.storage.objects import ObjectStore
from diloco.storage.reach import check_redis
from diloco.storage.settings import Endpoints
from harness import assert_each_piece_merged_or_refused_stale_once, two_shards_run

SLOTS = 16384
BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus), so its port must be at most 55535."""


def _cluster_ports(n: int) -> list[int]:
    """`n` ports free on 127.0.0.1 a moment ago, each with its bus port (+10000) free too."""
    rng = random.Random()
    found: list[int] = []
    while len(found) < n:
        port = rng.randrange(20_000, 65_535 - BUS_OFFSET)
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
        try:
            for sock, p in zip(socks, (port, port + BUS_OFFSET), strict=True):
                sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        if port not in found:
            found.append(port)
    return found


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[int]]:
    """Three cluster masters on free ports, each with a third of the slots; their ports."""
    ports, procs = _cluster_ports(3), []
    try:
        for port in ports:
            data = tmp_path / f"node-{port}"
            data.mkdir()
            procs.append(Proc(f"redis-{port}", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                                                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                "--save", "", "--appendonly", "no", "--dir", str(data)],
                              data / "redis.log").start())
        nodes = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in ports]
        deadline = time.monotonic() + 30
        while True:
            try:
                if all(n.ping() for n in nodes):
                    break
            except redis.ConnectionError:
                for p in procs:
                    assert p.alive(), f"{p.name} exited:\n{p.tail(5)}"
                assert time.monotonic() < deadline, "the cluster's nodes did not start"
                time.sleep(0.1)
        third = SLOTS // 3
        for i, node in enumerate(nodes):
            node.execute_command("CLUSTER ADDSLOTS", *range(i * third, SLOTS if i == 2 else (i + 1) * third))
        for port in ports[1:]:
            nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
        while not all(n.cluster("info")["cluster_state"] == "ok" for n in nodes):
            assert time.monotonic() < deadline, [n.cluster("info")["cluster_state"] for n in nodes]
            time.sleep(0.1)
        yield ports
    finally:
        for p in procs:
            p.kill()


def _owner(ports: list[int], slot: int) -> int:
    third = SLOTS // 3
    return ports[min(2, slot // third)]


@pytest.mark.slow  # 15 s: make test-slow
def test_a_run_with_two_shards_on_a_redis_cluster_merges_every_piece_once_and_ends(cluster, endpoints, run_id):
    keys = RunKeys(endpoints.prefix, run_id)
    slot = key_slot(keys.heads.encode())
    assert {key_slot(k.encode()) for k in (keys.announcements, keys.lease_of(Shard(1, 2)), keys.applied_log(3),
                                           keys.learners, keys.finished)} == {slot}  # one hash tag
    home = _owner(cluster, slot)
    elsewhere = next(p for p in cluster if p != home)
    on_cluster = dataclasses.replace(endpoints, redis_url=f"redis+cluster://127.0.0.1:{elsewhere}")
    assert isinstance(Bus(on_cluster, run_id).r, RedisCluster)

    def status_reads_the_cluster(shards: list) -> None:
        status = read_status(Bus(on_cluster, run_id), ObjectStore(on_cluster))
        assert [r.holder for r in status.coordinator.shards] == [c.leadership.holder for c in shards]
        assert {row.learner for row in status.learners} == {"l0", "l1"}

    _, bus = two_shards_run(on_cluster, run_id, status_reads_the_cluster)
    heads = bus.heads()
    assert bus.run_end().versions == (heads[0], heads[1]) and min(heads.values()) >= 2
    assert_each_piece_merged_or_refused_stale_once(on_cluster, run_id, bus)
    # Every key of the run is on the node that holds its slot, none on the others.
    for port in cluster:
        found = redis.Redis(host="127.0.0.1", port=port).keys(f"diloco:{{{endpoints.prefix}/{run_id}}}:*")
        assert bool(found) == (port == home), (port, home, found)


def test_a_url_of_the_wrong_kind_for_the_server_says_which_to_use(cluster, stack, endpoints, run_id):
    """A plain URL naming a cluster node, a +cluster URL naming a plain Redis, an unknown scheme: each
    refused with the URL that works, at once (a setting, not an outage)."""
    plain_to_cluster = dataclasses.replace(endpoints, redis_url=f"redis://127.0.0.1:{cluster[0]}")
    keys = RunKeys(endpoints.prefix, run_id)
    if _owner(cluster, key_slot(keys.heads.encode())) == cluster[0]:
        plain_to_cluster = dataclasses.replace(endpoints, redis_url=f"redis://127.0.0.1:{cluster[1]}")
    with pytest.raises(ConfigError, match=r"a node of a Redis Cluster: use redis\+cluster://"):
        Bus(plain_to_cluster, run_id).heads()
    problem = check_redis(stack.redis_url.replace("redis://", "redis+cluster://", 1))
    assert problem is not None and problem.lasting and "not a Redis Cluster node: use redis://" in problem.what
    with pytest.raises(ConfigError, match=r"redis\+cluster://"):
        Endpoints(redis_url="cluster://127.0.0.1:7000", bucket="b")
