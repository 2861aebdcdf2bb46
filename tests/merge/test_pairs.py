"""The pairs file loader: defaults, and one-line errors for unknown keys, models and methods."""

from dataclasses import fields

import pytest
import yaml

from modular import ModularError
from modular.merge.pairs import (
    ACOptions,
    MergeConfig,
    NeutralTextOptions,
    Pair,
    WeightMergeOptions,
    load_pairs,
    parse_config,
)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def cfg(**pair):
    return {"task": "capitals", "pairs": [{"a": "smollm2-135m-instruct", "b": "gemma3-270m", **pair}]}


def test_defaults_and_labels():
    c = parse_config(cfg())
    p = c.pairs[0]
    assert (p.method, p.ac.f, p.ac.map, p.label) == ("ac", "replace", "auto", "smollm2,gemma3")
    assert p.weights == WeightMergeOptions(base=None, weight_a=0.5, density=0.2, scale=1.0) and p.lock_check
    assert c.depth == 0.5 and c.limit == 96 and (c.lock_limit, c.bootstrap) == (64, 1000)
    assert c.neutral == NeutralTextOptions("train", "test", None, 2, "outputs/merge/maps")


def test_option_groups_are_mappings():
    raw = {**cfg(method="ties", depth_a=0.3, weights={"base": "smollm2-135m-instruct", "density": 0.5}),
           "neutral": {"limit": 8, "map_dir": "maps"}}
    c = parse_config(raw)
    p = c.pairs[0]
    assert p.weights == WeightMergeOptions(base="smollm2-135m-instruct", density=0.5) and p.depth_a == 0.3
    assert p.ac == ACOptions() and c.neutral == NeutralTextOptions(limit=8, map_dir="maps")
    assert parse_config({**cfg(ac=None), "neutral": None}).pairs[0].ac == ACOptions()  # an empty block: defaults
    assert parse_config(cfg(ac={"f": "mean", "map": "fit"})).pairs[0].ac == ACOptions("mean", "fit")


@pytest.mark.parametrize("raw, message", [
    ({**cfg(), "tsk": "ioi"}, "pairs file: Option 'tsk' is not accepted"),
    (cfg(fn="sum"), "pairs[0]: Option 'fn' is not accepted"),
    (cfg(method="blend"), 'pairs[0]: Parser key "method": Expected a typing.Literal'),
    (cfg(ac={"f": "max"}), 'pairs[0]: Parser key "ac.f"'),
    (cfg(ac={"map": "ridge"}), 'pairs[0]: Parser key "ac.map"'),
    (cfg(ac={"fn": "sum"}), "pairs[0]: ac has no option fn (its options: f, map)"),
    (cfg(ac="sum"), "pairs[0]: ac takes a mapping of its options (f, map), got 'sum'"),
    (cfg(weights={"density": 0}), "pairs[0]: weights.density must be in (0, 1], got 0"),
    (cfg(weights={"density": 1.5}), "pairs[0]: weights.density must be in (0, 1], got 1.5"),
    (cfg(weights={"scale": "half"}), 'pairs[0]: Parser key "weights.scale"'),
    (cfg(weights={"base": "no-such-model"}), "pairs[0] (smollm2,gemma3) 'weights.base': unknown model"),
    (cfg(depth_a=2), "pairs[0] (smollm2,gemma3): 'depth_a' must be in [0, 1]"),
    (cfg(depth_b="half"), 'pairs[0]: Parser key "depth_b"'),
    ({**cfg(), "limit": 2.5}, 'pairs file: Parser key "limit"'),
    ({**cfg(), "neutral": {"fit_split": "dev"}}, 'pairs file: Parser key "neutral.fit_split"'),
    ({**cfg(), "neutral": {"limit": 0}}, "pairs file: neutral.limit must be >= 1 or null, got 0"),
    ({**cfg(), "neutral": {"skip_positions": -1}}, "pairs file: neutral.skip_positions must be >= 0, got -1"),
    ({**cfg(), "neutral": {"skip": 2}}, "pairs file: neutral has no option skip (its options: fit_split, eval_split,"),
    ({**cfg(), "depth": 1.5}, "pairs file: 'depth' must be in [0, 1]"),
    ({**cfg(), "bootstrap": 0}, "pairs file: 'bootstrap' must be at least 1"),
    ({"pairs": [{"a": "no-such-model", "b": "gemma3-270m"}]}, "unknown model 'no-such-model'"),
    ({"pairs": [{"a": "./missing/folder", "b": "gemma3-270m"}]}, "unknown model './missing/folder'"),
    ({"pairs": [{"a": "smollm2-135m-instruct"}]}, "pairs[0]: the following arguments are required: b"),
    ({"pairs": ["smollm2-135m-instruct"]}, "pairs[0]: must be a mapping"),
    ({"pairs": []}, "non-empty list"),
    ({**cfg(), "split": "dev"}, 'pairs file: Parser key "split"'),
])
def test_errors_are_one_line(raw, message):
    with pytest.raises(ModularError) as err:
        parse_config(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value, message", [
    ("f", "sum", "pairs[0]: f is now ac.f (write ac: {f: ...})"),
    ("map", "fit", "pairs[0]: map is now ac.map"),
    ("base", "smollm2-135m-instruct", "pairs[0]: base is now weights.base"),
    ("weight_a", 0.5, "pairs[0]: weight_a is now weights.weight_a"),
    ("density", 0.2, "pairs[0]: density is now weights.density"),
    ("scale", 1.0, "pairs[0]: scale is now weights.scale (write weights: {scale: ...})"),
    ("neutral_fit_split", "train", "pairs file: neutral_fit_split is now neutral.fit_split"),
    ("neutral_eval_split", "test", "pairs file: neutral_eval_split is now neutral.eval_split"),
    ("neutral_limit", 8, "pairs file: neutral_limit is now neutral.limit"),
    ("skip_positions", 2, "pairs file: skip_positions is now neutral.skip_positions"),
    ("map_dir", "maps", "pairs file: map_dir is now neutral.map_dir (write neutral: {map_dir: ...})"),
])
def test_keys_of_files_before_the_groups_name_their_new_place(key, value, message):
    raw = cfg(**{key: value}) if message.startswith("pairs[0]") else {**cfg(), key: value}
    with pytest.raises(ModularError) as err:
        parse_config(raw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_every_pair_and_shared_option_takes_at_most_twelve_values():
    for cls in (Pair, MergeConfig, ACOptions, WeightMergeOptions, NeutralTextOptions):
        assert len(fields(cls)) <= 12, cls


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


@pytest.mark.parametrize("name", ["merge_pairs.yaml", "merge_locks.yaml"])
def test_shipped_pairs_files_are_valid_and_fully_commented(name):
    path = ROOT / "configs" / name
    c = load_pairs(path)
    if name == "merge_pairs.yaml":
        assert len(c.pairs) >= 6
        assert any({p.a, p.b} >= {"smollm2-135m-instruct", "gemma3-270m"} for p in c.pairs)  # a cross-family pair
    else:
        assert all(p.method != "ac" and p.lock_check for p in c.pairs)
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line and line.rstrip()[-1] != ":":
            assert "#" in line, f"uncommented key: {line}"
    assert yaml.safe_load(path.read_text())["pairs"]
