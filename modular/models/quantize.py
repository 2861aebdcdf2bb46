"""Weight-only quantisation, as people apply it to released weights before serving them.

``int8`` and ``int4``: every linear layer's weights quantised by optimum-quanto (per output channel for int8, in
groups along the input for int4; activations stay in the model's precision), on any device, the unembedding kept
in full precision as quantised releases usually do. ``none``: the model as it is.

int4's group size is quanto's choice unless given: 128 inputs, or the largest multiple of 32 below it that divides
the layer's inputs (96 for SmolLM2-135M's 576), per output channel when none does. A model that was itself
distributed in 4 bits (a GGUF Q4_1 file, as SmolLM2-135M-Instruct here) lies on a grid of 32-input groups; int4 in
groups of 32 maps it to itself, and rounds back any change smaller than half a step of that grid.

``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``: llama.cpp's block formats, as a GGUF release stores the weights
(blocks of 32 inputs along each output row; ``_0`` a scale per block, ``_1`` a scale and a minimum), rounded by the
``gguf`` package's reference quantiser and read back in the model's precision. The same layers are rounded as for
int8 / int4; llama.cpp also rounds the embeddings and, inside its matrix products, the activations to 8 bits, which
is not simulated. Its k-quants (Q4_K_M, ...) have no reference quantiser in ``gguf`` and are not offered.
"""

from __future__ import annotations

from typing import get_args

import torch

from modular import ModularError
from modular.models.names import Scheme  # defined apart, without torch, for signatures

SCHEMES = get_args(Scheme)
GGUF_SCHEMES = tuple(s for s in SCHEMES if s.startswith("q"))  # llama.cpp's block formats
GGUF_BLOCK = 32  # inputs per block of every GGUF scheme here


def check_scheme(model, scheme: str, group_size: int | None = None) -> None:
    """Raise a one-line error unless ``scheme`` is known and can round every layer :func:`quantize_weights` would
    change in ``model`` (GGUF blocks of 32 inputs; int4's ``group_size``), before anything is changed."""
    if scheme not in SCHEMES:
        raise ModularError(f"unknown quantisation '{scheme}' ({', '.join(SCHEMES)})")
    if group_size is not None and scheme != "int4":
        raise ModularError(f"a group size applies to int4 only, not to '{scheme}'")
    check_group_size(model, group_size)
    if scheme in GGUF_SCHEMES:
        for name, module in quantized_layers(model).items():
            if module.in_features % GGUF_BLOCK:
                raise ModularError(f"{scheme} rounds blocks of {GGUF_BLOCK} inputs; {name} has {module.in_features}")


def check_group_size(model, group_size: int | None) -> None:
    """Raise a one-line error unless ``group_size`` (int4's inputs per group) suits every linear layer that
    quantisation would change in ``model`` (the unembedding is kept)."""
    if group_size is None:
        return
    if group_size <= 0 or group_size % 8:
        raise ModularError(f"int4 group size must be a positive multiple of 8, not {group_size}")
    for name, module in quantized_layers(model).items():
        if module.in_features % group_size:
            raise ModularError(f"int4 group size {group_size} does not divide the {module.in_features} inputs of {name}")


def quanto_group_size(in_features: int) -> int | None:
    """int4's inputs per group where none is given, as optimum-quanto chooses it: 128, or the largest multiple of 32
    below it that divides ``in_features``; None (one group per output channel) where none does or the layer is
    narrower than 128."""
    size = 128
    if in_features <= size:
        return None
    while in_features % size and size > 32:
        size -= 32
    return size if in_features % size == 0 else None


def quantized_layers(model) -> dict[str, torch.nn.Linear]:
    """The linear layers :func:`quantize_weights` quantises, by module name: every one but the unembedding."""
    unembed = model.get_output_embeddings()
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not unembed}


_UNPACK_ON_CPU: list = []  # the torch.library registration below, made once per process


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's ``unpack`` (``bits``-bit values packed in uint8, the lowest bits first, stacked along the first axis),
    in torch operations: the values of quanto's own reference implementation."""
    per = 8 // bits
    return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(per)]).to(torch.uint8)


