import warnings

import torch
from transformers.pytorch_utils import Conv1D

from modular.models.lora import with_lora


def test_with_lora_adapts_every_linear_layer_but_the_unembedding_and_freezes_the_rest(tiny_model):
    """The one LoRA layout (training, the open model's reconstruction, the attacker): adapters of the given rank
    on every linear layer of the blocks, none on the unembedding, only adapters trainable; peft's use of a
    deprecated transformers property does not reach the user as a FutureWarning."""
    layers = (torch.nn.Linear, Conv1D)  # GPT-2's linear layers are Conv1D
    linear = {n for n, m in tiny_model.named_modules() if isinstance(m, layers)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = with_lora(tiny_model, 4, 8)
    adapted = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == linear - {"lm_head"}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {p.shape[0] for n, p in model.named_parameters() if ".lora_A." in n} == {4}
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    assert layer.scaling["default"] == 8 / 4
