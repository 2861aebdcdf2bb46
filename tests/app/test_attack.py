"""Which behaviours `evaluate.py attack` attacks, and with which data, before any model is loaded."""

import pytest
import torch

from modular import ModularError
from modular.evaluation.commands import attack
from modular.publish import publish_model
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def published(tmp_path):
    u = torch.zeros(D)
    u[0] = 1.0
    out, _ = publish_model(make_tiny_model("llama"), make_tiny_tokenizer(), {"mine": u}, tmp_path / "pub", "tiny")
    return out


def test_attack_needs_the_data_of_a_behaviour_gated_from_user_data(published, monkeypatch):
    with pytest.raises(ModularError, match=r"gated from user data: give it as --behaviour mine=<"):
        attack(str(published))  # the manifest names 'mine', not where its data is
    with pytest.raises(ModularError, match="behaviour 'capitals' is not locked"):
        attack(str(published), behaviour="capitals")
    with pytest.raises(ModularError, match="behaviour 'other' is not locked"):
        attack(str(published), behaviour="other=/data/mine.jsonl")

    # a data file named by its stem, or NAME=<file>, is the locked behaviour's data: the attack goes on to load it
    import modular.data as data

    seen = []

    def stop(source, **kw):
        seen.append(source)
        raise ModularError("stop")

    monkeypatch.setattr(data, "load_behaviour", stop)
    for spec in ("/data/mine.jsonl", "mine=/data/other.jsonl"):
        with pytest.raises(ModularError, match="stop"):
            attack(str(published), behaviour=spec, n_examples=[8], base=str(published))
    assert seen == ["/data/mine.jsonl", "/data/other.jsonl"]
