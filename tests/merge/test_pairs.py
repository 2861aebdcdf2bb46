"""The pairs file loader: defaults, and one-line errors for unknown keys, models and methods."""

import pytest
import yaml

from modular import ModularError
from modular.merge.pairs import load_pairs, parse_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def cfg(**pair):
    return {"task": "capitals", "pairs": [{"a": "smollm2-135m-instruct", "b": "gemma3-270m", **pair}]}


def test_defaults_and_labels():
    c = parse_config(cfg())
    p = c.pairs[0]
    assert (p.method, p.f, p.map, p.label) == ("ac", "replace", "auto", "smollm2,gemma3")
    assert c.depth == 0.5 and c.limit == 96


@pytest.mark.parametrize("raw, message", [
    ({**cfg(), "tsk": "ioi"}, "pairs file: Option 'tsk' is not accepted"),
    (cfg(fn="sum"), "pair 0: Option 'fn' is not accepted"),
    (cfg(method="blend"), 'pair 0: Parser key "method": Expected a typing.Literal'),
    (cfg(f="max"), 'Parser key "f"'),
    (cfg(map="ridge"), 'Parser key "map"'),
    (cfg(depth_a=2), "'depth_a' must be in [0, 1]"),
    (cfg(depth_b="half"), 'Parser key "depth_b"'),
    ({**cfg(), "limit": 2.5}, 'pairs file: Parser key "limit"'),
    ({"pairs": [{"a": "no-such-model", "b": "gemma3-270m"}]}, "unknown model 'no-such-model'"),
    ({"pairs": [{"a": "./missing/folder", "b": "gemma3-270m"}]}, "unknown model './missing/folder'"),
    ({"pairs": [{"a": "smollm2-135m-instruct"}]}, "pair 0: the following arguments are required: b"),
    ({"pairs": ["smollm2-135m-instruct"]}, "pair 0: must be a mapping"),
    ({"pairs": []}, "non-empty list"),
    ({**cfg(), "split": "dev"}, 'pairs file: Parser key "split"'),
])
def test_errors_are_one_line(raw, message):
    with pytest.raises(ModularError) as err:
        parse_config(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_duplicate_labels_are_refused():
    raw = {"pairs": [{"a": "smollm2-135m-instruct", "b": "gemma3-270m"}] * 2}
    with pytest.raises(ModularError, match="two pairs are named"):
        parse_config(raw)


def test_run_folders_and_hub_ids_are_model_specs(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    c = parse_config({"pairs": [{"a": str(tmp_path), "b": "HuggingFaceTB/SmolLM2-135M-Instruct"}]})
    assert c.pairs[0].a == str(tmp_path)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ModularError, match="not found"):
        load_pairs(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pairs: [\n")
    with pytest.raises(ModularError, match="not valid YAML"):
        load_pairs(bad)
    bad.write_bytes(b"pairs: []  # caf\xe9\n")  # not UTF-8
    with pytest.raises(ModularError, match="bad.yaml is not valid YAML: 'utf-8' codec can't decode"):
        load_pairs(bad)


def test_shipped_pairs_file_is_valid_and_fully_commented():
    path = ROOT / "configs" / "merge_pairs.yaml"
    c = load_pairs(path)
    assert len(c.pairs) >= 6
    assert any({p.a, p.b} >= {"smollm2-135m-instruct", "gemma3-270m"} for p in c.pairs)  # a cross-family pair
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line and line.rstrip()[-1] != ":":
            assert "#" in line, f"uncommented key: {line}"
    assert yaml.safe_load(path.read_text())["pairs"]
