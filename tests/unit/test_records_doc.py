"""PROTOCOL.md's record table is what `storage/protocol.py` says: generated from it, never edited by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from diloco.storage import protocol
from diloco.storage.records_doc import BEGIN, END, replace_block, table

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "PROTOCOL.md"


def test_protocol_md_shows_every_record_field_as_protocol_py_defines_it():
    text = PROTOCOL_MD.read_text()
    assert replace_block(text, table()) == text, (
        "PROTOCOL.md's record table is out of date: run `python -m diloco.storage.records_doc --write PROTOCOL.md`")
    for cls in (protocol.RunSpec, protocol.Announcement, protocol.Manifest, protocol.LearnerStats):
        for name in (f.name for f in dataclasses.fields(cls)):
            assert f"| `{name}` `" in text, f"{cls.__name__}.{name} is not in PROTOCOL.md"


def test_a_field_added_to_a_record_changes_the_table():
    source = "class Record: ...\n\nclass Probe(Record):\n    \"\"\"A probe.\"\"\"\n\n    count: int = 3\n    \"\"\"How many.\"\"\"\n"
    assert table(source).splitlines()[2:] == ["| **`Probe`** | A probe. |", "| `count` `int = 3` | How many. |"]


def test_a_document_without_the_markers_is_refused_not_rewritten():
    with pytest.raises(ValueError, match="records: generated"):
        replace_block("no markers here", "table")
    assert replace_block(f"a\n{BEGIN}\nold\n{END}\nb", "new") == f"a\n{BEGIN}\nnew\n{END}\nb"
