"""Outputs a user can open: JSON written atomically beside PNG figures, and the same numbers in W&B.

W&B's mode is the ``WANDB_MODE`` environment variable (``online``, ``offline``, ``disabled``; :func:`wandb_mode`),
offline when it is unset (files under the output folder); set ``WANDB_MODE=online`` (and log in) to sync. An
evaluation of a training run joins that run's W&B group and names its run id (``training_run_id``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from modular import ModularError, files
from modular.files import atomic_path, json_safe
from modular.keys import is_key_file


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (temp file + rename): readers never see a half-written file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (temp file + rename; :func:`modular.files.write_json`)."""
    return files.write_json(path, data)


def read_json_if_valid(path: str | Path) -> Any | None:
    """The JSON in ``path``, or None where there is none to read: no such file, or one that does not parse (cut short
    by another writer, not text). For files a command takes over if it can (a partial report) and else replaces."""
    path = Path(path)
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif isinstance(v, (int, float, bool, str)) or v is None:
            out[key] = v
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def wandb_name(name: str) -> str:
    """``name`` as a W&B table's or figure's name may be (it becomes an artifact's and a file's name): letters,
    digits and ``_.-``, no path, at most 100 characters; ``../x.jsonl`` is ``x.jsonl``."""
    return _UNSAFE.sub("_", str(name)).strip("._-")[:100] or "unnamed"


def _wandb_names(names) -> dict[str, str]:
    """{name: its :func:`wandb_name`}, two names made one told apart by a number."""
    out: dict[str, str] = {}
    for name in names:
        safe, k = wandb_name(name), 1
        while (safe if k == 1 else f"{safe}-{k}") in out.values():
            k += 1
        out[name] = safe if k == 1 else f"{safe}-{k}"
    return out


def wandb_mode() -> str:
    """The W&B mode every run takes: ``WANDB_MODE`` as the environment sets it (``online``, ``offline``,
    ``disabled``), ``offline`` when it is unset or empty."""
    return os.environ.get("WANDB_MODE") or "offline"


def _init_wandb(job: str, out_dir: str | Path, config: dict | None, training: dict | None):
    """A W&B run of ``job`` (files under ``out_dir``), in :func:`wandb_mode`. With ``training`` (the training run's
    W&B record, :func:`modular.runs.training_wandb_run`): in its group (its id where it has none) and project (unless
    ``WANDB_PROJECT`` names one), its id in the config as ``training_run_id``."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    config = json_safe(config or {})
    group = None
    if training and training.get("id"):
        config["training_run_id"] = training["id"]
        group = training.get("group") or training["id"]
    project = os.environ.get("WANDB_PROJECT") or (training or {}).get("project") or "modular"
    return wandb.init(project=project, job_type=job, dir=str(out_dir), mode=wandb_mode(), group=group,
                      config=config, reinit="finish_previous")


def log_to_wandb(out_dir: str | Path, job: str, summary: dict, config: dict | None = None,
                 figures: dict[str, str | Path] | None = None, tables: dict[str, list[dict]] | None = None,
                 training: dict | None = None) -> str | None:
    """Log one evaluation run (scalars, figures, tables) to W&B; returns the run folder or None if disabled. Figures
    and tables are named by :func:`wandb_name` of their names (a behaviour's spec may be a path). ``training``: the
    W&B run of the training run evaluated (:func:`modular.runs.training_wandb_run`), whose group this run joins."""
    if wandb_mode() == "disabled":
        return None
    import wandb

    run = _init_wandb(job, out_dir, config, training)
    try:
        flat = _flatten(json_safe(summary))
        run.log({k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for key, value in flat.items():
            run.summary[key] = value
        figure_names, table_names = _wandb_names(figures or {}), _wandb_names(tables or {})
        for name, path in (figures or {}).items():
            run.log({f"figures/{figure_names[name]}": wandb.Image(str(path))})
        for name, rows in (tables or {}).items():
            if rows:
                cols = list(rows[0])
                data = [[json_safe(r.get(c)) for c in cols] for r in rows]
                run.log({f"tables/{table_names[name]}": wandb.Table(columns=cols, data=data)})
        return run.dir
    finally:
        run.finish()


def log_folder_artifact(folder: str | Path, out_dir: str | Path, job: str, kind: str = "model",
                        config: dict | None = None, training: dict | None = None) -> list[str] | None:
    """Log the files of ``folder`` (a published folder) as one W&B artifact named by the folder
    (:func:`wandb_name`), in a run of ``job`` whose files go under ``out_dir`` (never ``folder`` itself: it is what
    a user uploads) and which joins ``training``'s group as :func:`log_to_wandb`'s does. A key file is never added,
    under any name (:func:`modular.keys.is_key_file`). Returns the files added (paths inside ``folder``), or None if
    W&B is disabled."""
    if wandb_mode() == "disabled":
        return None
    import wandb

    folder = Path(folder)
    if Path(out_dir).resolve() == folder.resolve() or folder.resolve() in Path(out_dir).resolve().parents:
        raise ModularError(f"W&B's files for the artifact of {folder} may not go inside it (it is what a user "
                           f"uploads): {out_dir}")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not is_key_file(p))
    run = _init_wandb(job, out_dir, config, training)
    try:
        artifact = wandb.Artifact(wandb_name(folder.name), type=kind)
        added = []
        for path in files:
            name = path.relative_to(folder).as_posix()
            artifact.add_file(str(path), name=name)
            added.append(name)
        run.log_artifact(artifact)
        return added
    finally:
        run.finish()
