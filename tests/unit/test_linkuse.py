"""How busy a link to S3 is: transfers in flight, counted once however many overlap."""

from __future__ import annotations

import pytest

from diloco.storage.linkuse import LinkLoad, LinkUse


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_overlapping_transfers_count_once_and_each_direction_on_its_own() -> None:
    clock = Clock()
    link = LinkUse(clock)
    with link.busy("up"):
        clock.t += 2.0
        with link.busy("up"), link.busy("down"):  # a second PUT and a GET beside the first PUT
            clock.t += 1.0
        clock.t += 1.0
    clock.t += 5.0  # idle
    assert link.busy_s() == (4.0, 1.0)
    with link.busy("down"):
        clock.t += 0.5
        assert link.busy_s() == (4.0, 1.5)  # one in flight counts up to now


def test_a_failed_transfer_still_counts_its_time() -> None:
    clock = Clock()
    link = LinkUse(clock)
    with pytest.raises(OSError), link.busy("up"):
        clock.t += 3.0
        raise OSError("connection reset")
    assert link.busy_s() == (3.0, 0.0)
    with link.busy("up"):  # and the count is back to none in flight
        clock.t += 1.0
    assert link.busy_s() == (4.0, 0.0)


def test_the_load_is_the_busier_direction_s_share_of_the_window_times_its_rounds() -> None:
    load = LinkLoad()
    assert load.update(0.0, (0.0, 0.0), 5.0, 10.0) == 0.0  # one sample: nothing measured yet
    assert load.update(5.0, (1.0, 4.0), 5.0, 10.0) == pytest.approx(4.0)  # down: 4 s of 5, rounds of 5 s
    assert load.update(10.0, (2.0, 5.0), 5.0, 10.0) == pytest.approx(2.5)
    # The clock stretched to rounds of 10 s: up 7 s of 20, times the rounds' mean period over them.
    assert load.update(20.0, (7.0, 5.0), 10.0, 20.0) == pytest.approx(7.0 / 20.0 * (5 * 5 + 5 * 5 + 10 * 10) / 20)
    # 20 s on: the samples older than the window go, but one at or before its start stays.
    assert load.update(40.0, (17.0, 5.0), 10.0, 20.0) == pytest.approx(0.5 * 10.0)  # from the sample at 20
    assert load.update(41.0, (18.0, 5.0), 0.0, 20.0) <= 10.0
    assert LinkLoad().update(3.0, (1.0, 1.0), 0.0, 10.0) == 0.0  # no clock: not measured


def test_a_sample_older_than_the_last_one_gives_the_last_figure_and_is_not_kept() -> None:
    """The heartbeat and the loss recorder both sample it: one may read the clock first and add its
    sample second."""
    load = LinkLoad()
    assert load.update(5.0, (0.0, 0.0), 5.0, 10.0) == 0.0
    assert load.update(4.0, (0.0, 0.0), 5.0, 10.0) == 0.0  # before any figure: none
    assert load.update(10.0, (2.0, 1.0), 5.0, 10.0) == pytest.approx(2.0)  # up: 2 s of 5
    assert load.update(9.0, (1.5, 1.0), 5.0, 10.0) == pytest.approx(2.0)
    assert load.update(15.0, (4.0, 1.0), 5.0, 10.0) == pytest.approx(2.0)  # 4 s of 10: the sample at 9 was not kept
