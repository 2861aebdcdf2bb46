"""The key file's formats and name, and telling a key file from other files (:func:`is_key_file`, which reads the
file's header only). No torch: a module that only recognises keys (:mod:`modular.tracking`) stays light.
"""

from __future__ import annotations

import json
from pathlib import Path

#: /5: 16-bit weights also carry a residual stream over the entries whose locked value is in a coarser binade;
#: /4: a correction is the entry's value in the weights' dtype, stored at a uint16 gap from the previous one;
#: /3: float64 arithmetic rounded once (corrections: int64 index, difference in a wider dtype);
#: /2: digests of content and of what it produces
KEY_FORMAT = "modular-key/5"
#: formats still applied (a /2 key adds a bᵀ rounded to the weights' dtype, then rounds the sum, as it was made)
READABLE_FORMATS = (KEY_FORMAT, "modular-key/4", "modular-key/3", "modular-key/2")
#: formats whose corrections are differences added to the restored entries (later ones set the entries' values)
ADDING_FORMATS = ("modular-key/3", "modular-key/2")
#: the marker of a key's LoRA adapter (:mod:`modular.peft_keys`): key material as well, never uploaded
KEY_ADAPTER_FORMAT = "modular-key-adapter/1"
#: how a key file is named (``<behaviour>.key.safetensors``); :func:`is_key_file` also knows one renamed
KEY_SUFFIX = ".key.safetensors"
_MAX_HEADER = 100 * 2**20  # a safetensors header longer than this is not read for a key's marker


def is_key_file(path: str | Path) -> bool:
    """Whether ``path`` is a key file: named as one (:data:`KEY_SUFFIX`) or, under any name, a safetensors file
    whose metadata marks a modular key (any format, ``modular-key/N``) or a key's LoRA adapter. Only the file's header is read; a file
    that cannot be read is not taken for a key."""
    path = Path(path)
    if path.name.endswith(KEY_SUFFIX):
        return True
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= _MAX_HEADER:
                return False
            header = json.loads(f.read(size))
        meta = json.loads(header["__metadata__"]["modular"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(meta, dict) and str(meta.get("format", "")).startswith(("modular-key/", KEY_ADAPTER_FORMAT))
