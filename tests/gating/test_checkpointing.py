"""Gradient checkpointing in the gated module: the same loss and gradients on the same batch (the locked pieces'
ablation is replayed in the recomputed blocks), and refused with head gates."""

import pytest
import torch

from modular import ModularError
from modular.gating.data import GatingDataModule
from modular.gating.module import GatedLM
from tests.conftest import save_tiny_folder


def _step(model_dir, **options):
    torch.manual_seed(0)
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"], locked_steering=0.0, **options)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], batch_size=4, max_length=64,
                          reference_max_new_tokens=4, reference_top_k=8, neighbours=[])
    dm.setup("fit")

    class _Trainer:  # model_step reads the tokenizer's pad id from the trainer's data module
        datamodule = dm

    lm._trainer = _Trainer()
    batch = next(iter(dm.train_dataloader()))
    batch = batch[0] if isinstance(batch, tuple) else batch
    lm.train()
    loss, _ = lm.model_step(batch, train=True)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_checkpointed_step_has_the_same_loss_and_gradients(tmp_path, isolated_cache, finetuning):
    model_dir = save_tiny_folder(tmp_path / "tiny", "qwen2")
    loss, grads = _step(model_dir, finetuning=finetuning)
    loss_ckpt, grads_ckpt = _step(model_dir, finetuning=finetuning, gradient_checkpointing=True)
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert set(grads) == set(grads_ckpt) and grads
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5)


def test_checkpointing_is_refused_with_head_gates(tmp_path):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    with pytest.raises(ModularError, match="not available with head_gates"):
        GatedLM(model_name=str(model_dir), behaviours=["capitals"], head_gates=True, gradient_checkpointing=True)
