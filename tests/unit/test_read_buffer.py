"""`ObjectStore.get_buffer` fills one buffer of the object's announced length from the body's chunks;
a body of another length is a broken read (retried like any other), never a short or overrun buffer."""

from __future__ import annotations

import botocore.exceptions as bexc
import pytest

from diloco.storage.objects import _read_into


def test_the_chunks_fill_the_buffer_in_order():
    buf = bytearray(10)
    assert _read_into(buf, iter([b"abc", b"defg", b"hij"]), "s3://b/k") is buf
    assert buf == b"abcdefghij"


@pytest.mark.parametrize("chunks", [[b"abc", b"def"], [b"abcdefghij", b"k"], [b"abcdefghijk"]],
                         ids=["short", "one-too-many", "overrun"])
def test_a_body_of_another_length_is_a_broken_read(chunks):
    with pytest.raises(bexc.ResponseStreamingError, match="s3://b/k"):
        _read_into(bytearray(10), iter(chunks), "s3://b/k")
