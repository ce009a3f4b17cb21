"""The embedded local stack: real servers that answer, check credentials, keep their data across
restarts and leave no process behind, in-process and through `diloco stack up/down`."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
from pathlib import Path

import boto3
import botocore.exceptions as bexc
import pytest
import redis
from botocore import UNSIGNED
from botocore.config import Config

from diloco.infra.local.fleet import diloco_command, pid_alive
from diloco.infra.local.stack import LocalStack, StackError, free_ports, s3_client
from diloco.storage.settings import Endpoints


def test_redis_and_s3_answer_with_the_credentials_from_the_environment(endpoints, run_id):
    r = redis.Redis.from_url(endpoints.redis_url)
    r.xadd(f"{run_id}:stream", {"k": "v"})
    assert r.xlen(f"{run_id}:stream") == 1
    s3 = s3_client(endpoints.s3_endpoint)  # keys from AWS_* set by the fixture, like any boto3 user
    key = f"{endpoints.prefix}/{run_id}/object"
    s3.put_object(Bucket=endpoints.bucket, Key=key, Body=b"payload")
    assert s3.get_object(Bucket=endpoints.bucket, Key=key)["Body"].read() == b"payload"


def test_wrong_secret_and_anonymous_requests_are_refused(stack, endpoints):
    wrong = stack.client(secret_key="not-the-secret")
    with pytest.raises(bexc.ClientError) as refused:
        wrong.put_object(Bucket=endpoints.bucket, Key="x", Body=b"x")
    assert refused.value.response["Error"]["Code"] in ("SignatureDoesNotMatch", "AccessDenied")
    anon = boto3.session.Session().client("s3", endpoint_url=endpoints.s3_endpoint, region_name=endpoints.region,
                                          config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"},
                                                        retries={"max_attempts": 1}))
    with pytest.raises(bexc.ClientError):
        anon.list_objects_v2(Bucket=endpoints.bucket)


@pytest.mark.slow  # 16 s of server restarts: `make test-slow` (the chaos run restarts both servers too)
def test_restarts_keep_data_on_the_same_ports_and_stop_leaves_nothing(tmp_path):
    with LocalStack(tmp_path / "stack") as stack:
        before = stack.endpoints
        r = stack.redis_client()
        r.xadd("s", {"n": "1"})
        stack.stop_redis()  # SIGTERM: the AOF is fsynced on the way out
        assert not stack.redis_server.alive()
        stack.start_redis()
        r.xadd("s", {"n": "2"})
        stack.kill_redis()  # SIGKILL: what Redis wrote to the AOF is still in the page cache
        stack.start_redis()
        assert [f[b"n"] for _, f in stack.redis_client().xrange("s")] == [b"1", b"2"]

        s3 = stack.client()
        s3.put_object(Bucket=stack.bucket, Key="a/b", Body=b"kept")
        stack.stop_s3()
        stack.start_s3()
        assert s3.get_object(Bucket=stack.bucket, Key="a/b")["Body"].read() == b"kept"
        s3.put_object(Bucket=stack.bucket, Key="a/c", Body=b"new")  # writable again, not just readable
        assert stack.endpoints == before
        pids = [s.pid for s in stack.servers()]
    assert pids and not any(pid_alive(pid) for pid in pids)
    leftovers = [p for port in stack.s3_ports.values() for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
    assert not leftovers  # SeaweedFS's unix sockets would otherwise pile up in /tmp


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_failed_start_stops_what_it_started(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        stack = LocalStack(tmp_path / "stack", s3_port=taken.getsockname()[1])
        with pytest.raises(StackError, match="address already in use"):
            stack.start()
    assert stack.redis_server is not None and stack.s3_server is not None  # both were started...
    assert not pid_alive(stack.redis_server.pid) and not pid_alive(stack.s3_server.pid)  # ...and both are gone


@pytest.mark.slow  # 5-15 s for SeaweedFS to reach the port and exit: make test-slow runs it
def test_an_inner_port_taken_before_the_start_is_replaced_and_the_endpoint_kept(tmp_path, caplog):
    stack = LocalStack(tmp_path / "stack")
    inner = next(name for name in stack.s3_ports if name != "s3")  # SeaweedFS's master, MinIO's console
    endpoint, first = stack.s3_endpoint, stack.s3_ports[inner]
    with socket.socket() as taken:  # what another process's connection does between free_ports and the start
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", first))
        taken.listen()
        with stack:
            assert stack.s3_endpoint == endpoint and stack.s3_ports[inner] != first
            stack.client().put_object(Bucket=stack.bucket, Key="k", Body=b"v")
    assert "one of its own ports was taken" in caplog.text
    assert "try 2 of 3" in caplog.text


def test_free_ports_stay_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(10000 <= p < low for p in ports)  # outgoing connections never take these


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(diloco_command(*args), capture_output=True, text=True, timeout=120)


def _exports(stdout: str) -> dict[str, str]:
    env = {}
    for line in stdout.splitlines():
        word, assignment = shlex.split(line)
        assert word == "export", f"not an export line (breaks `eval $(...)`): {line!r}"
        name, value = assignment.split("=", 1)
        env[name] = value
    return env


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_cli_stack_up_prints_exports_and_down_stops_everything(tmp_path):
    d = tmp_path / "stack"
    up = _cli("stack", "up", "--dir", str(d))
    try:
        assert up.returncode == 0, up.stderr
        env = _exports(up.stdout)
        pids = [s["pid"] for s in json.loads((d / "stack.json").read_text())["servers"]]
        assert all(pid_alive(pid) for pid in pids)  # they outlived the command

        endpoints = Endpoints.from_env(env)
        assert redis.Redis.from_url(endpoints.redis_url).ping()
        s3 = s3_client(endpoints.s3_endpoint, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
        assert endpoints.bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]

        again = _cli("stack", "up", "--dir", str(d))
        assert (again.returncode, again.stdout) == (0, up.stdout)  # the running stack, not a second one
        assert _cli("stack", "env", "--dir", str(d)).stdout == up.stdout
    finally:
        down = _cli("stack", "down", "--dir", str(d))
    assert down.returncode == 0, down.stderr
    assert not (d / "stack.json").exists()
    assert not any(pid_alive(pid) for pid in pids)
    assert _cli("stack", "env", "--dir", str(d)).returncode == 1
