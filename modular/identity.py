"""What defines a training run, recorded in its checkpoints and its ``run.json`` (``identity``), and checked
whenever the run is resumed, evaluated or published.

A run's identity::

    model        the base model's reference and its content key (:func:`modular.models.loading.model_fingerprint`:
                 a hash of its weight, config and tokenizer files, or a hub id and revision)
    data         every behaviour, task and kept neighbour by short name: its source (a built-in name, ``hf:<id>``,
                 or a .jsonl file's absolute path) and, for a file, the SHA-256 of its bytes; and the data seed
    recipe       what changes the loss: the objective terms with every option, the locked state's weight, the
                 fine-tuning (full or LoRA with its rank and alpha) and the head gates' options
    locked_responses  the locked-state response of each behaviour

A behaviour file is found again by its hash (:func:`find_source`): a relative path in a config names another file
from another folder, and another file of the same name is never taken for it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from pathlib import Path

from modular import ModularError
from modular.data.behaviours import is_jsonl

log = logging.getLogger("modular")

#: the model options that change what training optimises (besides the objective terms)
RECIPE_OPTIONS = ("locked_weight", "finetuning", "head_gates", "gate_scope", "sparsity", "sparsity_weight",
                  "lm_loss_target")
#: those that change which parameters a checkpoint holds: no run continues from a checkpoint with others
STRUCTURE_OPTIONS = ("finetuning", "head_gates", "lora_rank", "lora_alpha")
#: the LoRA options (part of the recipe for ``finetuning: lora`` only)
LORA_OPTIONS = ("lora_rank", "lora_alpha")


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_identity(source: str) -> dict:
    """``{"source", "sha256"}`` of a behaviour's data source (:func:`modular.data.parse_behaviour`'s second part):
    a .jsonl file by its absolute path and hash; a built-in name or ``hf:<id>`` as it is (no hash)."""
    if not is_jsonl(source):
        return {"source": source, "sha256": None}
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise ModularError(f"behaviour file not found: {source}")
    return {"source": str(path), "sha256": file_sha256(path)}


def _plain(value):
    """``value`` as JSON reads it back (tuples as lists; anything JSON cannot hold by its repr)."""
    return json.loads(json.dumps(value, default=repr))


def term_identity(term) -> dict:
    """An objective term by its class and the value of each of its options."""
    cls = type(term)
    options = {name: getattr(term, name) for name in inspect.signature(cls.__init__).parameters
               if name != "self" and hasattr(term, name)}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": _plain(options)}


def run_identity(model: dict, data: dict, model_fingerprint: str, terms: list, sources: dict[str, str],
                 locked_responses: dict[str, str]) -> dict:
    """The identity of a run from its model and data options (a parsed config's ``model`` and ``data``, or the
    hyperparameters they became), the base model's content key, its objective ``terms`` (built), ``sources``: every
    behaviour, task and kept neighbour's data source by short name, and each behaviour's locked response."""
    recipe = {k: model.get(k) for k in RECIPE_OPTIONS}
    if model.get("finetuning") == "lora":
        recipe.update({k: model.get(k) for k in LORA_OPTIONS})
    recipe["objectives"] = [term_identity(t) for t in terms]
    return _plain({
        "model": {"name": str(model.get("model_name")), "fingerprint": model_fingerprint},
        "data": {"sources": {name: source_identity(src) for name, src in sources.items()}, "seed": data.get("seed")},
        "recipe": recipe,
        "locked_responses": dict(locked_responses),
    })


def _changed(what: str, old, new) -> str:
    return f"{what}: {json.dumps(old)} → {json.dumps(new)}"


def identity_differences(recorded: dict, current: dict) -> dict[str, list[str]]:
    """What differs between two identities, one line per difference, under ``model``, ``structure`` (the options
    that change which parameters are trained: :data:`STRUCTURE_OPTIONS`), ``recipe`` (the loss's other options and
    terms), ``locked_responses`` and ``data`` (empty lists where they agree)."""
    out: dict[str, list[str]] = {"model": [], "structure": [], "recipe": [], "locked_responses": [], "data": []}
    old_model, new_model = recorded.get("model", {}), current.get("model", {})
    if old_model.get("fingerprint") != new_model.get("fingerprint"):
        out["model"].append(f"base model: {old_model.get('name')} ({old_model.get('fingerprint')}) → "
                            f"{new_model.get('name')} ({new_model.get('fingerprint')})")
    old_recipe, new_recipe = recorded.get("recipe", {}), current.get("recipe", {})
    for key in sorted(set(old_recipe) | set(new_recipe)):
        if key != "objectives" and old_recipe.get(key) != new_recipe.get(key):
            part = "structure" if key in STRUCTURE_OPTIONS else "recipe"
            out[part].append(_changed(f"model.{key}", old_recipe.get(key), new_recipe.get(key)))
    if old_recipe.get("objectives") != new_recipe.get("objectives"):
        old_terms = [t["class_path"].rsplit(".", 1)[-1] for t in old_recipe.get("objectives") or []]
        new_terms = [t["class_path"].rsplit(".", 1)[-1] for t in new_recipe.get("objectives") or []]
        what = _changed("model.objectives", old_terms, new_terms) if old_terms != new_terms else \
            "model.objectives: the terms' options"
        out["recipe"].append(what)
    old_resp, new_resp = recorded.get("locked_responses", {}), current.get("locked_responses", {})
    for name in sorted(set(old_resp) | set(new_resp)):
        if old_resp.get(name) != new_resp.get(name):
            out["locked_responses"].append(_changed(f"locked response of {name}", old_resp.get(name),
                                                    new_resp.get(name)))
    old_data, new_data = recorded.get("data", {}), current.get("data", {})
    old_src, new_src = old_data.get("sources", {}), new_data.get("sources", {})
    for name in sorted(set(old_src) | set(new_src)):
        a, b = old_src.get(name), new_src.get(name)
        if a is None or b is None:
            out["data"].append(f"behaviour {name}: {'added' if a is None else 'removed'}")
        elif a.get("sha256") != b.get("sha256") or (a.get("sha256") is None and a.get("source") != b.get("source")):
            out["data"].append(f"behaviour {name}: {a.get('source')} ({_short(a)}) → {b.get('source')} ({_short(b)})")
    if old_data.get("seed") != new_data.get("seed"):
        out["data"].append(_changed("data seed", old_data.get("seed"), new_data.get("seed")))
    return out


def _short(entry: dict) -> str:
    digest = entry.get("sha256")
    return f"sha256 {digest[:12]}" if digest else "built in" if ":" not in entry.get("source", "") else "hub"


def find_source(name: str, entry: dict, near: list[Path] = ()) -> str:
    """Where behaviour ``name``'s data is now: a built-in or hub source as recorded; a file at its recorded path
    if its bytes still hash to the recorded SHA-256, else a file of the same name in one of the ``near`` folders
    (e.g. the run folder and its parent: a run moved with its data) with that hash. A file that changed or moved
    out of reach is one line, never replaced by another file of the same name."""
    source, digest = entry.get("source"), entry.get("sha256")
    if not digest:
        return source
    recorded = Path(source)
    candidates = [recorded] + [Path(folder) / recorded.name for folder in near]
    changed = None
    for path in candidates:
        if path.is_file():
            if file_sha256(path) == digest:
                if path != recorded:
                    log.info("behaviour %s: %s moved; found by its hash at %s", name, recorded, path)
                return str(path)
            changed = changed or path
    if changed is not None:
        raise ModularError(f"behaviour {name}: {changed} is not the file the run was trained on (its SHA-256 is not "
                           f"{digest[:12]}…): restore that file at {recorded}")
    raise ModularError(f"behaviour {name}: the file the run was trained on is gone ({recorded}, SHA-256 "
                       f"{digest[:12]}…): restore it there or beside the run folder")


def check_resumed(recorded: dict | None, current: dict, where: str, other_data: bool = False,
                  same_run: bool = True) -> None:
    """Refuse in one line to continue from the checkpoint ``where`` (identity ``recorded``) as a run of another
    identity, before anything is written.

    Never from another base model, or with other trained parameters (full fine-tuning, LoRA and its rank, head
    gates: :data:`STRUCTURE_OPTIONS`). Resuming the run folder's own checkpoint (``same_run``), neither with another
    recipe (objective terms, their options, the locked state's weight) or locked response, nor on other data (another
    behaviour file, or the same file changed) unless ``other_data`` (then with a warning): the run's record would
    describe a run that never happened. A new run started from another run's checkpoint (``same_run`` False, its own
    folder and identity) may change the recipe, the locked responses and the data: one warning line names what.
    A checkpoint without an identity (written by an older version) is not checked."""
    if not recorded:
        return
    diff = identity_differences(recorded, current)
    fixed = diff["model"] + diff["structure"] + (diff["recipe"] + diff["locked_responses"] if same_run else [])
    if fixed:
        remedy = ("train it in another run folder, or start this one afresh with --ckpt_path null" if same_run else
                  "start from a checkpoint of this base model and these trained parameters, or afresh")
        raise ModularError(f"{where} was trained with another {_what(diff, same_run)} ({'; '.join(fixed)}): {remedy}")
    if diff["data"] and same_run and not other_data:
        raise ModularError(f"{where} was trained on other data ({'; '.join(diff['data'])}): restore the data, train in "
                           "another run folder, or pass --continue_on_other_data true to continue on this data")
    changed = diff["recipe"] + diff["locked_responses"] + diff["data"]
    if changed:
        log.warning("continuing from %s with other %s: %s", where,
                    "data" if not diff["recipe"] + diff["locked_responses"] else "options", "; ".join(changed))


def _what(diff: dict, same_run: bool) -> str:
    parts = [("base model", diff["model"]), ("set of trained parameters", diff["structure"])]
    if same_run:
        parts += [("recipe", diff["recipe"]), ("locked response", diff["locked_responses"])]
    return ", ".join(name for name, lines in parts if lines)
