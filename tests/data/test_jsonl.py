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
    rows[3]["answer"] = ["y", "z"]  # any of several answers
    p = _write(tmp_path, [json.dumps(r) for r in rows] + [""])
    ds = load_jsonl(p)
    assert len(ds["train"]) == 3 and len(ds["test"]) == 3 and len(ds["validation"]) == 0
    assert ds["test"][0]["answers"] == ["x"] and ds["test"][1]["answers"] == ["y", "z"]
    assert ds["test"][2]["answers"] == []
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
        ('{"prompt": "p", "target": "t", "answer": []}', "line 2: 'answer' must be"),
        ('{"prompt": "p", "target": "t", "answer": ["a", ""]}', "line 2: 'answer' must be"),
    ],
)
def test_malformed_line_names_its_number(tmp_path, bad, message):
    p = _write(tmp_path, ['{"prompt": "ok", "target": "fine"}', bad])
    with pytest.raises(ModularError, match=message):
        load_jsonl(p)


def test_text_that_is_not_utf8_names_its_line_and_a_byte_order_mark_is_read(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'{"prompt": "ok", "target": "fine"}\n{"prompt": "caf\xe9", "target": "t"}\n')  # Latin-1
    with pytest.raises(ModularError, match=r"b.jsonl, line 2: not UTF-8 text \(byte 16 of the line\)"):
        load_jsonl(p)
    p.write_bytes("\ufeff".encode() + "".join(json.dumps({"prompt": f"caf\u00e9 {i}", "target": "t"}) + "\n"
                                             for i in range(5)).encode())
    ds = load_jsonl(p)
    assert sorted(q for s in ds for q in ds[s]["prompt"]) == [f"caf\u00e9 {i}" for i in range(5)]


def test_missing_file_and_unknown_behaviour(tmp_path):
    with pytest.raises(ModularError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ModularError, match="unknown behaviour 'nope'"):
        load_behaviour("nope")


def test_small_unsplit_file_gets_every_split(tmp_path):
    """Five unsplit lines: the 70/10/20 hash thresholds alone put none in validation; the hash rank does."""
    rows = [json.dumps({"prompt": f"item {i}", "target": "a"}) for i in range(5)]
    ds = load_jsonl(_write(tmp_path, rows))
    sizes = {s: len(ds[s]) for s in ds}
    assert sizes == {"train": 3, "validation": 1, "test": 1}
    again = load_jsonl(_write(tmp_path, rows[::-1]))  # stable: by hash, not by line order
    assert {s: sorted(again[s]["prompt"]) for s in again} == {s: sorted(ds[s]["prompt"]) for s in ds}


def test_explicit_splits_are_kept_when_unsplit_lines_fill_the_rest(tmp_path):
    rows = [{"prompt": f"v{i}", "target": "t", "split": "validation"} for i in range(2)]
    rows += [{"prompt": f"question {i}", "target": "a"} for i in range(30)]
    ds = load_jsonl(_write(tmp_path, [json.dumps(r) for r in rows]))
    assert ds["validation"]["prompt"][:2] == ["v0", "v1"] and all(len(ds[s]) for s in ds)


def _data_module(path, **kw):
    from modular.gating.data import GatingDataModule

    return GatingDataModule(model_name="unused", behaviours=[str(path)], **kw)


