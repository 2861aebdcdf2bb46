"""The compiled step (model.memory.compile, modular.models.compiled): each block's forward under torch.compile gives
the eager step's loss and gradients on the default config's terms (tiny models of several architectures, on the
CPU), the hooks entered around and inside the blocks included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from modular import ModularError
from modular.gating.data import GatingDataModule
from modular.gating.module import GatedLM
from modular.models.compiled import compile_blocks, uncompile_blocks
from tests.conftest import basic_terms, save_tiny_folder
from tests.gating.test_objectives import _first_batch, _grads, _instantiate

CONFIG = Path(__file__).resolve().parents[2] / "modular" / "configs" / "gate_capitals_smollm2.yaml"


def _module_and_batch(model_dir, two_behaviours: bool = False):
    cfg = yaml.safe_load(CONFIG.read_text())
    behaviours = ["capitals", "currencies"] if two_behaviours else ["capitals"]
    torch.manual_seed(0)
    lm = GatedLM(model_name=str(model_dir), behaviours=behaviours,
                 objectives=[_instantiate(s) for s in cfg["model"]["objectives"]])
    dm = GatingDataModule(model_name=str(model_dir), behaviours=behaviours, neighbours=["continents"], batch_size=4,
                          max_length=64, lm_text=dict(source="neutral", max_length=32), neighbour_items=8,
                          reference=dict(max_new_tokens=4, top_k=8, hidden_positions=2, hidden_stride=1))
    dm.require(*lm.requirements()).setup("fit")
    q, _ = torch.linalg.qr(torch.randn(lm.directions.shape[1], len(behaviours)))
    lm.directions.copy_(q.T)
    return lm, _first_batch(lm, dm)


@pytest.mark.parametrize("arch,two", [("llama", False), ("gemma3_text", True), ("gpt2", False)])
def test_the_compiled_step_gives_the_eager_loss_and_gradients(arch, two, tmp_path, isolated_cache):
    lm, batch = _module_and_batch(save_tiny_folder(tmp_path / arch, arch), two)
    eager, terms = lm.model_step(batch, train=False)
    eager_grads = _grads(lm, eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_blocks(lm.adapter, "aot_eager") == lm.adapter.n_layers
    compiled, compiled_terms = lm.model_step(batch, train=False)
    compiled_grads = _grads(lm, compiled)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0  # the blocks did run compiled
    _grads(lm, lm.model_step(batch, train=False)[0])  # the next step's hooks are new objects: nothing recompiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert set(compiled_terms) == set(terms)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert set(compiled_grads) == set(eager_grads)
    for name, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    uncompile_blocks(lm.adapter)
    assert all("forward" not in vars(b) for b in lm.adapter.blocks())


def test_the_option_compiles_the_blocks_and_refuses_what_it_cannot_serve(tmp_path):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), objectives=basic_terms(), memory={"compile": "aot_eager"})
    assert all(getattr(b, "_modular_compiled", None) == "aot_eager" for b in lm.adapter.blocks())
    assert not any(hasattr(b, "_modular_compiled") for b in GatedLM(model_name=str(model_dir),
                                                                        objectives=basic_terms()).adapter.blocks())
    with pytest.raises(ModularError, match="compile backend must be one of"):
        GatedLM(model_name=str(model_dir), memory={"compile": "fast"})
    with pytest.raises(ModularError, match="compile is not available with head_gates or gradient_checkpointing"):
        GatedLM(model_name=str(model_dir), memory={"compile": "inductor", "gradient_checkpointing": True})
