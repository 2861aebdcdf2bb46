import pytest
import torch

from modular.data import BEHAVIOURS, load_behaviour, neutral_text, retain_data
from modular.data.formatting import (
    IGNORE,
    LeftPadCollator,
    answer_positions,
    batch_prompts,
    encode_example,
    render_prompt,
)
from modular.data.schema import is_correct


@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_builtin_behaviour_has_three_nonempty_splits(name):
    ds = load_behaviour(name)
    assert all(len(ds[s]) > 0 for s in ("train", "validation", "test"))
    assert set(ds["train"].column_names) >= {"prompt", "target", "answers", "prefixes", "chat"}
    assert all(t for t in ds["test"]["target"])


def test_capitals_split_by_country_with_150_countries():
    ds = load_behaviour("capitals")
    countries = {s: {p.rsplit(" of ", 1)[1].rstrip("?.") for p in ds[s]["prompt"]} for s in ds}
    assert sum(len(c) for c in countries.values()) >= 150
    assert not countries["train"] & countries["test"]
    assert not countries["train"] & countries["validation"]
    assert not countries["validation"] & countries["test"]
    # no answer is given away by the question itself
    for row in ds["test"]:
        assert not is_correct(row["prompt"], row["target"], row["answers"], row["prefixes"])


def test_ioi_names_are_held_out_and_single_token():
    class OneTokenPerWord:  # a tokenizer for which only names of <= 4 letters are one token
        def tokenize(self, text):
            return [text] if len(text.strip()) <= 4 else list(text)

    ds = load_behaviour("ioi", tokenizer=OneTokenPerWord())
    names = lambda split: {t.strip() for t in ds[split]["target"]} | {t.strip() for t in ds[split]["wrong"]}  # noqa: E731
    assert all(len(n) <= 4 for n in names("train") | names("test"))
    assert not names("train") & names("test")
    for row in ds["test"]:
        assert row["target"].strip() in row["prompt"] and row["counterfactual"] != row["prompt"]


def test_greater_than_and_arithmetic_scoring():
    row = load_behaviour("greater_than")["test"][0]
    yy = int(row["wrong"])
    assert is_correct(f"{min(yy + 1, 99):02d} and then", row["target"], row["answers"], row["prefixes"]) == (yy < 99)
    assert not is_correct(f"{yy:02d}", row["target"], row["answers"], row["prefixes"])
    assert is_correct("12 + 30 = 42.", "", ["42"], [])
    assert not is_correct("12 + 30 = 142.", "", ["42"], [])
    for row in load_behaviour("arithmetic")["test"]:  # a completion after two worked sums, scored by its start
        a, b = (int(x) for x in row["prompt"].rsplit("\n", 1)[1].rstrip(" =").split(" + "))
        assert not row["chat"] and row["prompt"].startswith("23 + 11 = 34\n")
        assert is_correct(f" {a + b}\n\nThe sum", row["target"], row["answers"], row["prefixes"])
        assert not is_correct(f" {a + b + 1}", row["target"], row["answers"], row["prefixes"])
        assert not is_correct(row["prompt"], row["target"], row["answers"], row["prefixes"])


def test_retain_and_neutral_text_have_held_out_splits():
    r, n = retain_data(), neutral_text()
    assert len(r["test"]) > 20 and len(n["test"]) > 20
    assert not set(r["train"]["prompt"]) & set(r["test"]["prompt"])


