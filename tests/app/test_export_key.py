"""``modular export-key``: a published folder's key as a PEFT adapter, checked against the key's unlock and refused,
in one line and before anything is written, for a key of other weights."""

import json

import torch

from modular.app.cli import main
from modular.publish import publish_model
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer


def _release(tmp_path, seed: int = 0):
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(seed)), dim=0)
    return publish_model(make_tiny_model("llama", seed=seed), make_tiny_tokenizer(), {"capitals": u},
                         tmp_path / f"pub{seed}", "tiny")


def test_export_key_writes_an_adapter_that_answers_as_the_key_unlocks(tmp_path, capsys):
    pub, keys = _release(tmp_path)
    key = keys / "capitals.key.safetensors"
    assert main(["export-key", "--key", str(key), "--model", str(pub), "--check", "6"]) == 0
    folder = tmp_path / "pub0-keys-capitals-peft"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(folder)
    check = json.loads((folder / "adapter_check.json").read_text())
    assert set(check["sets"]) == {"retain", "capitals"} and check["published_dtype"] == "float32"
    for row in check["sets"].values():
        assert row["n"] == 6 and row["greedy_agreement"] == 1.0 and row["first_token_kl"] < 1e-8
    assert not any(p.name.startswith("adapter") for p in pub.iterdir())  # nothing is written in the published folder
    # without the embedding (what vLLM serves), in bf16: the cost is measured, not assumed
    out = tmp_path / "lean"
    assert main(["export-key", "--key", str(key), "--model", str(pub), "--out", str(out), "--embeddings", "false",
                 "--adapter_dtype", "bfloat16", "--check", "6"]) == 0
    lean = json.loads((out / "adapter_check.json").read_text())
    assert lean["vllm_problems"] == [] and lean["embeddings"] is False
    assert lean["sets"]["retain"]["first_token_kl"] > check["sets"]["retain"]["first_token_kl"]


def test_a_key_of_other_weights_is_refused_before_anything_is_written(tmp_path, capsys):
    pub, _ = _release(tmp_path, seed=0)
    _, other_keys = _release(tmp_path, seed=1)
    out = tmp_path / "adapter"
    capsys.readouterr()
    assert main(["export-key", "--key", str(other_keys / "capitals.key.safetensors"), "--model", str(pub),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: key 'capitals.key.safetensors' belongs to other weights") and "\n" not in err
    assert not out.exists()
