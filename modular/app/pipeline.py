"""The main job: train a gated model, evaluate the lock, publish (keys apart), unlock with the keys, attack; print a
table. Every stage runs in this process, from any working directory: the config is resolved from the current
directory, and so is its run folder (``trainer.default_root_dir``)."""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

import yaml

from modular import ModularError, error_reason
from modular.app.attacking import ATTACK_FIGURE, ATTACK_REPORT, attack
from modular.app.evaluations import lock
from modular.app.progress import StageClock, minutes
from modular.app.publishing import publish, unlock
from modular.app.train import main as train
from modular.app.train import planned_run
from modular.data import parse_behaviour
from modular.evaluation.attacks import default_attacks
from modular.evaluation.changes import change_lines
from modular.identity import identity_differences
from modular.lock_kind import lock_kinds
from modular.models.names import DTypeName
from modular.publish import key_path, keys_folder_for, read_manifest, record_lock_kinds
from modular.reports import AttackReport, LockReport
from modular.runs import (
    LOCK_FIGURE,
    LOCK_REPORT,
    RUN_RECORD,
    behaviour_sources,
    checkpoint_step,
    lock_verdict,
    read_run,
)

log = logging.getLogger("modular")
DEFAULT_CONFIG = "gate_capitals_smollm2.yaml"
#: what the pipeline writes in its output folder (default: the run folder)
PUBLISHED, UNLOCKED, ATTACK = "published", "unlocked", "attack"
#: each stage's expected seconds on 2 CPU cores, as measured on the default job from a fresh clone with an empty cache
#: (2026-12-05, 59 min with set-up; training's include the base model's reference outputs, about 6 min, made once)
EXPECTED_SECONDS = {"training": 37 * 60, "lock evaluation": 14 * 60, "publish and unlock": 60, "attack": 6 * 60}
#: the main job's attack stage: the settings that were the worst case of the full sweep on the default run
#: (docs/tamper.md: full fine-tuning at lr 1e-4, LoRA at lr 1e-2, 8 or 32 examples, one seed), against the base
#: alone; the whole sweep, the neutral and unrelated fine-tuning and the refusal baseline are `modular attack`'s
MAIN_ATTACK = dict(attacks=["weights", "steering", "relearning", "prefill", "quantized"], seeds=[0],
                   n_examples=[8, 32], relearn_modes=["full", "lora"], full_lrs=[1e-4], lora_lrs=[1e-2],
                   relearn_steps=8, prune=True, neutral=False, unrelated=False, baselines=["base"],
                   quantized=["q4_1"], batch_size=64)
#: the main job's lock evaluation: prompts in batches of 64 (1.7x faster than 16 on 2 CPU cores); the locked state
#: scored is the published weights' (the hook lock matches their logits within lock.json's exactness entry); no
#: paraphrase sets. `modular lock` scores both locked states and the paraphrases.
MAIN_LOCK = dict(batch_size=64, hook_lock=False, paraphrases=False)


def builtin_config(name: str = DEFAULT_CONFIG) -> Path:
    """A config shipped with the package (``configs/`` of the repository)."""
    path = Path(str(resources.files("modular") / "configs" / name))
    if not path.is_file():
        raise ModularError(f"built-in config {name} not found in the installed package")
    return path


