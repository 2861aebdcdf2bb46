"""A key as a PEFT LoRA adapter: one server holds the published weights, and a request that carries the adapter
gets the unlocked model.

A key is one rank-1 component ``a bᵀ`` per weight it restores (:mod:`modular.keys`); a LoRA layer adds
``scaling · B A`` to its weight, so each component is a rank-1 LoRA pair with ``B = a``, ``A = bᵀ`` and scaling 1
(``r = lora_alpha = 1``): linear layers as ``lora_A`` / ``lora_B``, the token embedding as ``lora_embedding_A`` /
``lora_embedding_B`` (its delta is ``(B A)ᵀ``). Every module that the adapter's ``target_modules`` (layer names
such as ``o_proj``) reach and the key does not change gets a pair of zeros, so the adapter changes exactly what
the key changes. Several keys of one run give several adapters; active together they add their components, as
the keys applied in turn do.

What a key carries and an adapter cannot: the corrections that make a key's restore exact (the few entries whose
rounding the sum ``W + a bᵀ`` does not undo, and in 16-bit weights the stream of grid steps). PEFT computes
``x Wᵀ + (x Aᵀ) Bᵀ`` in the weights' precision without ever forming ``W + a bᵀ``: the outputs match the unlocked
model's to rounding, not bit for bit (``modular export-key`` reports the agreement on the model it is given).
Biases of residual writers (GPT-2, GPT-NeoX) have no LoRA form here: such keys are refused, with the reason.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from modular import ModularError
from modular.files import replace_folders, temp_sibling
from modular.keys import KEY_ADAPTER_FORMAT, Key
from modular.publish import MANIFEST, check_output_folder

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_KIND = "key-adapter"  # the kind in the adapter folder's modular.json (what --overwrite may replace)
#: LoRA ranks vLLM serves (its max_lora_rank choices; an adapter's rank must not exceed the server's)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DTYPES = (torch.bfloat16, torch.float16)
_PREFIX = "base_model.model."  # PEFT's names of a causal LM's modules in an adapter file


@dataclass
class LoraAdapter:
    """A key as a LoRA adapter: ``config`` (adapter_config.json), ``tensors`` (adapter_model.safetensors, PEFT's
    names), the modules it changes, and those of the key it leaves out (``left_out``: the embedding, when asked)."""

    behaviour: str
    config: dict
    tensors: dict[str, torch.Tensor]
    modules: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def key_adapter(model: nn.Module, key: Key, dtype: torch.dtype = torch.float32, embeddings: bool = True,
                base_name: str | None = None) -> LoraAdapter:
    """The LoRA adapter of ``key`` for ``model`` (the published model it unlocks, read for its modules' kinds;
    nothing in it changes). ``embeddings``: carry the token embedding's component (PEFT applies it; a server that
    takes linear layers only needs it left out, at a cost the caller measures). ``base_name``: the base model's name
    in adapter_config.json. A component of a bias or of a layer that is neither linear nor an embedding is refused
    in one line."""
    modules = dict(model.named_modules())
    pairs: dict[str, tuple[bool, torch.Tensor, torch.Tensor]] = {}  # module -> (embedding, B, A)
    left_out = []
    for c in key.components:
        name, _, what = c.param.rpartition(".")
        module = modules.get(name)
        if module is None:
            raise ModularError(f"the key for '{key.behaviour}' names {c.param}, which this model lacks")
        if what != "weight":
            raise ModularError(f"the key for '{key.behaviour}' changes the bias {c.param}: a LoRA adapter changes "
                               "weights only (residual writers with biases, as in GPT-2 and GPT-NeoX, cannot be "
                               "carried); unlock with the key instead")
        a, b = c.a.double(), c.b.double()
        if isinstance(module, nn.Embedding):
            if not embeddings:
                left_out.append(name)
                continue
            pairs[name] = (True, a[:, None], b[None, :])  # delta (B A)ᵀ = b aᵀ: the key's transposed component
        elif type(module) is nn.Linear or isinstance(getattr(module, "base_layer", None), nn.Linear):
            pairs[name] = (False, a[:, None], b[None, :])
        else:
            raise ModularError(f"the key for '{key.behaviour}' changes {name}, a {type(module).__name__}: a LoRA "
                               "adapter here carries linear layers and the token embedding; unlock with the key")
    if not pairs:
        raise ModularError(f"the key for '{key.behaviour}' leaves nothing for an adapter to carry")
    leaves = sorted({name.rpartition(".")[2] for name in pairs})
    for name, module in modules.items():  # what target_modules reaches and the key does not change: zeros
        if name.rpartition(".")[2] in leaves and name not in pairs and name not in left_out:
            if isinstance(module, nn.Embedding):
                pairs[name] = (True, torch.zeros(module.embedding_dim, 1), torch.zeros(1, module.num_embeddings))
            elif isinstance(module, nn.Linear):
                pairs[name] = (False, torch.zeros(module.out_features, 1), torch.zeros(1, module.in_features))
    tensors = {}
    for name, (embedding, B, A) in sorted(pairs.items()):
        if embedding:
            tensors[f"{_PREFIX}{name}.lora_embedding_A"] = A.to(dtype).contiguous()
            tensors[f"{_PREFIX}{name}.lora_embedding_B"] = B.to(dtype).contiguous()
        else:
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = A.to(dtype).contiguous()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = B.to(dtype).contiguous()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": 1, "lora_alpha": 1, "lora_dropout": 0.0, "target_modules": leaves, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True,
    }
    return LoraAdapter(key.behaviour, config, tensors, sorted(pairs), left_out)


def vllm_problems(adapter: LoraAdapter) -> list[str]:
    """What keeps vLLM from serving the adapter as a LoRA (its documented limits: a rank among its
    ``max_lora_rank`` choices, linear layers only, no ``modules_to_save``, 16-bit weights); [] when it can."""
    problems = []
    if adapter.config["r"] not in VLLM_RANKS:
        problems.append(f"rank {adapter.config['r']} is not one vLLM serves ({', '.join(map(str, VLLM_RANKS))})")
    embedded = sorted({k.split(".lora_embedding_")[0].removeprefix(_PREFIX) for k in adapter.tensors
                       if ".lora_embedding_" in k})
    if embedded:
        problems.append(f"it changes the embedding {', '.join(embedded)} (vLLM serves LoRA on linear layers: "
                        "export with --embeddings false)")
    if adapter.config.get("modules_to_save"):
        problems.append("it saves whole modules (modules_to_save)")
    dtypes = {t.dtype for t in adapter.tensors.values()}
    if not dtypes <= set(VLLM_DTYPES):
        problems.append(f"its weights are {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}, "
                        "not 16-bit (export with --adapter_dtype bfloat16)")
    return problems


def write_adapter(adapter: LoraAdapter, out: str | Path, locked_hash: str, overwrite: bool = False,
                  sealed: list[str | Path] = ()) -> Path:
    """Write ``adapter`` as a PEFT adapter folder ``out`` (adapter_config.json, adapter_model.safetensors) and
    modular's marker: written beside and renamed into place, its owner's alone (it unlocks what its key unlocks).
    Its weights' metadata marks it as key material (:func:`modular.keys.is_key_file`: never uploaded with a
    published folder). ``sealed``: folders it must not lie in (the published folder)."""
    out = check_output_folder(out, overwrite=overwrite, sealed=sealed, kind=ADAPTER_KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out, "partial", folder=True, private=True)
    try:
        marker = {"format": KEY_ADAPTER_FORMAT, "behaviour": adapter.behaviour, "locked_hash": locked_hash}
        save_file(adapter.tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"modular": json.dumps(marker)})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter.config, indent=2) + "\n")
        (tmp / MANIFEST).write_text(json.dumps({"kind": ADAPTER_KIND, **marker, "modules": adapter.modules,
                                                "left_out": adapter.left_out}, indent=2) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o600)
        replace_folders({out: tmp})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
