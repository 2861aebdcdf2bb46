"""Gradient checkpointing in the gated module: the same loss and gradients on the same batch (the locked pieces'
ablation is replayed in the recomputed blocks), and refused with head gates."""

import pytest
import torch

from modular import ModularError
from modular.gating.module import GatedLM
from modular.gating.objectives import BehaviourAnswer, KeepHidden, KeepReference, LockedState
from tests.conftest import save_tiny_folder
from tests.gating.test_objectives import _capitals_step


def _step(model_dir, **options):
    torch.manual_seed(0)
    lm, batch = _capitals_step(model_dir, **options)
    torch.manual_seed(1)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))
    lm.train()
    loss, _ = lm.model_step(batch, train=True)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("finetuning", ["full", "lora"])
@pytest.mark.parametrize("keep_hidden", [False, True])
def test_checkpointed_step_has_the_same_loss_and_gradients(tmp_path, isolated_cache, finetuning, keep_hidden):
    """Also with KeepHidden, whose gradient reaches the recomputed blocks' outputs directly (the large config has it)."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "qwen2")
    kw = dict(finetuning={"mode": finetuning})
    if keep_hidden:
        kw.update(objectives=[BehaviourAnswer(), LockedState(), KeepReference(parts=["retain"]),
                              KeepHidden(weight=30.0, parts=["retain"])],
                  data=dict(reference=dict(max_new_tokens=4, top_k=8, hidden_positions=3, hidden_stride=1)))
    loss, grads = _step(model_dir, **kw)
    loss_ckpt, grads_ckpt = _step(model_dir, memory={"gradient_checkpointing": True}, **kw)
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert set(grads) == set(grads_ckpt) and grads
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5)


def test_checkpointing_is_refused_with_head_gates(tmp_path):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    with pytest.raises(ModularError, match="not available with head_gates"):
        GatedLM(model_name=str(model_dir), behaviours=["capitals"], head_gates={},
                memory={"gradient_checkpointing": True})