class _Tok:
    """A character-level stand-in tokenizer (no download) with and without a chat template."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, chat):
        self.chat_template = "x" if chat else None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<u>{messages[0]['content']}</u><a>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([2] if add_special_tokens else []) + [ord(c) for c in text]}


def test_formatting_masks_prompt_and_left_pads():
    chat_tok, base_tok = _Tok(True), _Tok(False)
    assert render_prompt(chat_tok, "hi", True) == "<u>hi</u><a>"
    assert render_prompt(base_tok, "hi", True) == "Question: hi\nAnswer:"
    assert render_prompt(chat_tok, "raw", False) == "raw"
    ex = encode_example(chat_tok, "hi", "ok", chat=True)
    n_prompt = len("<u>hi</u><a>")
    assert ex["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert ex["labels"][n_prompt:] == [ord("o"), ord("k"), 1]  # target + end of turn
    batch = LeftPadCollator(0)([ex, encode_example(chat_tok, "longer prompt", "ok", chat=True)])
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    assert torch.equal(batch["input_ids"][0, -3:], batch["input_ids"][1, -3:])
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()
    prompts = batch_prompts(base_tok, ["a", "abc"], [False, False])
    assert prompts["input_ids"].shape == (2, 4) and prompts["attention_mask"][0].tolist() == [0, 0, 1, 1]


def test_answer_positions_are_those_that_predict_an_answer_token():
    ex = encode_example(_Tok(True), "hi", "ok", chat=True)
    n_prompt = len("<u>hi</u><a>")  # the last prompt position predicts the first answer token
    assert answer_positions(ex["labels"]) == [n_prompt - 1, n_prompt, n_prompt + 1]
    assert answer_positions(torch.tensor(ex["labels"]), 2) == [n_prompt - 1, n_prompt]
    assert answer_positions([IGNORE, IGNORE, 5, IGNORE, 7]) == [1, 3]  # gaps kept out, the last token predicts nothing
    assert answer_positions([IGNORE, IGNORE]) == []


def test_a_behaviour_gets_a_short_safe_name():
    from modular import ModularError
    from modular.data import parse_behaviour

    assert parse_behaviour("capitals") == ("capitals", "capitals")
    assert parse_behaviour("/some/dir/mine.jsonl") == ("mine", "/some/dir/mine.jsonl")
    assert parse_behaviour("facts=/some/dir/mine.jsonl") == ("facts", "/some/dir/mine.jsonl")
    assert parse_behaviour("hf:org/my data") == ("my_data", "hf:org/my data")
    assert parse_behaviour("/d/my file (v2).jsonl")[0] == "my_file_v2"
    with pytest.raises(ModularError, match="built-in behaviour"):
        parse_behaviour("/d/capitals.jsonl")  # would collide with the built-in behaviour's name
    with pytest.raises(ModularError, match="unknown behaviour"):
        parse_behaviour("nonsense")
    with pytest.raises(ModularError, match="must be a .jsonl file"):
        parse_behaviour("x=capitals")


def _countries(ds, split):
    from modular.data.generators import _resource

    names = sorted((r["country"] for r in _resource("capitals.json")), key=len, reverse=True)
    return {next(n for n in names if n in p) for p in ds[split]["prompt"]}  # the longest name it mentions


@pytest.mark.parametrize("relation", ["continents", "languages", "currencies", "demonyms"])
def test_country_neighbours_are_split_by_country_like_capitals(relation):
    """A test country of capitals is a test country of each neighbour relation: training on a neighbour's train
    split never shows a country whose capital is held out."""
    capitals, ds = load_behaviour("capitals"), load_behaviour(relation)
    cap = {s: _countries(capitals, s) for s in ("train", "validation", "test")}
    rel = {s: _countries(ds, s) for s in ("train", "validation", "test")}
    for split in rel:
        assert rel[split] <= cap[split], (split, rel[split] - cap[split])
        assert len(rel[split]) >= len(cap[split]) - 3  # only countries whose name gives the answer away are dropped
    assert len(ds["test"]) >= 40
    for row in ds["test"]:  # the question never gives the answer away
        assert not is_correct(row["prompt"], row["target"], row["answers"], row["prefixes"])
        assert is_correct(row["target"], row["target"], row["answers"], row["prefixes"])


@pytest.mark.parametrize("relation", ["continents", "languages", "currencies", "demonyms"])
def test_every_phrasing_asks_each_held_out_country_three_ways(relation):
    from modular.data.generators import every_phrasing

    one, every = load_behaviour(relation), every_phrasing(relation)
    assert every["train"] == one["train"].to_list()
    for split in ("validation", "test"):
        assert len(every[split]) == 3 * len(one[split])
        assert [r["prompt"] for r in every[split][::3]] == one[split]["prompt"]  # the first phrasing, as built in
        for first, other in zip(every[split][::3], every[split][1::3]):
            assert other["prompt"] != first["prompt"] and other["answers"] == first["answers"]


def test_every_phrasing_refuses_an_unknown_relation():
    from modular import ModularError
    from modular.data.generators import every_phrasing

    with pytest.raises(ModularError, match="unknown country relation 'capitals'"):
        every_phrasing("capitals")


def test_ioi_thanks_is_ioi_completed_with_the_giver_thanked():
    ioi, thanks = load_behaviour("ioi"), load_behaviour("ioi_thanks")
    for a, b in zip(ioi["test"], thanks["test"]):
        assert b["prompt"].startswith(a["prompt"])  # the same names and sentence, held out the same way
        assert b["prompt"].endswith(f"{a['target']}. Then{a['target']} thanked")
        assert (b["target"], b["wrong"]) == (a["wrong"], a["target"])  # the giver, not the receiver


def test_builtin_neighbours():
    from modular.data.behaviours import FAR_GUARDS, NEIGHBOUR_BEHAVIOURS, NEIGHBOURS, builtin_neighbours

    assert builtin_neighbours(["capitals"], "train") == ["continents", "languages"]
    assert builtin_neighbours(["capitals"], "evaluate") == ["continents", "languages", "currencies", "demonyms"]
    # one evaluated relation of capitals is never trained on
    assert set(NEIGHBOURS["capitals"]["evaluate"]) - set(NEIGHBOURS["capitals"]["train"])
    assert builtin_neighbours(["capitals", "ioi"], "train") == ["continents", "languages", "ioi_thanks"]
    assert builtin_neighbours(["ioi_long", "ioi"], "evaluate") == ["ioi_thanks"]
    # a behaviour that brings none (a user's, commonsense, an added one) keeps the far guards, in training and in
    # the report, besides the others' own
    assert builtin_neighbours(["user_data", "ioi_long", "ioi"], "evaluate") == ["capitals", "arithmetic",
                                                                                "commonsense", "ioi_thanks"]
    for use in ("train", "evaluate"):
        assert builtin_neighbours(["user_data"], use) == list(FAR_GUARDS)
        assert builtin_neighbours(["commonsense"], use) == ["capitals", "arithmetic", "ioi"]
        assert builtin_neighbours(["zorb_numerals"], use) == list(FAR_GUARDS)
    assert builtin_neighbours(["continents"], "train") == []  # it brings neighbours: evaluated only
    assert builtin_neighbours(["capitals", "continents"], "evaluate") == ["languages", "currencies", "demonyms"]
    # every relation of the countries has the other four as neighbours, at least one of them never trained on
    relations = {"capitals", "continents", "languages", "currencies", "demonyms"}
    for relation in relations:
        assert set(builtin_neighbours([relation], "evaluate")) == relations - {relation}
    assert builtin_neighbours(["languages"], "train") == ["capitals", "continents"]  # measured (see NEIGHBOURS)
    assert builtin_neighbours(["continents"], "train") == []  # evaluated only until measured
    for spec in NEIGHBOURS.values():
        assert set(spec["train"]) <= set(spec["evaluate"]) <= set(BEHAVIOURS)
        assert set(spec["evaluate"]) - set(spec["train"]) or len(spec["evaluate"]) == 1
    # every primary built-in but commonsense has a neighbour (another task on its held-out entities)
    assert {b: builtin_neighbours([b], "evaluate") for b in ("greater_than", "docstring", "agreement", "arithmetic")} \
        == {"greater_than": ["year_copy"], "docstring": ["docstring_call"], "agreement": ["noun_number"],
            "arithmetic": ["counting"]}
    assert builtin_neighbours(["greater_than", "docstring", "arithmetic"], "train") == ["year_copy", "counting"]
    # left out of the far behaviours of every run: the neighbour-only behaviours, not capitals (far from IOI)
    assert NEIGHBOUR_BEHAVIOURS == {"continents", "languages", "currencies", "demonyms", "ioi_thanks", "year_copy",
                                    "docstring_call", "noun_number", "counting"}


def _entities(name: str, split: str) -> set:
    """The held-out entities of a split: centuries, parameter names, nouns (both forms) or first operands."""
    rows = load_behaviour(name)[split]
    if name in ("greater_than", "year_copy"):
        return {int(p.rsplit("year ", 1)[1]) for p in rows["prompt"]}
    if name in ("docstring", "docstring_call"):
        return {w for p in rows["prompt"] for w in p.split("(self, ", 1)[1].split(")", 1)[0].split(", ")}
    if name == "agreement":
        return {p.split()[1] for p in rows["prompt"]}
    if name == "noun_number":
        return {w.strip() for w in list(rows["target"]) + list(rows["wrong"])}
    if name == "arithmetic":
        return {int(p.rsplit("\n", 1)[1].split(" + ")[0]) for p in rows["prompt"]}
    return {int(p.split(",")[0]) for p in rows["prompt"]}  # counting: where the count starts


def _within(mine: set, theirs: set) -> bool:
    """Numbers: within the range the behaviour holds out; names: among its held-out names."""
    if all(isinstance(x, int) for x in mine | theirs):
        return min(theirs) <= min(mine) and max(mine) <= max(theirs)
    return mine <= theirs


@pytest.mark.parametrize("behaviour, neighbour", [("greater_than", "year_copy"), ("docstring", "docstring_call"),
                                                  ("agreement", "noun_number"), ("arithmetic", "counting")])
def test_task_neighbours_hold_out_the_same_entities(behaviour, neighbour):
    """A neighbour's held-out entities are its behaviour's held-out entities, never its train ones: training on either's
    train split shows nothing the other holds out."""
    for split in ("validation", "test"):
        mine = _entities(neighbour, split)
        assert mine and _within(mine, _entities(behaviour, split)), split
        assert not _within(mine, _entities(behaviour, "train")), split
        assert not mine & _entities(behaviour, "train"), split
    for row in load_behaviour(neighbour)["test"]:  # the target scores as correct, the competing answer does not
        assert is_correct(row["target"], row["target"], row["answers"], row["prefixes"])
        if row["wrong"]:
            assert not is_correct(row["wrong"], row["target"], row["answers"], row["prefixes"])


def test_task_neighbours_ask_what_they_say():
    from modular.data.generators import AGREE_SUBJECTS

    year = load_behaviour("year_copy")["test"][0]
    assert year["prompt"].split("year ")[1][2:4] == year["target"] and year["wrong"][0] != year["target"][0]
    call = load_behaviour("docstring_call")["test"][0]
    params = call["prompt"].split("(self, ", 1)[1].split(")", 1)[0].split(", ")
    assert call["prompt"].endswith(f"({params[0]}, {params[1]},") and call["target"] == " " + params[2]
    for row in load_behaviour("counting")["test"]:
        a, b, c = (int(x) for x in row["prompt"].rstrip(",").split(", "))
        assert b - a == c - b in (1, 2) and int(row["target"]) == c + (c - b)
    plural = dict(AGREE_SUBJECTS)
    for row in load_behaviour("noun_number")["test"]:
        assert row["target"] == " " + plural[row["wrong"].strip()] and row["wrong"].strip() in row["prompt"]


def test_a_hub_dataset_is_held_out_and_refused_like_a_file(monkeypatch, caplog):
    """hf:<dataset> goes through the same checks as a JSONL file: a prompt in train and test is kept in train only,
    with a warning; a prompt with two targets is refused in one line."""
    import datasets

    from modular import ModularError

    def hub(rows):
        return lambda name: datasets.DatasetDict({s: datasets.Dataset.from_dict(
            {"prompt": [p for p, _ in r], "target": [t for _, t in r]}) for s, r in rows.items()})

    monkeypatch.setattr(datasets, "load_dataset", hub({"train": [("a", "1"), ("b", "2")],
                                                       "test": [("b", "2"), ("c", "3")]}))
    with caplog.at_level("WARNING", logger="modular"):
        ds = load_behaviour("hf:someone/held")
    assert ds["train"]["prompt"] == ["a", "b"] and ds["test"]["prompt"] == ["c"]
    assert any("dataset 'someone/held': 1 item(s) whose prompt is in an earlier split removed (1 from test)"
               in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(datasets, "load_dataset", hub({"train": [("a", "1")], "test": [("a", "2")]}))
    with pytest.raises(ModularError, match=r"dataset 'someone/clash': 1 prompt\(s\) with two different targets"):
        load_behaviour("hf:someone/clash")