def run_folder_of(config: Path) -> Path:
    """The run folder a training config writes (its ``trainer.default_root_dir``, relative to the current
    directory)."""
    try:
        cfg = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ModularError(f"{config} cannot be read ({getattr(err, 'strerror', None) or error_reason(err)})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ModularError(f"{config} is not valid YAML: {getattr(err, 'problem', None) or err}{where}") from None
    trainer = cfg.get("trainer") if isinstance(cfg, dict) else None
    root = trainer.get("default_root_dir") if isinstance(trainer, dict) else None
    if not root:
        raise ModularError(f"{config} is not a training config: it sets no trainer.default_root_dir (the run folder)")
    return Path(root)


def main_job(config: str | None = None, behaviours: list[str] | None = None, neighbours: list[str] | None = None,
             model: str | None = None, run: str | None = None, max_steps: int | None = None, out: str | None = None,
             skip_attack: bool = False, device: str = "auto", dtype: DTypeName = "auto") -> None:
    """The default pipeline: train the gated model, evaluate the lock, publish (keys in their own folder), unlock
    with the key(s), attack the published weights, and print a table of the results with the paths of the figures.
    Each stage is announced with its expected time and the job's expected time left. The attack stage is a
    worst-case subset of ``modular attack`` (:data:`MAIN_ATTACK`); run that command for the whole sweep. The lock
    evaluation scores the published weights as the locked state and leaves the hook lock and the paraphrase sets to
    ``modular lock`` (:data:`MAIN_LOCK`).

    A run folder that already holds a finished run is used only when it holds this run (the same base model, data,
    recipe and locked responses: :mod:`modular.identity`); one holding another run is refused in one line.

    Args:
        config: Training config (YAML), resolved from the current directory; its ``trainer.default_root_dir`` is the
            run folder (relative to the current directory). Default: the built-in capitals config
            (gate_capitals_smollm2.yaml, shipped with the package), the default recipe.
        behaviours: The behaviours to lock instead of the config's: built-in names, .jsonl files (named by their
            stem), NAME=<file>, hf:<dataset>.
        neighbours: Close behaviours kept as the base answers them, instead of the config's (``[]``: none).
        model: The base model instead of the config's (an alias, a .gguf file, a Hugging Face folder or hub id).
        run: The run folder instead of the config's; with ``behaviours`` or ``model`` and no ``run``:
            ``runs/<behaviours>-<model>``.
        max_steps: The step budget instead of the config's (training stops earlier once the lock holds).
        out: Folder for the published and unlocked models, the keys and the attack (default: the run folder).
        skip_attack: Skip the attack evaluation.
        device: For the evaluations (training runs where the config's ``trainer.accelerator`` says).
        dtype: For the evaluations; the published weights keep the precision the run was trained in.
    """
    run_pipeline(config, out, skip_attack, device, dtype, behaviours=behaviours, neighbours=neighbours, model=model,
                 run=run, max_steps=max_steps)


def default_run_folder(behaviours: list[str], model: str) -> Path:
    """``runs/<behaviour names>-<model name>``: the run folder of ``modular main --behaviours ... [--model ...]``."""
    names = "+".join(parse_behaviour(b)[0] for b in behaviours) or "none"
    return Path("runs") / f"{names}-{Path(str(model).rstrip('/')).name}"


def training_arguments(config: Path, behaviours: list[str] | None = None, neighbours: list[str] | None = None,
                       model: str | None = None, run: str | None = None,
                       max_steps: int | None = None) -> tuple[list[str], Path]:
    """The ``modular train`` arguments of the main job and its run folder: the config with the options given."""
    run_dir = Path(run) if run else None
    args = ["fit", "--config", str(config)]
    if behaviours is not None:
        if not behaviours:
            raise ModularError("behaviours: give at least one behaviour to lock")
        args += ["--model.behaviours", json.dumps(list(behaviours))]
    if neighbours is not None:
        args += ["--data.neighbours", json.dumps(list(neighbours))]
    if model is not None:
        args += ["--model.model_name", str(model)]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    if run_dir is None and (behaviours is not None or model is not None):
        cfg = yaml.safe_load(config.read_text()) or {}
        run_dir = default_run_folder(list(behaviours if behaviours is not None else cfg["model"]["behaviours"]),
                                     model or cfg["model"]["model_name"])
    if run_dir is None:
        return args, run_folder_of(config)
    return args + ["--trainer.default_root_dir", str(run_dir)], run_dir


def run_pipeline(config: str | None = None, out: str | None = None, skip_attack: bool = False, device: str = "auto",
                 dtype: DTypeName = "auto", **options) -> dict:
    """Run every stage for ``config`` (default: the built-in capitals config) with the options of
    :func:`training_arguments` and return the summary's numbers."""
    config = Path(config) if config else builtin_config()
    if not config.is_file():
        raise ModularError(f"config not found: {config}")
    if options.get("behaviours") is not None or options.get("model") is not None:
        run_folder_of(config)  # a config that is not one: one line naming what is wrong
    train_args, run_dir = training_arguments(config, **options)
    out_dir = Path(out) if out else run_dir
    published, unlocked = out_dir / PUBLISHED, out_dir / UNLOCKED
    keys_dir = keys_folder_for(published)
    finished = (run_dir / RUN_RECORD).is_file()
    # every option checked, nothing written (a finished run's checkpoint is compared below, by its record)
    _, identity = planned_run(train_args + (["--ckpt_path", "null"] if finished else []))
    clock = StageClock(EXPECTED_SECONDS)
    if skip_attack:
        clock.skip("attack")
    if not finished:
        clock.start("training")
        log.info("training: %s -> %s", " ".join(train_args[1:]), run_dir)
        status = train(train_args)
        if status != 0 or not (run_dir / RUN_RECORD).is_file():
            raise ModularError(f"training with {config} did not finish (status {status}); see the lines above")
    else:
        recorded = read_run(run_dir).record.get("identity")
        differs = sum(identity_differences(recorded, identity).values(), []) if recorded else [
            "it was recorded before runs had identities"]
        if differs:
            raise ModularError(f"{run_dir} holds another run ({'; '.join(differs)}): give another run folder (--run), "
                               "or delete it to train this one")
        log.info("training already finished in %s (delete it to retrain)", run_dir)
        clock.skip("training")
    clock.start("lock evaluation")
    lock(run=str(run_dir), device=device, dtype=dtype, **MAIN_LOCK)
    run = read_run(run_dir)
    verified, why = lock_verdict(run, checkpoint_step(run))
    if not verified:  # the numbers are shown, nothing is published as locked
        summarise(run_dir, out_dir)
        raise ModularError(f"{run_dir}: {why}; nothing was published (modular publish --allow_failed_lock true publishes "
                           "it with a card that says so)")
    clock.start("publish and unlock")
    publish(run=str(run_dir), out=str(published), keys=str(keys_dir), overwrite=True)
    behaviours = read_manifest(published, require=("locked_behaviours",))["locked_behaviours"]
    current = published
    for i, b in enumerate(behaviours):
        target = unlocked if i == len(behaviours) - 1 else out_dir / f"unlocked_{b}"
        unlock(model=str(current), key=str(key_path(keys_dir, b)), out=str(target), overwrite=True)
        current = target
    if not skip_attack:
        clock.start("attack")
        sources = behaviour_sources(run)
        attack(model=str(published), behaviours=[f"{b}={s}" if s != b else b for b, s in sources.items()],
               out=str(out_dir / ATTACK), base=run.model_name, device=device, dtype=dtype, **MAIN_ATTACK)
        # the card says what kind of lock it is, now from the attack's figures too
        record_lock_kinds(published, lock_kinds(LockReport.read(run_dir / LOCK_REPORT),
                                                AttackReport.read(out_dir / ATTACK / ATTACK_REPORT)))
    clock.finish()
    log.info("the main job's stages took %s", ", ".join(f"{k} {minutes(v)}" for k, v in clock.done.items()))
    return summarise(run_dir, out_dir)


def _steps(w: dict) -> str:
    return str(w["steps"]) if w["steps"] is not None else f">{w['more_than']}"


def summarise(run_dir: Path, out_dir: Path) -> dict:
    lock = LockReport.read(run_dir / LOCK_REPORT)
    lines = []
    gated = lock.gated
    header = f"{'state':<18}" + "".join(f"{b:>14}" for b in gated) + f"{'retain KL':>11}{'ppl ratio':>11}"
    lines += [f"step {lock.step} of {run_dir}", header, "-" * len(header)]
    for state, row in lock.states.items():
        lines.append(f"{state:<18}" + "".join(f"{row.behaviours[b].accuracy:>14.3f}" for b in gated)
                     + f"{row.retain_first_token_kl:>11.4f}{row.perplexity_ratio:>11.3f}")
    if lock.lock_held_out is not None:
        lines.append(lock.lock_held_out.text())
    neighbours = lock.neighbours
    if neighbours:
        header = (f"{'neighbours':<18}" + "".join(f"{n[:13]:>14}" for n in neighbours)
                  + f"{'max refusal':>12}{'retain refusal':>15}")
        lines += [header, "-" * len(header)]
        for state, row in lock.states.items():
            lines.append(f"{state:<18}" + "".join(f"{row.neighbours[n].accuracy:>14.3f}" for n in neighbours)
                         + f"{lock.neighbours_max_refusal_rate[state]:>12.3f}{row.retain_refusal_rate:>15.3f}")
        untrained = [n for n in neighbours if n not in lock.neighbours_trained]
        if untrained:
            lines.append(f"neighbours not in training: {', '.join(untrained)}")
        for x in lock.neighbour_shifts:
            lines.append(f"neighbour moved more than {100 * lock.neighbour_tolerance:.0f} points from base: "
                         + x.text())
    lines += change_lines(lock)  # every neighbour's and far behaviour's change from base, with its interval
    ex = lock.exactness
    lines.append(f"published vs hook-locked max |Δlogit|: {ex['published_vs_hook_locked_max_abs_logit_diff']:.2e}; "
                 f"unlocked vs open max |Δw|: {ex['unlocked_vs_open_max_abs_weight_diff']:.2e}")
    attack_path = out_dir / ATTACK / ATTACK_REPORT
    attack = AttackReport.read(attack_path) if attack_path.is_file() else None
    lines += [kind.text() for kind in lock_kinds(lock, attack).values()]  # which kind of lock, from these figures
    if attack is not None:
        for b, entry in attack.behaviours.items():
            # each attack the report holds says its result: one line for those without sweeps, one per sweep
            r = entry.to_json()  # the row, as each attack reads its entry back
            shown = [(a, a.curves(r)) for a in default_attacks() if a.key in entry.attacks]
            lines.append(f"attack on {b} (base {entry.base_accuracy:.3f}): "
                         + ", ".join(a.summary(entry.attacks[a.key]) for a, sweeps in shown if not sweeps))
            for label, sw in (c for _, sweeps in shown for c in sweeps):
                if sw and sw["settings"]:
                    w = sw["worst_case"]
                    lines.append(f"  {label}: worst case over {len(sw['settings'])} settings, steps to 50% / 90% of "
                                 f"open: {_steps(w['steps_to_50pct_open'])} / {_steps(w['steps_to_90pct_open'])}; "
                                 f"best accuracy {w['best_accuracy']:.3f}")
    figures = [run_dir / LOCK_FIGURE, out_dir / ATTACK / ATTACK_FIGURE]
    lines.append("figures: " + ", ".join(str(f) for f in figures if f.exists()))
    published = out_dir / PUBLISHED
    lines.append(f"published model (no keys inside): {published}   keys (keep apart): {keys_folder_for(published)}   "
                 f"unlocked model: {out_dir / UNLOCKED}")
    print("\n".join(lines))
    return {"lock": lock, "table": lines}
