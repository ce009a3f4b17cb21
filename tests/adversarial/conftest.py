"""The hostile-learner group uses `rig` and `make_rig` from tests/conftest.py (a `rig.Rig` each, closed
after the test)."""
