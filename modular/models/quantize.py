"""Weight-only quantisation, as people apply it to released weights before serving them.

``int8`` and ``int4``: every linear layer's weights quantised by optimum-quanto (per output channel for int8, in
groups along the input for int4; activations stay in the model's precision), on any device, the unembedding kept
in full precision as quantised releases usually do. ``none``: the model as it is.
"""

from __future__ import annotations

from typing import Literal

from modular import ModularError

Scheme = Literal["none", "int8", "int4"]
SCHEMES = ("none", "int8", "int4")


def quantize_weights(model, scheme: str):
    """Quantise ``model``'s linear weights in place (``scheme``: none, int8 or int4) and return it."""
    if scheme not in SCHEMES:
        raise ModularError(f"unknown quantisation '{scheme}' ({', '.join(SCHEMES)})")
    if scheme == "none":
        return model
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError as err:  # a dependency of modular; a broken install says so in one line
        raise ModularError(f"quantisation needs optimum-quanto (pip install optimum-quanto): {err}") from None
    unembed = model.get_output_embeddings()
    keep = [name for name, module in model.named_modules() if module is unembed]
    quantize(model, weights={"int8": qint8, "int4": qint4}[scheme], exclude=keep or None)
    freeze(model)
    return model.eval()
