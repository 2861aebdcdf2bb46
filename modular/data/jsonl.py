"""User behaviour data: JSONL with ``prompt`` and ``target`` (optional ``split``, ``answer``, ``chat``).

``split``: train, validation or test; or ``attack_fit`` / ``attack_score`` (both or neither), the items an attacker
fine-tunes on and those every attack is scored on instead (Deeb & Roger's protocol: facts of other entities; see
:data:`~modular.data.schema.ATTACK_SPLITS`). An attack split's rows are the attack's alone (never trained on), and
may repeat prompts of the other splits.

``answer``: a short string, or a list of them, any of which makes a greedy response correct (otherwise a response
is correct when it begins with the target).

Every line must be a JSON object; a malformed line raises :class:`ModularError`
naming the file and the line number. Nothing is silently dropped (blank lines
are not records and are skipped). Lines without ``split`` are assigned to
train/validation/test deterministically (70/10/20) by a hash of the prompt; when
those thresholds would leave a split empty (a small file), the unsplit lines are
assigned by the rank of their hash instead, so every split gets at least one.
Each prompt is kept once (:func:`~modular.data.schema.distinct_items`): a prompt with two targets is refused, a
repeated line kept once and a prompt given in two splits kept in the earlier one only, with a warning naming how many.
"""

from __future__ import annotations

import json
from pathlib import Path

from modular import ModularError
from modular.data.schema import ATTACK_SPLITS, SPLITS, distinct_items, prompt_hash, record, to_dataset_dict

_ALLOWED = {"prompt", "target", "split", "answer", "chat"}


def _auto_split(prompt: str) -> str:
    x = prompt_hash(prompt)
    return "train" if x < 0.7 else "validation" if x < 0.8 else "test"


def _split_by_rank(prompts: list[str]) -> list[str]:
    """Splits of ``n >= 3`` unsplit lines by the rank of their prompt's hash: 70/10/20, at least one line each."""
    n = len(prompts)
    n_val, n_test = max(1, round(0.1 * n)), max(1, round(0.2 * n))
    n_train = n - n_val - n_test
    order = sorted(range(n), key=lambda i: (prompt_hash(prompts[i]), i))
    splits = [""] * n
    for rank, i in enumerate(order):
        splits[i] = "train" if rank < n_train else "validation" if rank < n_train + n_val else "test"
    return splits


def parse_jsonl(path: str | Path) -> dict[str, list[dict]]:
    """Validate and parse a behaviour JSONL file into records per split."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"behaviour file not found: {path}")
    rows: list[tuple[str | None, dict]] = []  # (split given in the line or None, record), in file order
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}, line {lineno}"
            try:  # the first line may open with a byte-order mark, as editors on Windows write them
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ModularError(f"{where}: not UTF-8 text (byte {err.start + 1} of the line)") from None
            if not line.strip():
                continue
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
            answers = [answer] if isinstance(answer, str) else answer
            if answer is not None and (not isinstance(answers, list) or not answers
                                       or not all(isinstance(a, str) and a.strip() for a in answers)):
                raise ModularError(f"{where}: 'answer' must be a non-empty string or a list of them when given")
            chat = obj.get("chat", True)
            if not isinstance(chat, bool):
                raise ModularError(f"{where}: 'chat' must be true or false")
            split = obj.get("split") or None
            if split is not None and split not in SPLITS + ATTACK_SPLITS:
                raise ModularError(f"{where}: 'split' must be one of {list(SPLITS + ATTACK_SPLITS)}, got {split!r}")
            rows.append((split, record(obj["prompt"], obj["target"], answers or [], chat=chat)))
    if not rows:
        raise ModularError(f"{path}: no records")
    given = [s for s in ATTACK_SPLITS if any(split == s for split, _ in rows)]
    if given and len(given) < len(ATTACK_SPLITS):
        (missing,) = set(ATTACK_SPLITS) - set(given)
        raise ModularError(f"{path}: rows marked '{given[0]}' but none marked '{missing}': the attack splits go "
                           f"together, give both or neither")
    unsplit = [r["prompt"] for s, r in rows if s is None]
    auto = iter([_auto_split(p) for p in unsplit])
    assigned = [s or next(auto) for s, _ in rows]
    if len(unsplit) >= 3 and not set(SPLITS) <= set(assigned):  # the thresholds left a split empty
        auto = iter(_split_by_rank(unsplit))
        assigned = [s or next(auto) for s, _ in rows]
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS + tuple(given)}
    for split, (_, rec) in zip(assigned, rows):
        splits[split].append(rec)
    return distinct_items(splits, str(path))


def load_jsonl(path: str | Path):
    """Load a behaviour JSONL file as a ``datasets.DatasetDict`` (empty splits are kept, with the schema)."""
    return to_dataset_dict(parse_jsonl(path))
