"""Publishing locked weights and unlocking them with keys, on tiny models (no modular needed to load)."""

import json
import subprocess
import sys

import pytest
import torch

from modular import ModularError
from modular.hooks import ablate_directions
from modular.models.adapter import ArchitectureAdapter
from modular.publish import publish_model, unlock_folder
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer


def _dirs(k=1):
    q = torch.linalg.qr(torch.randn(D, k, generator=torch.Generator().manual_seed(3)))[0].T
    return {f"b{i}": q[i] for i in range(k)}


@pytest.fixture
def tok():
    return make_tiny_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_publish_loads_without_modular_and_unlocks_exactly(tmp_path, tok, arch, tokens):
    model = make_tiny_model(arch)
    open_logits = model(tokens).logits
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    dirs = _dirs()
    with ablate_directions(ArchitectureAdapter(model), dirs["b0"]):
        hook_locked = model(tokens).logits
    out = publish_model(model, tok, dirs, tmp_path / "pub", "tiny")
    assert (out / "keys" / "b0.key.safetensors").exists() and (out / "README.md").exists()
    # a plain transformers process loads it (modular not imported) and gives the hook-locked logits
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM;"
        f"m = AutoModelForCausalLM.from_pretrained(r'{out}', dtype=torch.float32).eval();"
        f"ids = torch.tensor({tokens.tolist()});"
        "print(m(ids).logits.flatten().tolist()); assert 'modular' not in sys.modules"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    published_logits = torch.tensor(json.loads(res.stdout)).reshape(hook_locked.shape)
    torch.testing.assert_close(published_logits, hook_locked, atol=1e-4, rtol=1e-4)
    unlocked = unlock_folder(out, out / "keys" / "b0.key.safetensors", tmp_path / "unlocked")
    from modular.models import load_model

    m = load_model(unlocked)
    torch.testing.assert_close(m(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    diff = max((m.state_dict()[k] - v).abs().max().item() for k, v in open_state.items() if k in m.state_dict())
    assert diff <= 1e-6
    manifest = json.loads((unlocked / "modular.json").read_text())
    assert manifest["applied_keys"] == ["b0"]
    with pytest.raises(ModularError, match="already unlocked"):
        unlock_folder(unlocked, out / "keys" / "b0.key.safetensors", tmp_path / "again")


def test_key_for_other_weights_is_refused(tmp_path, tok):
    a = publish_model(make_tiny_model("llama", seed=0), tok, _dirs(), tmp_path / "a", "tiny")
    b = publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), tmp_path / "b", "tiny")
    with pytest.raises(ModularError, match="belongs to other weights"):
        unlock_folder(a, b / "keys" / "b0.key.safetensors", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (a / "modular.json").unlink()  # without the manifest the hash of the weights decides
    with pytest.raises(ModularError, match="belongs to other weights"):
        unlock_folder(a, b / "keys" / "b0.key.safetensors", tmp_path / "x")


def test_two_keys_unlock_one_behaviour_each(tmp_path, tok, tokens):
    model = make_tiny_model("llama")
    dirs = _dirs(2)
    a = ArchitectureAdapter(model)
    with ablate_directions(a, dirs["b1"]):
        only_b1_locked = model(tokens).logits
    open_logits = model(tokens).logits
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publish_model(model, tok, dirs, tmp_path / "pub", "tiny")
    one = unlock_folder(pub, pub / "keys" / "b0.key.safetensors", tmp_path / "one")
    from modular.models import load_model

    torch.testing.assert_close(load_model(one)(tokens).logits, only_b1_locked, atol=1e-4, rtol=1e-4)
    both = unlock_folder(one, pub / "keys" / "b1.key.safetensors", tmp_path / "both")
    torch.testing.assert_close(load_model(both)(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    restored = load_model(both).state_dict()  # the second key knows the first was applied: exact weights
    assert max((restored[k] - v).abs().max().item() for k, v in open_state.items() if k in restored) <= 1e-7


def test_interrupted_publish_leaves_nothing_that_looks_complete(tmp_path, tok, monkeypatch):
    model = make_tiny_model("llama")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tok), "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        publish_model(model, tok, _dirs(), tmp_path / "pub", "tiny")
    assert not (tmp_path / "pub").exists()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    with pytest.raises(ModularError, match="already exists"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
