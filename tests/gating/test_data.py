"""The gating data module bounds every input it encodes by ``max_length`` (issue 80.5)."""

import json

import datasets

import modular.gating.data as data_module
from modular.data import retain_data
from modular.gating.data import GatingDataModule
from tests.conftest import save_tiny_folder


def test_items_longer_than_max_length_keep_their_end_and_are_named_once(tmp_path, isolated_cache, caplog,
                                                                         monkeypatch):
    """Behaviour items, the reference's retain and neighbour records and their guards keep their last ``max_length``
    tokens; one warning names how many of which behaviour and split were cut, and to what length."""
    few = retain_data(0)
    few = datasets.DatasetDict({s: few[s].select(range(4)) for s in few})  # a few retain prompts: a fast reference
    monkeypatch.setattr(data_module, "retain_data", lambda seed=0: few)
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    path = tmp_path / "longdoc.jsonl"
    rows = [{"prompt": (" and" * 400 if i in (0, 7) else "") + f"Say the word number {i}.", "target": f"word {i}",
             "split": "train" if i < 6 else "validation"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    near = tmp_path / "near.jsonl"
    near.write_text("".join(json.dumps({"prompt": " and" * 300 + f"Name the number {i}.", "target": f"{i}",
                                        "split": "train"}) + "\n" for i in range(3)))
    dm = GatingDataModule(model_name=str(model_dir), behaviours=[str(path)], neighbours=[str(near)], batch_size=2,
                          reference=dict(max_new_tokens=2), max_length=48)
    with caplog.at_level("WARNING", logger="modular"):
        dm.setup("fit")
    said = [r.getMessage() for r in caplog.records if "data.max_length" in r.getMessage()]
    assert len(said) == 1
    assert ("items longer than data.max_length (48 tokens with their target) are cut to their last 48 tokens, the "
            "start of their prompt dropped: behaviour 'longdoc' 1 of 6 train, 1 of 2 validation; neighbour 'near' "
            "3 of 3 train") in said[0]
    items = [it for split in dm.behaviour_rows["longdoc"].values() for it in split]
    encodings = [e for it in items for e in it.values()] + [it for s in dm.neighbour_rows.values() for it in s]
    encodings += [it["guard"] for s in dm.neighbour_rows.values() for it in s]
    assert max(len(e["input_ids"]) for e in encodings) == 48
    cut = dm.behaviour_rows["longdoc"]["train"][0]["open"]
    target = dm.tokenizer("word 0", add_special_tokens=False)["input_ids"]
    assert cut["input_ids"][-len(target) - 1:-1] == target  # the end: the target after the prompt's end
