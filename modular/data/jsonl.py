"""User behaviour data: JSONL with ``prompt`` and ``target`` (optional ``split``, ``answer``, ``chat``).

Every line must be a JSON object; a malformed line raises :class:`ModularError`
naming the file and the line number. Nothing is silently dropped (blank lines
are not records and are skipped). Lines without ``split`` are assigned to
train/validation/test deterministically (70/10/20) by a hash of the prompt.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from modular import ModularError
from modular.data.schema import SPLITS, record

_ALLOWED = {"prompt", "target", "split", "answer", "chat"}


def _auto_split(prompt: str) -> str:
    x = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 16**8
    return "train" if x < 0.7 else "validation" if x < 0.8 else "test"


def parse_jsonl(path: str | Path) -> dict[str, list[dict]]:
    """Validate and parse a behaviour JSONL file into records per split."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"behaviour file not found: {path}")
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ModularError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise ModularError(f"{where}: expected a JSON object with 'prompt' and 'target'")
            unknown = set(obj) - _ALLOWED
            if unknown:
                raise ModularError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_ALLOWED)}")
            for key in ("prompt", "target"):
                if not isinstance(obj.get(key), str) or not obj[key].strip():
                    raise ModularError(f"{where}: '{key}' must be a non-empty string")
            answer = obj.get("answer")
            if answer is not None and (not isinstance(answer, str) or not answer.strip()):
                raise ModularError(f"{where}: 'answer' must be a non-empty string when given")
            chat = obj.get("chat", True)
            if not isinstance(chat, bool):
                raise ModularError(f"{where}: 'chat' must be true or false")
            split = obj.get("split") or _auto_split(obj["prompt"])
            if split not in SPLITS:
                raise ModularError(f"{where}: 'split' must be one of {list(SPLITS)}, got {split!r}")
            splits[split].append(record(obj["prompt"], obj["target"], [answer] if answer else [], chat=chat))
    if not any(splits.values()):
        raise ModularError(f"{path}: no records")
    return splits


def load_jsonl(path: str | Path):
    """Load a behaviour JSONL file as a ``datasets.DatasetDict`` (empty splits are kept, with the schema)."""
    from modular.data.behaviours import to_dataset_dict

    return to_dataset_dict(parse_jsonl(path))
