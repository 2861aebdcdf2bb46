"""The key file: a safetensors file of a key's tensors, its metadata and a digest of its content; writing it
(:func:`save_key`), reading and checking it (:func:`load_key`). Its formats, and telling a key file from other
files: :mod:`modular.keys.formats`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modular import ModularError, error_reason
from modular.keys.formats import ADDING_FORMATS, KEY_FORMAT, READABLE_FORMATS
from modular.keys.key import Component, Key

MAX_GAP = 2**16 - 1  # the largest gap between two corrected entries a uint16 holds; 0 marks a skip of MAX_GAP


def _pack_fix(index: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrections as stored: the gap from each corrected entry to the previous one (the first counted from -1) as
    a uint16, where a 0 stands for a skip of :data:`MAX_GAP` entries with no correction (a longer gap is bridged
    by skips), and the values in the narrowest float dtype that holds every one exactly (the weights' own)."""
    index, value = index.long().flatten(), value.flatten()
    order = torch.argsort(index)
    index, value = index[order], value[order]
    gaps = torch.diff(index, prepend=index.new_tensor([-1]))
    skips = (gaps - 1) // MAX_GAP  # skips before each correction
    slots = torch.cumsum(skips + 1, 0) - 1  # where each correction lands among the stored entries
    n = int(slots[-1]) + 1 if len(slots) else 0
    packed_gaps = torch.zeros(n, dtype=torch.int64)
    packed_gaps[slots] = gaps - skips * MAX_GAP
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        narrow = value.to(dtype)
        if dtype.itemsize <= value.dtype.itemsize and torch.equal(narrow.double(), value.double()):
            break
    packed_values = torch.zeros(n, dtype=narrow.dtype)
    packed_values[slots] = narrow
    return packed_gaps.to(torch.uint16), packed_values


def _unpack_fix(gaps: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices and values of :func:`_pack_fix`'s corrections (skips dropped)."""
    gaps = gaps.to(torch.int64)
    index = torch.cumsum(torch.where(gaps == 0, MAX_GAP, gaps), 0) - 1
    keep = gaps != 0
    return index[keep], values[keep]


def _content_digest(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """SHA-256 over a key's tensors (names, dtypes, shapes, bytes) and its metadata (without the digest)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    body = {k: v for k, v in meta.items() if k != "content_sha256"}
    h.update(json.dumps(body, sort_keys=True).encode())
    return h.hexdigest()


def save_key(key: Key, path: str | Path, locked_hash: str,
             produces: dict[tuple[str, ...], str] | None = None) -> Path:
    """Write a key as safetensors; what it restores, where, the locked weights' hash, the hash of the weights it
    produces (``produces``: keys applied before, in order -> weights hash; see :func:`produced_hashes`) and a digest
    of the file's own content go in the metadata."""
    tensors = {"direction": key.direction.contiguous()}
    entries = []
    for i, c in enumerate(key.components):
        tensors[f"c{i}.a"] = c.a.contiguous()
        tensors[f"c{i}.b"] = c.b.contiguous()
        if c.fix_index is not None and c.fix_index.numel():
            tensors[f"c{i}.fix_gap"], tensors[f"c{i}.fix_value"] = _pack_fix(c.fix_index, c.fix_value)
        if c.residual is not None:
            tensors[f"c{i}.residual"] = c.residual.contiguous()
        after = []
        for j, (prefix, (index, value)) in enumerate(c.fix_after.items()):
            after.append(list(prefix))
            tensors[f"c{i}.after{j}.fix_gap"], tensors[f"c{i}.after{j}.fix_value"] = _pack_fix(index, value)
            if prefix in c.residual_after:
                tensors[f"c{i}.after{j}.residual"] = c.residual_after[prefix].contiguous()
        entry = {"param": c.param, "transposed": c.transposed}
        if after:  # the prefixes of the corrections c{i}.after{j}.* (behaviours applied before, in order)
            entry["fix_after"] = after
        entries.append(entry)
    meta = {**key.meta, "format": KEY_FORMAT, "locked_hash": locked_hash, "components": entries,
            "produces": [{"after": list(prefix), "weights_hash": h} for prefix, h in (produces or {}).items()]}
    meta["content_sha256"] = _content_digest(tensors, meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"modular": json.dumps(meta)})
    return path




def load_key(path: str | Path) -> tuple[Key, dict]:
    """Read a key file and check its content digest; returns the key and its metadata (with ``locked_hash`` and
    ``produces``). A file that is not a key, truncated or changed raises :class:`ModularError`."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"key file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("modular", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type for truncated or foreign files
        raise ModularError(f"{path} is not a readable modular key file ({error_reason(err)})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else None
        hint = "; it has no digests: publish again" if found == "modular-key/1" else ""
        raise ModularError(f"{path} is not a modular key file (format {found!r}, expected {KEY_FORMAT!r}{hint})")
    if meta.get("content_sha256") != _content_digest(tensors, meta):
        raise ModularError(f"{path} is corrupted: its content does not match its digest; get a fresh copy of the key")

    def fix(prefix: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if f"{prefix}.fix_gap" in tensors:  # /4
            return _unpack_fix(tensors[f"{prefix}.fix_gap"], tensors[f"{prefix}.fix_value"])
        return tensors.get(f"{prefix}.fix_index"), tensors.get(f"{prefix}.fix_value")  # /3, /2: flat int64 indices

    def residual_after(i: int, e: dict) -> dict:
        return {tuple(prefix): tensors[f"c{i}.after{j}.residual"] for j, prefix in enumerate(e.get("fix_after", []))
                if f"c{i}.after{j}.residual" in tensors}

    try:
        comps = [
            Component(e["param"], tensors[f"c{i}.a"], tensors[f"c{i}.b"], e["transposed"], *fix(f"c{i}"),
                      {tuple(prefix): fix(f"c{i}.after{j}") for j, prefix in enumerate(e.get("fix_after", []))},
                      meta["format"] == "modular-key/2", meta["format"] in ADDING_FORMATS,
                      tensors.get(f"c{i}.residual"), residual_after(i, e))
            for i, e in enumerate(meta["components"])
        ]
    except KeyError as err:
        raise ModularError(f"{path} is not a complete modular key file (no tensor or field {err})") from None
    return Key(meta["behaviour"], tensors["direction"], comps, meta), meta
