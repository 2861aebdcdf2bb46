import json
import os
import stat

import pytest

from modular.tracking import read_json_if_valid, write_json


def test_json_is_written_whole_and_read_back_only_when_it_parses(tmp_path):
    path = write_json(tmp_path / "sub" / "report.json", {"a": float("nan"), "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": None, "b": [1, 2]}  # NaN as null: JSON a user can open
    assert not [p for p in path.parent.iterdir() if p.name != "report.json"]  # no temporary file left
    assert read_json_if_valid(path) == {"a": None, "b": [1, 2]}
    assert read_json_if_valid(tmp_path / "missing.json") is None
    (tmp_path / "cut.json").write_text('{"a": [1, ')
    assert read_json_if_valid(tmp_path / "cut.json") is None
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{")
    assert read_json_if_valid(tmp_path / "binary.json") is None
    assert read_json_if_valid(tmp_path) is None  # a folder


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_report_opens_as_any_file_the_user_writes_does(tmp_path):
    """Written through a temporary file and renamed, a report keeps the mode the umask gives new files (a temporary
    file from ``tempfile`` is its owner's alone, and a report renamed from one others could not open)."""
    umask = os.umask(0o022)
    try:
        path = write_json(tmp_path / "report.json", {})
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
