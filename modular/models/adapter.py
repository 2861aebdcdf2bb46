"""The architecture adapter: the ONLY place in modular that knows Hugging Face module paths.

For every supported architecture one :class:`ArchSpec` maps canonical parts
(token embedding, blocks, attention output projection, MLP output projection,
norms, readers) to module paths. Everything else in modular asks the
:class:`ArchitectureAdapter` for modules and never spells a path itself.

Terms
-----
*residual writers*: modules whose output is added to the residual stream
(token/position embeddings, each attention output projection, each MLP output
projection). In architectures with a norm after the sublayer (Gemma 2/3, OLMo 2)
the write is ``post_norm(proj(x))``; ``WriteSite.post_norm`` names that norm.

*residual readers*: modules that read the residual stream through a norm
(query/key/value, MLP input projections, the unembedding).

*head input*: the input of the attention output projection, where the heads are
still separate (``(batch, seq, n_heads * head_dim)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from modular import ModularError


@dataclass(frozen=True)
class ArchSpec:
    """Module paths of one architecture. Block-level paths are relative to a block."""

    embeddings: tuple[str, ...]
    blocks: str
    final_norm: str
    unembed: str
    attn_out: str
    mlp_out: str
    attn_readers: tuple[str, ...]
    mlp_readers: tuple[str, ...]
    attn_pre_norm: str | None = None
    mlp_pre_norm: str | None = None
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    #: the norm multiplies by ``weight + gain_offset`` (Gemma stores ``gain - 1``).
    gain_offset: float = 0.0
    #: config attributes holding the number of attention heads, first found wins.
    head_attrs: tuple[str, ...] = ("num_attention_heads", "n_head")


_LLAMA = ArchSpec(
    embeddings=("model.embed_tokens",),
    blocks="model.layers",
    final_norm="model.norm",
    unembed="lm_head",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    attn_readers=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    mlp_readers=("mlp.gate_proj", "mlp.up_proj"),
    attn_pre_norm="input_layernorm",
    mlp_pre_norm="post_attention_layernorm",
)
_GEMMA = ArchSpec(**{**_LLAMA.__dict__, "gain_offset": 1.0})
_GEMMA2 = ArchSpec(
    **{
        **_LLAMA.__dict__,
        "mlp_pre_norm": "pre_feedforward_layernorm",
        "attn_post_norm": "post_attention_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
        "gain_offset": 1.0,
    }
)
_OLMO2 = ArchSpec(
    **{
        **_LLAMA.__dict__,
        "attn_pre_norm": None,
        "mlp_pre_norm": None,
        "attn_post_norm": "post_attention_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    }
)
_PHI3 = ArchSpec(
    **{**_LLAMA.__dict__, "attn_readers": ("self_attn.qkv_proj",), "mlp_readers": ("mlp.gate_up_proj",)}
)
_GPT2 = ArchSpec(
    embeddings=("transformer.wte", "transformer.wpe"),
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    unembed="lm_head",
    attn_out="attn.c_proj",
    mlp_out="mlp.c_proj",
    attn_readers=("attn.c_attn",),
    mlp_readers=("mlp.c_fc",),
    attn_pre_norm="ln_1",
    mlp_pre_norm="ln_2",
)
_NEOX = ArchSpec(
    embeddings=("gpt_neox.embed_in",),
    blocks="gpt_neox.layers",
    final_norm="gpt_neox.final_layer_norm",
    unembed="lm_head",
    attn_out="attention.dense",
    mlp_out="mlp.dense_4h_to_h",
    attn_readers=("attention.query_key_value",),
    mlp_readers=("mlp.dense_h_to_4h",),
    attn_pre_norm="input_layernorm",
    mlp_pre_norm="post_attention_layernorm",
)

#: model_type -> module paths. Add an architecture here and nowhere else.
SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "olmo": _LLAMA,
    "olmo2": _OLMO2,
    "phi3": _PHI3,
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    "gpt2": _GPT2,
    "gpt_neox": _NEOX,
}


def check_supported(config) -> ArchSpec:
    """Return the spec of ``config.model_type`` or raise one clear line naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModularError(
            f"unsupported architecture '{model_type}'; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return SUPPORTED_ARCHITECTURES[model_type]


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


@dataclass
class WriteSite:
    """One residual write: ``module`` produces it (through ``post_norm`` when not None)."""

    name: str
    layer: int  # -1 for embeddings
    kind: str  # "embed" | "attn" | "mlp"
    module: nn.Module
    post_norm: nn.Module | None = None
    post_norm_name: str | None = None


@dataclass
class ArchitectureAdapter:
    """Canonical view of a causal LM's residual stream, built from its spec."""

    model: nn.Module
    spec: ArchSpec = field(init=False)

    def __post_init__(self) -> None:
        self.spec = check_supported(self.model.config)
        self._blocks = _get(self.model, self.spec.blocks)

    # --- sizes -----------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    @property
    def n_layers(self) -> int:
        return len(self._blocks)

    @property
    def n_heads(self) -> int:
        cfg = self.model.config
        for attr in self.spec.head_attrs:
            if getattr(cfg, attr, None):
                return int(getattr(cfg, attr))
        raise ModularError(f"config of '{self.model_type}' names no head count")

    @property
    def head_dim(self) -> int:
        return in_features(self.attn_out(0)) // self.n_heads

    @property
    def d_model(self) -> int:
        return out_features(self.attn_out(0))

    # --- modules ---------------------------------------------------------------------------
    def block(self, i: int) -> nn.Module:
        return self._blocks[i]

    def blocks(self) -> list[nn.Module]:
        return list(self._blocks)

    def block_name(self, i: int) -> str:
        return f"{self.spec.blocks}.{i}"

    def embeddings(self) -> list[nn.Module]:
        return [_get(self.model, p) for p in self.spec.embeddings]

    def attn_out(self, i: int) -> nn.Module:
        return _get(self.block(i), self.spec.attn_out)

    def set_attn_out(self, i: int, module: nn.Module) -> None:
        """Replace layer ``i``'s attention output projection (used to install wrapper modules)."""
        parent_path, _, name = self.spec.attn_out.rpartition(".")
        parent = _get(self.block(i), parent_path) if parent_path else self.block(i)
        setattr(parent, name, module)

    def mlp_out(self, i: int) -> nn.Module:
        return _get(self.block(i), self.spec.mlp_out)

    def final_norm(self) -> nn.Module:
        return _get(self.model, self.spec.final_norm)

    def unembed(self) -> nn.Module:
        return _get(self.model, self.spec.unembed)

    def _opt(self, i: int, rel: str | None) -> nn.Module | None:
        return None if rel is None else _get(self.block(i), rel)

    def write_sites(self) -> list[WriteSite]:
        """Every residual write in forward order."""
        sites = [WriteSite(p, -1, "embed", _get(self.model, p)) for p in self.spec.embeddings]
        for i in range(self.n_layers):
            b = self.block_name(i)
            for kind, rel, post in (
                ("attn", self.spec.attn_out, self.spec.attn_post_norm),
                ("mlp", self.spec.mlp_out, self.spec.mlp_post_norm),
            ):
                sites.append(
                    WriteSite(
                        f"{b}.{rel}",
                        i,
                        kind,
                        _get(self.block(i), rel),
                        self._opt(i, post),
                        None if post is None else f"{b}.{post}",
                    )
                )
        return sites

    def reader_names(self) -> list[str]:
        names = []
        for i in range(self.n_layers):
            b = self.block_name(i)
            names += [f"{b}.{r}" for r in self.spec.attn_readers + self.spec.mlp_readers]
        names.append(self.spec.unembed)
        return names

    def read_sites(self) -> list[tuple[nn.Module | None, list[nn.Module]]]:
        """(norm or None, modules reading through it) for every residual read, final unembedding last."""
        out = []
        for i in range(self.n_layers):
            blk = self.block(i)
            out.append((self._opt(i, self.spec.attn_pre_norm), [_get(blk, r) for r in self.spec.attn_readers]))
            out.append((self._opt(i, self.spec.mlp_pre_norm), [_get(blk, r) for r in self.spec.mlp_readers]))
        out.append((self.final_norm(), [self.unembed()]))
        return out

    def norm_gain(self, norm: nn.Module) -> torch.Tensor | None:
        """Effective elementwise gain of a norm (``weight + offset``), or None if it has none. A weight sharded by
        FSDP2 (a DTensor outside its block's forward pass) is gathered whole: every process must ask alike."""
        weight = getattr(norm, "weight", None)
        if weight is None:
            return None
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight + self.spec.gain_offset

    def describe(self) -> dict:
        """The JSON-friendly map printed by ``modular inspect``."""
        sites = self.write_sites()
        return {
            "model_type": self.model_type,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "d_model": self.d_model,
            "n_kv_heads": getattr(self.model.config, "num_key_value_heads", self.n_heads),
            "tied_embeddings": bool(getattr(self.model.config, "tie_word_embeddings", False)),
            "embeddings": list(self.spec.embeddings),
            "blocks": self.spec.blocks,
            "head_input": f"{self.spec.blocks}.<i>.{self.spec.attn_out} (input)",
            "post_sublayer_norms": self.spec.attn_post_norm is not None,
            "final_norm": self.spec.final_norm,
            "unembed": self.spec.unembed,
            "writers": [s.post_norm_name or s.name for s in sites],
            "writer_projections": [s.name for s in sites],
            "readers": self.reader_names(),
        }


# --- weight orientation (handles GPT-2 Conv1D) -----------------------------------------------
def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _unwrap(module: nn.Module) -> nn.Module:
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def in_features(module: nn.Module) -> int:
    module = _unwrap(module)
    if _is_conv1d(module):
        return module.weight.shape[0]
    return module.in_features


def out_features(module: nn.Module) -> int:
    module = _unwrap(module)
    if _is_conv1d(module):
        return module.weight.shape[1]
    return module.out_features


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``(out_features, in_features)`` (a view; Conv1D stores it transposed)."""
    if isinstance(module, nn.Embedding):
        return module.weight.T
    if _is_conv1d(module):
        return module.weight.T
    return module.weight
