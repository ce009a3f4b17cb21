"""A run's settings are fixed when it is created: a coordinator that brings other ones says so.

A coordinator restarted with `--fragments 2 --sync-every 20` on a run created with 4 and 50 ran the
stored 4 and 50 without a word; a start that failed on a wrong Redis password had already written
the run's settings. Against the real servers.
"""

from __future__ import annotations

import dataclasses

import pytest

from diloco.coordinator.service import Coordinator
from diloco.storage.errors import ConfigError
from harness import TINY_RUN


def test_other_settings_for_a_run_that_exists_are_an_error_showing_both_unless_resumed(endpoints, run_id, caplog):
    Coordinator(endpoints, run_id, settings=TINY_RUN).close()
    other = dataclasses.replace(TINY_RUN, num_fragments=3, sync_every=20)
    with pytest.raises(ConfigError) as refused:
        Coordinator(endpoints, run_id, settings=other)
    said = str(refused.value)
    assert f"num_fragments {TINY_RUN.num_fragments} (given 3)" in said and "sync_every 4 (given 20)" in said
    assert "--resume" in said
    resumed = Coordinator(endpoints, run_id, settings=other, resume=True)
    try:
        assert (resumed.spec.num_fragments, resumed.spec.sync_every) == (TINY_RUN.num_fragments, 4)
        assert "resumed as stored" in caplog.text and "num_fragments 2 (given 3, not used)" in caplog.text
    finally:
        resumed.close()
    Coordinator(endpoints, run_id, settings=TINY_RUN).close()  # the same settings: no question
    Coordinator(endpoints, run_id).close()  # none given: the stored ones

