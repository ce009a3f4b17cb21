"""The pure parts of `diloco whatif`: which settings may change, the drift measure, the range, the scratch prefix."""

import math

import pytest
import torch

from diloco.infra.history.whatif import check_into, parse_changes, plan_ranges, relative_l2, whatif_settings
from diloco.storage.errors import ConfigError
from diloco.storage.history import Floor
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import Collection, VersionSettings


def test_known_settings_are_parsed_and_typed():
    assert parse_changes(["outer_lr=0.35", "outer_momentum=0", "merge=radial_directional",
                          "staleness_discount=False", "rate_steps=0"]) == {
        "outer_lr": 0.35, "outer_momentum": 0.0, "merge": "radial_directional", "staleness_discount": False,
        "rate_steps": 0}
    assert parse_changes([]) == {}


@pytest.mark.parametrize("items, message", [
    (["max_staleness=3"], r"cannot change 'max_staleness'; it can change outer_lr \(a number > 0 that float32 holds\), "
                          "outer_momentum"),
    (["outer_lr"], "takes KEY=VALUE"),
    (["outer_lr=-1"], "outer_lr must be a number > 0 that float32 holds, got '-1'"),
    (["outer_lr=nan"], "outer_lr must be a number > 0"),
    (["outer_lr=1e300"], "outer_lr must be a number > 0 that float32 holds"),
    (["outer_momentum=1"], r"outer_momentum must be a number in \[0, 1\)"),
    (["merge=median"], "merge must be weighted_mean or radial_directional"),
    (["staleness_discount=yes"], "true or false"),
    (["rate_steps=-1"], "an integer >= 0"),
    (["rate_steps=2.5"], "an integer >= 0"),
    (["outer_lr=0.1", "outer_lr=0.2"], "given twice"),
])
def test_anything_else_is_refused_with_what_is_allowed(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_changes(items)


def test_the_settings_of_a_what_if_record_the_change_and_where_it_comes_from():
    recorded = VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9, torch="2.0.0", cpu_capability="AVX2")
    s = whatif_settings(recorded, {"outer_lr": 0.35}, "diloco/r1")
    assert s.outer_lr == 0.35 and s.outer_momentum == 0.9 and s.kind == "delta"
    assert s.whatif_of == "diloco/r1" and s.whatif_changes == "outer_lr=0.35"
    assert s.torch == torch.__version__ and s.cpu_capability == torch.backends.cpu.get_cpu_capability()


def test_relative_l2_is_zero_exactly_when_equal():
    b = {"w": torch.tensor([3.0, 4.0]), "b": torch.zeros(2)}
    assert relative_l2(b, b) == 0.0
    assert relative_l2({"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 5.0])}, b) == pytest.approx(1.0)
    assert relative_l2({"w": torch.ones(1)}, {"w": torch.zeros(1)}) == math.inf


def test_the_scratch_prefix_must_be_apart_from_the_run():
    keys = RunKeys("diloco", "r1")
    assert check_into(keys, "whatif-1").root == "whatif-1/r1/"
    for bad in ("diloco", "diloco/r1/x", "", "/abs", "trailing/"):
        with pytest.raises(ConfigError):
            check_into(keys, bad)
    with pytest.raises(ConfigError, match="under the run's own objects"):
        check_into(RunKeys("a/r1/b", "r1"), "a")  # the run lives inside what would be the scratch root


def test_the_range_starts_after_the_genesis_and_at_or_after_what_gc_kept():
    floor = Floor(3, "p/r1/collections/0000000001", Collection(run="r1", created_at=0.0, by="gc --keep-last 2",
                                                               first_replayable=(3, 0), deleted_objects=9))
    assert plan_ranges({0: 4, 1: 5}, {0: floor}, None, None) == {0: (3, 4), 1: (1, 5)}
    assert plan_ranges({0: 4, 1: 5}, {}, 0, 2) == {0: (1, 2), 1: (1, 2)}
    assert plan_ranges({0: 4, 1: 5}, {}, 5, None) == {1: (5, 5)}
    with pytest.raises(ConfigError, match="their inputs were deleted by gc --keep-last 2"):
        plan_ranges({0: 4}, {0: floor}, 1, None)
    with pytest.raises(ConfigError, match="no version to re-derive"):
        plan_ranges({0: 0}, {}, None, None)
