"""The goodput simulator: ideal without failures, every chip-second accounted for, the shape of the
paper's results, and decoupled rounds decided by the coordinator's own policy functions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from diloco.coordinator import policy
from diloco.coordinator.policy import RoundConfig
from diloco.infra.goodput.decoupled import decoupled
from diloco.infra.goodput.engine import Job, new_book
from diloco.infra.goodput.model import CATEGORIES, Model
from diloco.infra.goodput.sweep import PAPER, simulate
from diloco.infra.goodput.sync import data_parallel, elastic
from diloco.storage.errors import ConfigError

SMALL = Model(chips=300_000, learners=4, hours=6.0)
NEVER = 1e9
"""An MTBI in years at which nothing fails within the simulated hours."""


def wire(results):
    return [{k: v for k, v in r.to_wire().items() if k != "wall_s"} for r in results]


def test_same_seed_same_results_and_another_seed_other_failures() -> None:
    assert wire(simulate(SMALL)) == wire(simulate(SMALL))
    assert wire(simulate(SMALL)) != wire(simulate(replace(SMALL, seed=1)))


@pytest.mark.parametrize("run", [data_parallel, elastic, decoupled])
def test_without_failures_every_chip_second_is_useful(run) -> None:
    result = run(replace(SMALL, mtbi_years=NEVER))
    assert result.stats["failures"] == 0
    # All of it but what is still on its way when the simulation ends: at most a round.
    assert result.goodput + result.chip_time["pending"] == pytest.approx(1.0, abs=1e-9)
    assert result.chip_time["pending"] <= SMALL.period_s / SMALL.horizon_s


def test_without_failures_slower_groups_idle_only_at_synchronous_barriers() -> None:
    model = replace(SMALL, mtbi_years=NEVER, speeds=(1.0, 1.0, 1.5, 2.0))
    # Lockstep at the slowest group's pace: useful = mean(speed) / max(speed).
    assert data_parallel(model).goodput == pytest.approx(5.5 / 4 / 2.0)
    assert elastic(model).chip_time["idle"] == pytest.approx(1 - 5.5 / 8)
    # Decoupled learners wait for nobody: a slow learner is slow, not idle.
    result = decoupled(model)
    assert result.goodput + result.chip_time["pending"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("variant", [
    {}, {"learner_failure": "restart"}, {"cadence": "steps"}, {"speed_cv": 0.3},
    {"cadence": "steps", "round": RoundConfig(min_quorum=1, max_staleness=1)}])
def test_chip_time_categories_add_up_to_the_whole(variant) -> None:
    model = replace(SMALL, chips=1_200_000, **variant)
    for result in simulate(model):
        assert set(result.chip_time) == set(CATEGORIES)
        assert math.fsum(result.chip_time.values()) == pytest.approx(1.0, abs=1e-9), result.strategy
        assert min(result.chip_time.values()) >= -1e-12
        assert result.goodput == result.chip_time["useful"]


def test_job_accounts_capacity_pauses_and_the_step_in_flight() -> None:
    book = new_book()
    job = Job(chips=10.0, step_s=1.0, book=book)
    job.resize(2.5, -4.0)           # a slice of 4 chips leaves mid-step 3
    job.stop(3.5, lose_settled=False)   # a failure mid-step 4: its half step (6 chips) is lost
    assert job.take() == (10 * 2 + 10 * 0.5 + 6 * 0.5, 3)
    job.resume(5.0)                 # paused 1.5 s with 6 chips
    job.finish(6.25)                # the end: one more step settled, a quarter step in flight
    assert job.take() == (6.0, 1)
    assert book == {"useful": 0.0, "lost": 6 * 0.5, "refused": 0.0, "paused": 6 * 1.5,
                    "repair": 4 * (6.25 - 2.5), "idle": 0.0, "pending": 6 * 0.25}


def test_goodput_falls_as_the_fleet_grows() -> None:
    for run in (data_parallel, elastic, decoupled):
        goodputs = [run(replace(SMALL, chips=n)).goodput for n in (150_000, 600_000, 2_400_000)]
        assert goodputs == sorted(goodputs, reverse=True), run.__name__
        assert goodputs[0] - goodputs[-1] > 0.05, run.__name__


def test_at_scale_decoupled_beats_elastic_beats_data_parallel_and_more_learners_help() -> None:
    model = replace(SMALL, chips=1_200_000)
    dp, el = data_parallel(model).goodput, elastic(model).goodput
    dec = [decoupled(replace(model, learners=m)).goodput for m in (2, 8)]
    assert dp + 0.2 < el < dec[0] < dec[1]


def test_the_defaults_reproduce_the_paper_at_1_2m_chips_within_three_points() -> None:
    model = replace(Model(), hours=12.0)
    got = {"dp": data_parallel(model).goodput, "elastic": elastic(model).goodput}
    got |= {f"M={m}": decoupled(replace(model, learners=m)).goodput for m in (2, 4, 8, 16)}
    assert got == pytest.approx(PAPER, abs=0.03)


def test_decoupled_rounds_are_decided_by_the_coordinators_policy_functions(monkeypatch) -> None:
    calls = {"decide_round": 0, "staleness_verdict": 0, "merge_weights": 0}
    for name in calls:
        real = getattr(policy, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(policy, name, spy)
    result = decoupled(SMALL)
    assert calls["staleness_verdict"] == result.stats["merged"] + result.stats["refused"]
    assert calls["merge_weights"] == 2 * result.stats["rounds"] > 0  # with and without the staleness discount
    assert calls["decide_round"] >= result.stats["rounds"]


def test_a_round_that_never_merges_wastes_every_contribution(monkeypatch) -> None:
    monkeypatch.setattr(policy, "decide_round", lambda now, state, cfg: policy.Decision(False, "wait: never"))
    result = decoupled(replace(SMALL, hours=1.0))
    assert result.stats["rounds"] == 0
    assert result.goodput == 0.0
    assert result.chip_time["pending"] > 0.9  # everything sent sits in a round that never closes


def test_quorum_and_staleness_settings_change_what_reaches_the_model() -> None:
    # Steps cadence: learners at different phases. With quorum 1 each arrival is a round of its
    # own, so a learner's next delta is ~M-1 versions stale and past max_staleness 4 is refused.
    steps = replace(SMALL, chips=1_200_000, learners=8, cadence="steps")
    alone = decoupled(replace(steps, round=RoundConfig(min_quorum=1)))
    everyone = decoupled(replace(steps, round=RoundConfig(min_quorum=8)))
    lenient = decoupled(replace(steps, round=RoundConfig(min_quorum=1, max_staleness=16)))
    assert alone.stats["refused"] > 0 and alone.chip_time["refused"] > 0.1
    assert everyone.stats["refused"] == lenient.stats["refused"] == 0
    assert everyone.goodput > alone.goodput + 0.1
    assert lenient.goodput == pytest.approx(everyone.goodput, abs=0.01)
    # The clock cadence gathers every learner into one round per deadline: quorum 1 suffices.
    clock = decoupled(replace(steps, cadence="clock", round=RoundConfig(min_quorum=1)))
    assert clock.stats["refused"] == 0 and clock.stats["learners_per_round"] > 7


def test_restarting_learners_lose_their_unsent_work_and_drop_out_of_the_quorum(monkeypatch) -> None:
    live_seen = set()
    real = policy.decide_round

    def spy(now, state, cfg):
        live_seen.add(state.live_learners)
        return real(now, state, cfg)

    monkeypatch.setattr(policy, "decide_round", spy)
    model = replace(SMALL, chips=1_200_000)
    restart = decoupled(replace(model, learner_failure="restart"))
    rescale = decoupled(model)
    assert restart.stats["restarts"] > 0 and rescale.stats["restarts"] == 0
    assert restart.chip_time["lost"] > 5 * rescale.chip_time["lost"]
    assert restart.goodput < rescale.goodput
    assert min(live_seen) < model.learners


def test_model_refuses_impossible_fleets() -> None:
    with pytest.raises(ConfigError, match="learners"):
        Model(chips=1000, learners=8)
    with pytest.raises(ConfigError, match="cadence"):
        Model(cadence="sometimes")
    with pytest.raises(ConfigError, match="speeds"):
        Model(learners=2, speeds=(1.0,))


def test_goodput_at_merge_weight_discounts_only_stale_contributions() -> None:
    model = replace(SMALL, chips=1_200_000)
    discounted = decoupled(model)
    assert discounted.stats["stale_merged"] > 0
    assert 0.5 * discounted.goodput < discounted.stats["goodput_at_merge_weight"] < discounted.goodput
    plain = decoupled(replace(model, round=RoundConfig(staleness_discount=False)))
    assert plain.stats["goodput_at_merge_weight"] == pytest.approx(plain.goodput)
