"""The dependency floors pyproject.toml declares, tried: boto3 at its floor (1.36: plain PUTs on
S3-compatible servers through `request_checksum_calculation`, create-only writes through
`IfNoneMatch`) against the session's real S3 server.

boto3 and botocore at the floor are installed from the package index into a folder of their own and
put first on the path of a subprocess that stores, refuses to overwrite and reads back an object
through `ObjectStore`. Marked slow (it downloads about 15 MB); skipped with the reason when the index
cannot be reached. torch's floor (2.6) is not tried: a CPU wheel is 200 MB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.storage.settings import Endpoints

pytestmark = pytest.mark.slow

BOTO3_FLOOR = "1.36.0"

SCRIPT = """
import boto3, botocore, sys
from diloco.storage.errors import Conflict
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints

assert boto3.__version__ == sys.argv[1], boto3.__version__
store = ObjectStore(Endpoints.from_env(redis=False))
store.ensure_bucket()
store.put("floor/object", b"first", create_only=True)
try:
    store.put("floor/object", b"second", create_only=True)
except Conflict:
    pass
else:
    raise SystemExit("a create-only PUT overwrote an object")
assert store.get("floor/object", max_bytes=100) == b"first"
print("ok", boto3.__version__, botocore.__version__)
"""


def test_boto3_at_its_floor_stores_create_only_and_reads_back(endpoints: Endpoints, tmp_path: Path):
    target = tmp_path / "floor"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                           f"boto3=={BOTO3_FLOOR}", f"botocore=={BOTO3_FLOOR}"], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        pytest.skip(f"could not install boto3 {BOTO3_FLOOR} from the package index: {done.stderr.strip()[-300:]}")
    env = dict(os.environ) | endpoints.to_env() | {"PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", SCRIPT, BOTO3_FLOOR], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"ok {BOTO3_FLOOR} {BOTO3_FLOOR}"), run.stdout
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"boto3>={BOTO3_FLOOR.rsplit(".", 1)[0]}"' in pyproject, "the floor tried is the floor declared"
