"""`diloco bench wan`: the scaling, the data-parallel equivalence, the skip, and (as root) the links.

The benchmark's figures come from `diloco bench wan` itself; these tests check its parts: that the
scaling puts the demo in the 12B-on-2-5-Gbps regime, that the in-process data-parallel update is
the mean of the shards' gradients (what a gloo all-reduce computes), and, where namespaces can be
made, that a link carries its rate, that learners reach each other through the hub, and that
nothing is left behind.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import pytest
import torch

from diloco.infra.bench import dataparallel, netns, wan
from diloco.workers.tasks.demo import DemoTask


def test_the_default_scaling_is_a_12b_model_on_2_to_5_gbps():
    s = wan.Scaling(108_288, 4, 0.1, 1.25, 12e9, 2, 2.0, (2.0, 5.0))
    assert s.allreduce_bytes == pytest.approx(1.5 * 4 * 108_288)
    assert s.ratio == pytest.approx(41.6, rel=0.01)
    assert s.ref_ratio(5.0) < s.ratio < s.ref_ratio(2.0)
    assert s.ref_ratio(s.equivalent_gbps) == pytest.approx(s.ratio)
    assert 2.0 < s.equivalent_gbps < 5.0
    assert "inside 2-5 Gbps" in s.statement()
    assert "OUTSIDE" in wan.Scaling(108_288, 4, 0.1, 100.0, 12e9, 2, 2.0, (2.0, 5.0)).statement()


def test_tbf_bucket_holds_two_frames_or_10_ms():
    assert netns.tbf_args(1.25, 100) == ["tbf", "rate", "1250000bit", "burst", "4096", "latency", "100ms"]
    assert netns.tbf_args(1000, 50)[4] == str(1_250_000)


def test_a_per_version_curve_reaches_the_target_at_a_commit():
    curve = [(10.0, 3.0), (20.0, 2.0), (30.0, 1.0)]
    assert wan.first_at_or_below(curve, 1.5) == 30.0  # the model is 2.0 until the commit at 30 s
    assert wan.first_at_or_below(curve, 3.0) == 10.0
    assert wan.first_at_or_below(curve, 0.5) is None


def test_dp_time_at_interpolates_inside_the_run_and_extrapolates_beyond():
    run = dataparallel.DpRun(0.0, 3, [4.0, 9.0, 14.0], [0.1] * 3, [4.5] * 3, [], 3.0)
    assert run.mean_step_s == 5.0  # the first step left out
    assert run.time_at(2) == 9.0
    assert run.time_at(2.5) == 11.5
    assert run.time_at(1) == 4.0
    assert run.time_at(0.5) == pytest.approx(1.5)
    assert run.time_at(5) == 24.0


def test_the_in_process_data_parallel_step_is_the_mean_of_the_shards_gradients():
    task = DemoTask(d_model=32, n_layers=1, n_heads=2, d_ff=64, batch_size=4, seq_len=16, eval_tokens=256,
                    warmup_steps=2)
    world, steps = 3, 4
    curve = dict(dataparallel.dp_equivalent_curve(task, world, steps, eval_every=1))
    model = task.make_model(0)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, steps)
    streams = [task.train_batches(i) for i in range(world)]
    params = list(model.parameters())
    for step in range(1, steps + 1):
        grads = [torch.autograd.grad(task.loss(model, next(s)), params) for s in streams]  # one per rank
        for p, *g in zip(params, *grads):
            p.grad = torch.stack(g).sum(0) / world  # the all-reduce's sum, over the ranks
        torch.nn.utils.clip_grad_norm_(params, task.grad_clip)
        optimizer.step()
        schedule.step()
        assert task.eval_loss(model) == pytest.approx(curve[step], rel=1e-5)


def test_without_namespaces_the_result_says_why(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in (netns.feasibility().reason or "")
    parser = argparse.ArgumentParser()
    wan.add_arguments(parser)
    result = wan.run(parser.parse_args([]))
    assert result.table().startswith("wan: skipped: needs root")
    assert result.to_json()["skipped"] == result.skipped and not result.arms


def _namespaces() -> set[str]:
    return {line.split()[0] for line in netns.sh("ip", "netns", "list").splitlines() if line.strip()}


def _in(ns: str, code: str) -> subprocess.Popen:
    return subprocess.Popen([*netns.netns_exec(ns), sys.executable, "-c", code])


def test_links_carry_their_rate_reach_each_other_and_leave_nothing_behind():
    if reason := netns.feasibility().reason:
        pytest.skip(reason)
    import socket

    received: dict[str, tuple[int, float]] = {}
    with netns.WanNet(2) as net:
        names = {net.hub, *(link.ns for link in net.links)}
        assert names <= _namespaces()
        net.shape(0, netns.Rates(2.0, 2.0))
        net.shape(1, netns.Rates(2.0, 0.5))
        sleeper = subprocess.Popen([*netns.netns_exec(net.links[1].ns), "sleep", "60"])
        with netns.entered(net.hub):
            server = socket.create_server(("0.0.0.0", 0))

        def receive() -> None:
            conn, (ip, _) = server.accept()
            first, n = None, 0
            while chunk := conn.recv(65536):
                first = first or time.monotonic()
                n += len(chunk)
            received[ip] = (n, time.monotonic() - (first or time.monotonic()))

        port = server.getsockname()[1]
        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        send = "import socket; s = socket.create_connection(({!r}, {})); s.sendall(b'x' * {}); s.close()"
        assert _in(net.links[0].ns, send.format(net.links[0].hub_ip, port, 250_000)).wait(30) == 0
        thread.join(30)
        n, seconds = received[net.links[0].ip]
        assert n == 250_000
        assert 0.75 < seconds < 1.4  # 2 Mbit/s: 1.0 s
        # learner 0 to learner 1 through the hub: learner 1's download (0.5 Mbit/s) is the narrow end
        listen = ("import socket, time; srv = socket.create_server(('0.0.0.0', 7001)); c, _ = srv.accept(); "
                  "t = None\nwhile c.recv(65536): t = t or time.monotonic()\nprint(time.monotonic() - t)")
        rx = subprocess.Popen([*netns.netns_exec(net.links[1].ns), sys.executable, "-c", listen], stdout=subprocess.PIPE,
                              text=True)
        time.sleep(1.0)
        assert _in(net.links[0].ns, send.format(net.links[1].ip, 7001, 62_500)).wait(30) == 0
        out, _ = rx.communicate(timeout=30)
        assert 0.75 < float(out) < 1.4
        up0, _ = net.counters()[0]
        assert up0 > 250_000 + 62_500
        (dropped, sent), _ = net.drops()[0]  # learner 0's tbf passed every packet of its 312 kB, or dropped it
        assert sent >= (250_000 + 62_500) // 1500 and dropped >= 0
        server.close()
    assert sleeper.wait(10) == -15  # stopped by its pid when its namespace went
    assert not names & _namespaces()


@pytest.mark.slow
def test_a_real_gloo_run_across_the_links_matches_the_in_process_update(tmp_path):
    if reason := netns.feasibility().reason:
        pytest.skip(reason)
    task = DemoTask()
    with netns.WanNet(2) as net, netns.entered(net.hub):
        dp = dataparallel.run_dp(net, task, tmp_path, steps=3, budget_s=60, step_time_s=0.0, rate=netns.Rates(50.0, 50.0))
    assert dp.steps == 3
    assert all(up > 3 * wan.ring_bytes(108_288, 2, 4) for up, _ in dp.wire)  # three all-reduces each way
    assert dp.final_eval == pytest.approx(dict(dataparallel.dp_equivalent_curve(task, 2, 3, eval_every=3))[3], rel=1e-4)


def test_codec_sets_the_decoupled_and_mixed_arms_and_leaves_sync_at_its_own():
    parser = argparse.ArgumentParser()
    wan.add_arguments(parser)
    args = parser.parse_args(["--codec", "sign8"])
    assert wan._trial("decoupled", args).run_args == ("--codec", "sign8")
    assert wan._trial("mixed", args).run_args == ("--codec", "sign8")
    assert "sign8" not in wan._trial("sync", args).run_args
    assert wan._trial("decoupled", parser.parse_args([])).run_args == ()  # the run's own


def test_the_fleet_without_the_thin_links_is_the_mixed_arms_other_learners_on_their_own_links_and_streams():
    parser = argparse.ArgumentParser()
    wan.add_arguments(parser)
    args = parser.parse_args(["--rate-mbit", "2", "--mixed-rates", "0.125,1,0.125,0.5"])
    assert [r.up_mbit for r in wan._rates(args, "mixed")] == [0.25, 2.0, 0.25, 1.0]
    assert [r.up_mbit for r in wan._rates(args, "mixed_without")] == [2.0, 1.0]
    trial = wan._trial("mixed_without", args)
    assert [(p.name, p.data_seed) for p in trial.learners] == [("learner-0", 1), ("learner-1", 3)]
    assert [p.data_seed for p in wan._trial("mixed", args).learners] == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="thicker than the thinnest"):
        wan._learners(parser.parse_args(["--mixed-rates", "0.5"]), "mixed_without")


def test_the_verdicts_hold_mixed_links_to_equal_links_and_to_the_fleet_without_them():
    def arm(name: str, final: float) -> wan.ArmFigures:
        return wan.ArmFigures(name, [], None, "not reached", 0.0, final, [], [], None)

    result = wan.WanResult(None, False, None, arms={"decoupled": arm("decoupled", 1.30), "mixed": arm("mixed", 1.35),
                                                    "mixed_without": arm("mixed_without", 1.40)})
    verdicts = "\n".join(result.verdicts())
    assert "1.0385x the equal links' final eval (NOT met" in verdicts
    assert "1.3500 against 1.4000 without them (met" in verdicts


def test_repeated_runs_of_an_arm_are_held_to_their_means():
    """`--repeats`: an arm's final, time to the target, bytes and per-learner figures are the means of
    its runs; one run that missed the target leaves the arm without a time; a single run is itself."""
    def run(final: float, reached: float | None, up: int, staleness: float, merged: int) -> wan.ArmFigures:
        return wan.ArmFigures("mixed", [netns.Rates(1.25, 1.25)], reached, "measured", 100.0, final, [600], [(up, 10)],
                              [(up // 2, 5)], {"per_learner": {"learner-0": {"merged": merged,
                                                                            "mean_staleness": staleness}},
                                              "tbf_dropped": [(0.1, 0.2)]})

    one = run(1.35, 70.0, 1000, 0.5, 50)
    assert wan.combined([one]) is one and one.runs == 1 and one.spread == 0.0
    both = wan.combined([one, run(1.39, 80.0, 3000, 0.25, 60)])
    assert both.final_eval == pytest.approx(1.37) and both.finals == [1.35, 1.39] and both.runs == 2
    assert both.spread == pytest.approx(0.04 / 1.37) and both.time_to_target_s == pytest.approx(75.0)
    assert both.wire == [(2000.0, 10.0)] and both.reported == [(1000.0, 5.0)] and both.steps == [600]
    assert both.detail["per_learner"]["learner-0"] == {"merged": 55.0, "mean_staleness": 0.375}
    assert len(both.detail["runs"]) == 2 and both.to_json()["finals"] == [1.35, 1.39]
    missed = wan.combined([one, run(1.45, None, 1000, 0.5, 50)])
    assert missed.time_to_target_s is None and missed.how == "not reached in 1 of 2 runs"
    table = wan.WanResult(None, False, None, target=1.4, arms={"mixed": both}).table()
    assert "mixed arm, per learner" in table and "1.37" in table


def test_every_namespace_takes_the_congestion_control_asked_for():
    if reason := netns.feasibility().reason:
        pytest.skip(reason)
    with netns.WanNet(1, congestion_control="reno") as net:
        for ns in (net.hub, net.links[0].ns):
            assert netns.sh(*netns.netns_exec(ns), "sysctl", "-n", "net.ipv4.tcp_congestion_control").strip() == "reno"