def _unpack_without_a_build() -> None:
    """On the CPU, quanto unpacks int4 weights with a C++ kernel it compiles at first use into its own package folder:
    every new environment waits about a minute for the compiler (and fails without one). Unpacking is a few bit
    operations; the CPU kernel is replaced by :func:`_unpack`, which gives the same values, once per process."""
    if _UNPACK_ON_CPU:
        return
    import warnings

    import optimum.quanto.library  # noqa: F401  (defines quanto::unpack and registers its CPU kernel)

    library = torch.library.Library("quanto", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        library.impl("unpack", _unpack, "CPU")
    _UNPACK_ON_CPU.append(library)  # the registration lasts as long as its Library object


def dequantized(weight: torch.Tensor, scheme: str, group_size: int | None = None) -> torch.Tensor:
    """``weight`` (a linear layer's, ``(out, in)``) as :func:`quantize_weights` leaves it, read back in its own
    precision: the same quantiser (optimum-quanto's int8: absmax per output channel; int4: min-max in groups of
    ``group_size`` inputs, quanto's choice when None; the GGUF block formats: the ``gguf`` package's, on the CPU),
    on the weight's device. No gradient flows through it."""
    if scheme not in SCHEMES:
        raise ModularError(f"unknown quantisation '{scheme}' ({', '.join(SCHEMES)})")
    if scheme == "none":
        return weight.detach()
    if scheme in GGUF_SCHEMES:
        return _gguf_round_trip(weight.detach(), scheme)
    from optimum.quanto import qint4, qint8
    from optimum.quanto.tensor.optimizers import AbsmaxOptimizer, MaxOptimizer
    from optimum.quanto.tensor.weights import quantize_weight

    _unpack_without_a_build()

    w = weight.detach()
    with torch.no_grad():
        if scheme == "int8":
            scale = AbsmaxOptimizer()(w, qtype=qint8, axis=0)
            q = quantize_weight(w, qtype=qint8, axis=0, scale=scale, optimized=False)
        else:
            group = group_size if group_size is not None else quanto_group_size(w.shape[1])
            scale, shift = MaxOptimizer()(w, qtype=qint4, axis=0, group_size=group)
            q = quantize_weight(w, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=group, optimized=False)
        return q.dequantize().to(w.dtype)


def _gguf_round_trip(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """``weight`` ``(out, in)`` stored in a GGUF block format and read back: each output row in blocks of 32
    inputs, as llama.cpp lays out a linear layer's weight, in ``weight``'s dtype and on its device (the widths are
    checked by :func:`check_scheme`)."""
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError as err:  # a dependency of modular; a broken install says so in one line
        raise ModularError(f"GGUF quantisation needs gguf (pip install gguf): {err}") from None
    qtype = GGMLQuantizationType[scheme.upper()]
    rows = weight.float().cpu().numpy()
    back = quants.dequantize(quants.quantize(rows, qtype), qtype)
    return torch.from_numpy(back.reshape(rows.shape)).to(device=weight.device, dtype=weight.dtype)


def quantize_weights(model, scheme: str, group_size: int | None = None):
    """Quantise ``model``'s linear weights in place (``scheme``: one of :data:`SCHEMES`) and return it.
    ``group_size`` (int4 only): inputs per quantisation group, a multiple of 8 that divides every quantised layer's
    inputs. The GGUF schemes leave plain ``Linear`` layers holding the rounded weights."""
    check_scheme(model, scheme, group_size)  # before anything is changed
    if scheme == "none":
        return model
    if scheme in GGUF_SCHEMES:
        with torch.no_grad():
            for module in quantized_layers(model).values():
                module.weight.copy_(_gguf_round_trip(module.weight, scheme))
        return model.eval()
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
        from optimum.quanto.nn import QModuleMixin
    except ImportError as err:  # a dependency of modular; a broken install says so in one line
        raise ModularError(f"quantisation needs optimum-quanto (pip install optimum-quanto): {err}") from None
    _unpack_without_a_build()
    unembed = model.get_output_embeddings()
    keep = [name for name, module in model.named_modules() if module is unembed]
    quantize(model, weights={"int8": qint8, "int4": qint4}[scheme], exclude=keep or None)
    if group_size is not None:
        for module in model.modules():
            if isinstance(module, QModuleMixin) and module.weight_qtype is not None:
                module.weight_group_size = group_size  # quanto reads it when the weights are frozen below
    freeze(model)
    return model.eval()
