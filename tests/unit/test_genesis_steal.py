"""When a joining learner uploads a fragment of version 0 that another learner claimed (`workers/genesis.py`)."""

from diloco.workers.genesis import CLAIM_TTL_S, STEAL_MIN_S, steal_after_s


def test_a_learner_overtakes_a_proposer_after_twice_its_own_slowest_upload_and_never_sooner_than_the_floor():
    assert steal_after_s([0.4, 3.0, 1.0]) == 6.0
    assert steal_after_s([0.1]) == STEAL_MIN_S  # a proposal this quick is not worth a second upload


def test_a_learner_that_uploaded_nothing_waits_for_the_claim_to_lapse():
    assert steal_after_s([]) == CLAIM_TTL_S
