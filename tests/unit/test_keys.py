"""Object keys: zero-padded so that listing order is numeric order; ids cannot escape their prefix."""

import pytest

from diloco.storage.errors import Refused
from diloco.storage.keys import RunKeys


def test_listing_order_is_numeric_order():
    k = RunKeys("p", "run-1")
    versions = [k.manifest(3, v) for v in (0, 1, 2, 9, 10, 11, 99, 100, 12345)]
    assert sorted(versions) == versions
    seqs = [k.delta(3, "l0", s) for s in (1, 2, 10, 1_700_000_000_000_000)]
    assert sorted(seqs) == seqs
    frags = [k.params(f, 0, 1) for f in (0, 1, 10, 100)]
    assert sorted(frags) == frags


def test_keys_live_under_the_run_and_parse_back():
    k = RunKeys("p", "run-1")
    key = k.outer_state(12, 345, 7)
    assert key == "p/run-1/versions/0012/000000000345/outer_state.0000000007"
    assert k.parse_version_key(key) == (12, 345, "outer_state.0000000007")
    assert k.parse_version_key("p/run-1/fragments/0001/x/1") is None
    assert k.parse_delta_key(k.delta(3, "l0", 42)) == (3, "l0", 42)
    assert k.parse_delta_key(k.manifest(3, 4)) is None
    assert k.parse_genesis_key(k.genesis_params("l0", 5)) == ("l0", 5)
    assert k.parse_genesis_key(k.genesis_layout("l0")) is None
    assert k.collection(2) == "p/run-1/collections/0000000002" and k.collection(2).startswith(k.collections_prefix())
    assert k.announcements == "diloco:{p/run-1}:announcements"
    assert RunKeys("p", "run-2").heads != k.heads


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 65, "-lead"])
def test_ids_cannot_escape_their_prefix(bad):
    with pytest.raises(Refused):
        RunKeys("p", "r").delta(0, bad, 1)


def test_out_of_range_numbers_are_refused():
    k = RunKeys("p", "r")
    with pytest.raises(ValueError):
        k.params(10_000, 0, 1)
    with pytest.raises(ValueError):
        k.params(0, -1, 1)
