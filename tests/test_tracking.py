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


def test_wandb_names_are_valid_and_distinct():
    from modular.tracking import _wandb_names, wandb_name

    assert wandb_name("../x.jsonl") == "x.jsonl" and wandb_name("a b/c") == "a_b_c" and wandb_name("..") == "unnamed"
    assert _wandb_names(["a/b", "a_b", "a b"]) == {"a/b": "a_b", "a_b": "a_b-2", "a b": "a_b-3"}


def test_tables_and_figures_named_by_a_path_are_logged(tmp_path, monkeypatch):
    """``modular behaviour --behaviours '[../x.jsonl]'`` ended in W&B's "Invalid artifact path" after writing its
    outputs: a table named by a behaviour's path (issue 80.6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modular.tracking import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    fig = tmp_path / "f.png"
    plt.figure().savefig(fig)
    run_dir = log_to_wandb(tmp_path, "test", {"../x.jsonl": {"accuracy": 0.5}}, figures={"../x.jsonl": fig},
                           tables={"../x.jsonl": [{"prompt": "p", "correct": True}]})
    assert run_dir is not None
