import json

import pytest

from modular import ModularError
from modular.data import load_behaviour, load_jsonl


def _write(tmp_path, lines):
    p = tmp_path / "b.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_user_jsonl_loads_with_splits_and_answers(tmp_path):
    rows = [{"prompt": f"q{i}", "target": f"t{i}", "split": "test" if i % 2 else "train"} for i in range(6)]
    rows[1]["answer"] = "x"
    p = _write(tmp_path, [json.dumps(r) for r in rows] + [""])
    ds = load_jsonl(p)
    assert len(ds["train"]) == 3 and len(ds["test"]) == 3 and len(ds["validation"]) == 0
    assert ds["test"][0]["answers"] == ["x"] and ds["test"][1]["answers"] == []
    assert load_behaviour(str(p))["train"]["prompt"] == ["q0", "q2", "q4"]


def test_jsonl_without_split_keeps_every_line(tmp_path):
    p = _write(tmp_path, [json.dumps({"prompt": f"question {i}", "target": "a"}) for i in range(50)])
    ds = load_jsonl(p)
    assert sum(len(ds[s]) for s in ds) == 50
    assert len(ds["train"]) > 20 and len(ds["test"]) > 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a"]', "line 2: expected a JSON object"),
        ('{"prompt": "p"}', "line 2: 'target' must be a non-empty string"),
        ('{"prompt": "p", "target": "t", "split": "dev"}', "line 2: 'split' must be one of"),
        ('{"prompt": "p", "target": "t", "colour": 1}', "line 2: unknown field"),
        ('{"prompt": "p", "target": "t", "answer": 3}', "line 2: 'answer' must be"),
    ],
)
def test_malformed_line_names_its_number(tmp_path, bad, message):
    p = _write(tmp_path, ['{"prompt": "ok", "target": "fine"}', bad])
    with pytest.raises(ModularError, match=message):
        load_jsonl(p)


def test_missing_file_and_unknown_behaviour(tmp_path):
    with pytest.raises(ModularError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ModularError, match="unknown behaviour 'nope'"):
        load_behaviour("nope")
