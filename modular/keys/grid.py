"""The grids of the weights' float dtypes: units in the last place, steps between two values, binades, and the
residual streams of 16-bit keys (grid steps per entry, LZMA-compressed) that :mod:`modular.keys.exact` records and
applies.
"""

from __future__ import annotations

import lzma

import numpy as np
import torch

from modular import ModularError

MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
#: 16-bit float dtypes: restores are corrected by a residual stream (steps of the dtype's grid)
GRID_DTYPES = (torch.bfloat16, torch.float16)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each value of ``x`` (float64; at 0: the smallest normal number)."""
    x = x.double()
    _, exponent = torch.frexp(x)  # x = m·2^e, 0.5 <= |m| < 1
    spacing = torch.ldexp(torch.ones_like(x), (exponent - 1 - MANTISSA_BITS[dtype]).to(x.dtype))
    return torch.where(x == 0, torch.full_like(x, torch.finfo(dtype).tiny), spacing)


def grid_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many steps of ``b``'s dtype's grid separate ``a`` (rounded to that dtype) from ``b``, per entry
    (int64; equal values, ``-0.0`` and ``0.0`` included, are 0 apart): units in the last place that are counted on
    the grid, so that they stay finite and comparable across binades and at zero, where a spacing-based count
    divides by the smallest normal number. For 16- and 32-bit floats; other dtypes are measured in float32's grid."""
    if b.element_size() not in (2, 4):
        a, b = a.float(), b.float()
    a = a.to(b.dtype)
    view, width = {2: (torch.int16, 16), 4: (torch.int32, 32)}[b.element_size()]
    sign = 1 << (width - 1)

    def order(t):  # signed magnitude: -0 and +0 both at 0
        bits = t.contiguous().view(view).to(torch.int64) & ((1 << width) - 1)
        return torch.where(bits < sign, bits, sign - bits)

    return (order(a) - order(b)).abs()


def _grid_order(x: torch.Tensor) -> torch.Tensor:
    """The position of each 16-bit float on its dtype's grid, as int32: consecutive representable values get
    consecutive integers (−0 just below +0), so a difference counts grid steps, across binades too."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits < 0x8000, bits, 0x7FFF - bits)


def _from_grid_order(order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit floats at grid positions ``order`` (positions wrap modulo 2^16, as residuals are stored)."""
    order = torch.remainder(order + 0x8000, 0x10000) - 0x8000
    bits = torch.where(order >= 0, order, 0x7FFF - order)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def _binade(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For 16-bit floats: the exponent field that sets each value's grid spacing (subnormals and zero share the
    smallest normal binade's), and whether the value is the bottom of a binade above that one (its next value toward
    zero lies in a finer binade). Read from the bits: exact and cheap."""
    mantissa_bits = MANTISSA_BITS[x.dtype]
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF
    exponent = bits >> mantissa_bits
    bottom = ((bits & ((1 << mantissa_bits) - 1)) == 0) & (exponent >= 2)
    return exponent.clamp(min=1), bottom


def _coarser(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The entries whose value before a key lies in a coarser binade than the value after it (or than the next
    value toward zero, for a restored value at the bottom of its binade): the locked weight's rounding lost bits
    there, and the key's residual stream says how many grid steps the restored value is off. Both sides of the key
    compute this from the locked weights and the component alone."""
    exponent_before, _ = _binade(before)
    exponent_after, bottom = _binade(after)
    return exponent_before > exponent_after - bottom.to(torch.int32)


def _encode_residual(steps: torch.Tensor) -> torch.Tensor:
    """Grid steps (int) as stored: modulo 2^16 as little-endian int16, LZMA-compressed, in a uint8 tensor."""
    wrapped = torch.remainder(steps.to(torch.int64), 0x10000)
    wrapped = torch.where(wrapped >= 0x8000, wrapped - 0x10000, wrapped)  # the same steps modulo 2^16, as int16
    raw = wrapped.cpu().numpy().astype("<i2").tobytes()
    return torch.frombuffer(bytearray(lzma.compress(raw)), dtype=torch.uint8)


def _decode_residual(stream: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` grid steps of :func:`_encode_residual` (int32); a stream of another length is refused."""
    try:
        raw = lzma.decompress(stream.cpu().numpy().tobytes())
    except lzma.LZMAError as err:
        raise ModularError(f"a key's residual stream is unreadable ({err})") from None
    if len(raw) != 2 * n:
        raise ModularError(f"a key's residual stream holds {len(raw) // 2} entries where these weights need {n}: "
                           "it was made for other weights")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype("int32"))


def _step_entries(param: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor) -> None:
    """Move the entries of ``param`` under ``mask`` by ``steps`` grid steps each (in place)."""
    param[mask] = _from_grid_order(_grid_order(param[mask]) + steps, param.dtype)