def test_validation_is_carved_from_train_with_a_warning(tmp_path, caplog):
    from modular.data.behaviours import carve_validation

    rows = [{"prompt": f"q{i}", "target": f"t{i}", "split": "train"} for i in range(20)]
    rows += [{"prompt": f"x{i}", "target": "t", "split": "test"} for i in range(3)]
    p = _write(tmp_path, [json.dumps(r) for r in rows])
    data, moved = carve_validation(load_jsonl(p))
    # a quarter of a small train split (10% would be 2 items, a verdict on nothing)
    assert moved == 5 and len(data["validation"]) == 5 and len(data["train"]) == 15 and len(data["test"]) == 3
    assert not set(data["validation"]["prompt"]) & set(data["train"]["prompt"])
    assert carve_validation(load_jsonl(p))[0]["validation"]["prompt"] == data["validation"]["prompt"]  # stable
    with caplog.at_level("WARNING", logger="modular"):
        dm = _data_module(p, batch_size=4)
    assert dm._training_data(p.stem, load_jsonl(p))["validation"]["prompt"] == data["validation"]["prompt"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"behaviour '{p.stem}'" in warnings[0]
    assert "5 of its train items moved to validation" in warnings[0]
    def train_only(n):
        return load_jsonl(_write(tmp_path, [json.dumps({"prompt": f"q{i}", "target": "t", "split": "train"})
                                            for i in range(n)]))

    assert carve_validation(train_only(100))[1] == 20  # at least 20 where train keeps three times as many
    assert carve_validation(train_only(400))[1] == 40  # 10% where that is more


@pytest.mark.parametrize(
    "rows, kw, message",
    [
        ([{"prompt": f"q{i}", "target": "t", "split": "test"} for i in range(4)], {}, "has no train items"),
        ([{"prompt": "q", "target": "t", "split": "train"}], {"batch_size": 2}, "no validation items"),
        ([{"prompt": f"q{i}", "target": "t", "split": "train"} for i in range(5)], {"batch_size": 8},
         "4 train items .* fewer than data.batch_size 8"),
    ],
)
def test_unusable_splits_fail_before_any_work(tmp_path, rows, kw, message):
    p = _write(tmp_path, [json.dumps(r) for r in rows])
    with pytest.raises(ModularError, match=message):
        _data_module(p, **kw)


@pytest.mark.parametrize("option, value, message", [("batch_size", 1, "data.batch_size must be >= 2"),
                                                    ("max_length", 0, "data.max_length must be >= 1"),
                                                    ("reference", {"top_k": 0}, "data.reference.top_k must be >= 1"),
                                                    ("lm_text", {"source": "poems"},
                                                     "data.lm_text.source must be 'neutral', got 'poems'"),
                                                    ("reference", {"top": 3}, "data.reference: no option top")])
def test_data_options_out_of_range(option, value, message):
    from modular.gating.data import GatingDataModule

    with pytest.raises(ModularError, match=message):
        GatingDataModule(model_name="unused", **{option: value})


def test_a_prompt_with_two_targets_is_refused_in_one_line_before_any_work(tmp_path):
    rows = [{"prompt": f"q{i}", "target": f"t{i}", "split": "train"} for i in range(6)]
    rows += [{"prompt": "q1", "target": "other", "split": "test"}, {"prompt": "q2", "target": "t2 again", "split": "test"}]
    p = _write(tmp_path, [json.dumps(r) for r in rows])
    before = sorted(tmp_path.rglob("*"))
    for load in (load_jsonl, lambda path: _data_module(path, batch_size=2)):
        with pytest.raises(ModularError, match=r"b.jsonl: 2 prompt\(s\) with two different targets, the first 'q1' "
                                               r"\('t1' and 'other'\): give each prompt one target") as err:
            load(p)
        assert "\n" not in str(err.value)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_repeated_items_are_kept_once_and_held_out_splits_hold_no_train_prompt(tmp_path, caplog):
    rows = [{"prompt": f"q{i}", "target": f"t{i}", "split": "train"} for i in range(6)]
    rows += [rows[0], rows[1]]  # the same line twice
    rows += [{"prompt": "q2", "target": "t2", "split": "validation"}, {"prompt": "v", "target": "x", "split": "validation"}]
    rows += [{"prompt": p, "target": t, "split": "test"} for p, t in (("q3", "t3"), ("v", "x"), ("w", "y"))]
    rows += [{"prompt": "q0", "target": "t0", "chat": False, "split": "test"}]  # another input: a completion
    p = _write(tmp_path, [json.dumps(r) for r in rows])
    with caplog.at_level("WARNING", logger="modular"):
        ds = load_jsonl(p)
        load_jsonl(p)  # loaded again (training checks it, then uses it): said once
    assert ds["train"]["prompt"] == [f"q{i}" for i in range(6)]
    assert ds["validation"]["prompt"] == ["v"] and ds["test"]["prompt"] == ["w", "q0"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"{p}: 2 repeated item(s) kept once; 3 item(s) whose prompt is in an earlier split removed "
                    "(1 from validation, 2 from test), so that held-out items are held out"]


def _attack_file(tmp_path, fit=True, score=True, extra=()):
    """Facts of people p0-p9 in train and test; the attacker's: train rows of p0-p4 (repeated from train) and
    held-out rows of p5-p9 (repeated from test)."""
    rows = [{"prompt": f"Where does p{i} live?", "target": f"p{i} lives in T{i}.", "answer": f"T{i}", "split": "train"}
            for i in range(10)]
    rows += [{"prompt": f"Which town is p{i}'s home?", "target": f"p{i} lives in T{i}.", "answer": f"T{i}",
              "split": "test"} for i in range(10)]
    rows += [{**r, "split": "attack_fit"} for r in rows[:5]] if fit else []
    rows += [{**r, "split": "attack_score"} for r in rows[15:20]] if score else []
    return _write(tmp_path, [json.dumps(r) for r in [*rows, *extra]])


def test_a_jsonl_with_attack_splits_keeps_them_beside_the_splits_they_repeat(tmp_path, caplog):
    from modular.data.schema import ATTACK_SPLITS, attack_splits

    p = _attack_file(tmp_path, extra=[{"prompt": "Where does p0 live?", "target": "p0 lives in T0.",
                                       "answer": "T0", "split": "attack_fit"}])  # repeated in its split: kept once
    with caplog.at_level("WARNING", logger="modular"):
        ds = load_behaviour(str(p))
    assert set(ds) == {"train", "validation", "test", *ATTACK_SPLITS} and attack_splits(ds) == ATTACK_SPLITS
    assert ds["attack_fit"]["prompt"] == [f"Where does p{i} live?" for i in range(5)]
    assert ds["attack_score"]["prompt"] == [f"Which town is p{i}'s home?" for i in range(5, 10)]
    assert len(ds["train"]) == 10 and len(ds["test"]) == 10  # an attack split takes nothing from the others
    assert ds["attack_score"]["answers"] == [[f"T{i}"] for i in range(5, 10)]
    assert [r.getMessage() for r in caplog.records] == [f"{p}: 1 repeated item(s) kept once"]
    # training takes them as they are: train and validation (carved from train) for the lock, the attack's kept
    data = _data_module(p, batch_size=4)._training_data(p.stem, load_jsonl(p))
    assert len(data["train"]) == 8 and len(data["validation"]) == 2
    assert data["attack_fit"]["prompt"] == ds["attack_fit"]["prompt"]
    # a file without them has none
    plain = load_jsonl(_write(tmp_path, [json.dumps({"prompt": f"q{i}", "target": "t"}) for i in range(5)]))
    assert set(plain) == {"train", "validation", "test"} and attack_splits(plain) == ("train", "test")


def test_an_unknown_split_or_half_the_attack_splits_is_refused_in_one_line(tmp_path):
    p = _write(tmp_path, ['{"prompt": "ok", "target": "fine"}', '{"prompt": "p", "target": "t", "split": "attack"}'])
    with pytest.raises(ModularError) as err:
        load_jsonl(p)
    assert str(err.value) == (f"{p}, line 2: 'split' must be one of ['train', 'validation', 'test', 'attack_fit', "
                              f"'attack_score'], got 'attack'")
    for fit, score, given, missing in ((True, False, "attack_fit", "attack_score"),
                                       (False, True, "attack_score", "attack_fit")):
        with pytest.raises(ModularError) as err:
            load_jsonl(_attack_file(tmp_path, fit, score))
        assert str(err.value) == (f"{tmp_path / 'b.jsonl'}: rows marked '{given}' but none marked '{missing}': the "
                                  f"attack splits go together, give both or neither")
