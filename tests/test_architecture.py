"""docs/architecture.md stays true: its floors are the layers contract, and its recipe for a new architecture works
as written (the recipes for a term, an attack and a behaviour are tests of their own, named on that page)."""

import re
from pathlib import Path

import pytest
import tomllib
import torch

from modular import ModularError
from modular.hooks import ablate_directions
from modular.keys import apply_key, lock_weights
from modular.models import adapter as adapters
from tests.conftest import HEADS, KV, LAYERS, VOCAB, D

ROOT = Path(__file__).resolve().parents[1]


def _contract_floors() -> list[list[str]]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [[m.strip() for m in floor.split("|")] for floor in layers]


def _page_floors() -> list[list[str]]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Floors", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [re.findall(r"`(modular\.[a-z_.]+)`", re.split(r"(?<!\\)\|", row)[2]) for row in rows]


def test_the_pages_floors_are_the_layers_contract():
    assert _page_floors() == _contract_floors()
    # every package and top-level module of modular is on a floor (the root package and __main__ aside)
    packaged = {f"modular.{p.stem if p.is_file() else p.name}" for p in (ROOT / "modular").iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.stem not in ("__init__", "__main__")}
    assert packaged == {m for floor in _contract_floors() for m in floor}


def _tiny_stablelm():
    from transformers import AutoModelForCausalLM, StableLmConfig

    torch.manual_seed(0)
    config = StableLmConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norm gains and biases, so that the norms are exercised
        for name, p in model.named_parameters():
            if "layernorm" in name or name.startswith("model.norm"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(p))
    return model


def test_a_new_architecture_is_one_spec(monkeypatch, tokens):
    """StableLM (not supported) is refused in one line; one ArchSpec in SUPPORTED_ARCHITECTURES, and nothing else,
    makes the lock in its weights do what the hooks do, and its key restore the open model."""
    model = _tiny_stablelm()
    with pytest.raises(ModularError, match="unsupported architecture 'stablelm'"):
        adapters.ArchitectureAdapter(model)
    spec = adapters.ArchSpec(
        embeddings=("model.embed_tokens",), blocks="model.layers", final_norm="model.norm", unembed="lm_head",
        attn_out="self_attn.o_proj", mlp_out="mlp.down_proj",
        attn_readers=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        mlp_readers=("mlp.gate_proj", "mlp.up_proj"), attn_pre_norm="input_layernorm",
        mlp_pre_norm="post_attention_layernorm")
    monkeypatch.setitem(adapters.SUPPORTED_ARCHITECTURES, "stablelm", spec)
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    with torch.no_grad():
        open_logits = model(tokens).logits
        with ablate_directions(adapters.ArchitectureAdapter(model), u[None]):
            hook_locked = model(tokens).logits
        (key,) = lock_weights(model, {"b": u}, harden=True)
        torch.testing.assert_close(model(tokens).logits, hook_locked, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(hook_locked, open_logits, atol=1e-3)
        apply_key(model, key)
        torch.testing.assert_close(model(tokens).logits, open_logits, atol=1e-5, rtol=1e-5)
