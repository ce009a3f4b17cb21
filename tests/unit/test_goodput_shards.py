"""The coordinator-shard projection: the busiest shard's load from one shard's measured rate, and
`diloco simulate --params` printing it and simulating the fleet with the round time it implies."""

from __future__ import annotations

import json

import pytest

from diloco.infra.cli import build_parser
from diloco.infra.goodput.shards import shard_loads, shards_needed
from diloco.storage import codecs
from diloco.storage.errors import ConfigError


def loads(**kw):  # noqa: ANN003, ANN201
    settings = dict(params=1_200_000_000, fragments=8, learners=8, period_s=50.0, codec="int4", shard_mb_s=53.0,
                    shards=[1, 2, 3, 4, 8])
    return shard_loads(**(settings | kw))


def test_the_busiest_shard_holds_the_ceiling_of_its_share_of_the_fragments_rounds() -> None:
    got = loads()
    piece = codecs.tensor_nbytes("int4", (150_000_000,), codecs.get("int4").default_block) / 1e6
    assert got[0].piece_mb == pytest.approx(piece)  # 150M params in int4: about 0.53 bytes each
    assert [x.fragments_per_shard for x in got] == [8, 4, 3, 2, 1]  # 3 shards: 3 + 3 + 2 fragments
    for x in got:
        assert x.need_mb_s == pytest.approx(x.fragments_per_shard * 8 * piece / 50.0)
        assert x.utilization == pytest.approx(x.need_mb_s / 53.0)
        assert x.merge_s == pytest.approx(8 * piece / 53.0)  # one fragment's round at one shard's rate
    assert [x.keeps_up for x in got] == [False, True, True, True, True]
    assert shards_needed(got) == 2


def test_twice_the_learners_or_half_the_period_needs_twice_the_rate() -> None:
    base = loads(shards=[2])[0]
    assert loads(shards=[2], learners=16)[0].need_mb_s == pytest.approx(2 * base.need_mb_s)
    assert loads(shards=[2], period_s=25.0)[0].need_mb_s == pytest.approx(2 * base.need_mb_s)
    assert shards_needed(loads(shard_mb_s=1.0)) is None  # none keeps up


def test_shard_counts_above_the_fragments_and_nonsense_are_refused() -> None:
    with pytest.raises(ConfigError, match="1..8"):
        loads(shards=[16])
    with pytest.raises(ConfigError, match="positive"):
        loads(shard_mb_s=0.0)


def simulate(*argv: str) -> int:
    args = build_parser(["simulate", *argv]).parse_args(["simulate", *argv])
    return args.handler(args)


def test_simulate_params_prints_the_shards_and_simulates_with_their_round_time(tmp_path, capsys) -> None:
    assert simulate("--params", "1.2e9", "--shard-mb-s", "53", "--fragments", "8", "--learners", "8",
                    "--chips", "150000", "--hours", "1", "--json", str(tmp_path / "s.json")) == 0
    out = capsys.readouterr().out
    assert "fewest shards that keep up: 2" in out and "decoupled M=8" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert [x["shards"] for x in data["shards"]] == [1, 2, 4, 8]  # the default: powers of 2 up to P
    assert data["model"]["merge_s"] == pytest.approx(data["shards"][0]["merge_s"])
    assert [r["strategy"] for r in data["results"]] == ["dp", "elastic", "decoupled"]


def test_simulate_params_that_no_shard_count_keeps_up_with_says_so_and_simulates_nothing(tmp_path, capsys) -> None:
    assert simulate("--params", "12e9", "--shard-mb-s", "53", "--json", str(tmp_path / "s.json")) == 0
    assert "none of these keeps up" in capsys.readouterr().out
    assert "results" not in json.loads((tmp_path / "s.json").read_text())
    with pytest.raises(ConfigError, match="--shard-mb-s"):
        simulate("--params", "12e9")
