import json

import pytest
import torch

from modular import ModularError
from modular.models.adapter import SUPPORTED_ARCHITECTURES, ArchitectureAdapter, check_supported
from tests.conftest import ARCHS, HEADS, LAYERS, D


def test_every_supported_architecture_is_tested():
    assert set(ARCHS) == set(SUPPORTED_ARCHITECTURES)


def test_adapter_sizes(tiny_model):
    a = ArchitectureAdapter(tiny_model)
    assert (a.n_layers, a.n_heads, a.head_dim, a.d_model) == (LAYERS, HEADS, D // HEADS, D)
    desc = a.describe()
    json.dumps(desc)
    names = dict(tiny_model.named_modules())
    for name in desc["writers"] + desc["writer_projections"] + desc["readers"]:
        assert name in names, name
    assert len(desc["writer_projections"]) == len(a.spec.embeddings) + 2 * LAYERS


def test_writes_sum_to_residual(tiny_model, tokens):
    """Each block adds exactly its attention and MLP writes to the residual stream (checks the map)."""
    from modular.hooks import capture_residual, capture_writes

    a = ArchitectureAdapter(tiny_model)
    with capture_writes(a) as writes, capture_residual(a) as states:
        tiny_model(tokens)
    for i in range(a.n_layers):
        b = a.block_name(i)
        added = writes[f"{b}.{a.spec.attn_out}"] + writes[f"{b}.{a.spec.mlp_out}"]
        torch.testing.assert_close(states[i + 1] - states[i], added, atol=1e-4, rtol=1e-4)
    if a.model_type not in ("gemma", "gemma2"):  # these scale the embedding outside its module
        embeds = sum(w for n, w in writes.items() if n in a.spec.embeddings)
        torch.testing.assert_close(states[0], embeds.expand_as(states[0]), atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_one_clear_line():
    from transformers import BertConfig

    with pytest.raises(ModularError, match="unsupported architecture 'bert'; supported: .*llama"):
        check_supported(BertConfig())


def test_inspect_cli_on_saved_folder(tmp_path, arch, capsys):
    """``modular inspect FOLDER`` (in this process; tests/integration runs ``python -m modular inspect``)."""
    from modular.app import cli
    from tests.conftest import make_tiny_model

    make_tiny_model(arch).save_pretrained(tmp_path / arch)
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / arch), "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_layers"] == LAYERS and info["n_heads"] == HEADS and info["d_model"] == D
    assert info["head_dim"] == D // HEADS
