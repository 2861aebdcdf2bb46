"""The names of precisions and of quantisation schemes, apart from :mod:`modular.models.precision` and
:mod:`modular.models.quantize` (which map them to torch's and re-export them): a signature typed with them loads no
torch."""

from __future__ import annotations

from typing import Literal

#: a precision by name (``auto``: see :mod:`modular.models.precision`)
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
#: a weight-only quantisation by name (see :mod:`modular.models.quantize`)
Scheme = Literal["none", "int8", "int4", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
