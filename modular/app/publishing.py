"""``modular publish``, ``modular unlock`` and ``modular export-key``: the locked weights as a plain Hugging Face
folder, the keys apart, and a key as a PEFT adapter."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import torch

# publish calls modular.runs' read_run, checkpoint_step and load_open_model and modular.publish's publish_model
# through their modules (modular.runs.read_run): tests replace them there
import modular.publish
import modular.runs
from modular import ModularError
from modular.data import load_behaviour, retain_data
from modular.data.behaviours import BEHAVIOURS
from modular.evaluation.key_adapters import adapter_agreement
from modular.files import atomic_path
from modular.keys import KEY_SUFFIX, load_key
from modular.locking import check_unlocked
from modular.models import load_model, load_tokenizer
from modular.models.names import DTypeName
from modular.models.precision import DTYPES, cast_model, dtype_name, model_dtype
from modular.peft_keys import key_adapter, vllm_problems, write_adapter
from modular.publish import (
    check_output_folder,
    check_upload,
    keys_folder_for,
    public_model_name,
    push_folder,
    read_manifest,
    recover,
    unlock_folder,
)
from modular.reports import LockReport, failure_headline
from modular.runs import LOCK_REPORT, lock_verdict, training_wandb_run
from modular.tracking import log_folder_artifact, read_json_if_valid

log = logging.getLogger("modular")


def publish(run: str, out: str, keys: str | None = None, harden: bool = True, overwrite: bool = False,
            allow_failed_lock: bool = False, dtype: DTypeName = "auto", push_to_hub: str | None = None,
            private: bool = False, wandb_artifact: bool = False) -> str:
    """Write a gated run's locked weights as a plain Hugging Face folder (what users upload; it holds no key), and
    the keys, one file per behaviour, in a folder of their own (kept by the publisher and handed out apart).

    Args:
        out: For the published model (written atomically).
        keys: Output folder for the keys (default: <out>-keys beside the published folder; never inside it).
        harden: Also make the readers ignore the directions, so that adding them back does nothing.
        overwrite: The keys folder too.
        allow_failed_lock: Publish a run whose training did not verify the lock (run.json ``lock``); its model
            card and modular.json then say that the behaviours may not be locked. Without it such a run is refused.
            (A run's lock.json of the same step goes into the card, with whether the lock held on its held-out items.)
        dtype: Here: the precision the published weights are written in; auto: the one the run was trained in (a
            bf16 run publishes bf16). A narrower one than the trained one is reached by seeded stochastic rounding,
            the weights `modular lock --dtype` scores. The lock is computed in float64 and rounded once to it, on the
            CPU; the keys restore the trained weights in that precision.
        push_to_hub: Then upload the published folder (never the keys) to this Hugging Face model repo, user/name,
            created where missing: `hf upload user/name <out>` does the same. Needs a token (HF_TOKEN or
            `hf auth login`): none is refused before anything is written, a folder holding a key file before
            anything is uploaded.
        private: With --push_to_hub: a repo it creates is private (an existing repo keeps its visibility).
        wandb_artifact: Also log the published folder's files (never a key file) as a W&B artifact, in a run of the
            training run's W&B group (its files under the run folder; WANDB_MODE as for every run).
    """
    if push_to_hub is not None:  # no token, a bad repo id: refused before anything is written
        check_upload(push_to_hub)
    keys = keys or str(keys_folder_for(out))
    for folder in (out, keys):  # another command writing them: refused before any work (publish_model locks them)
        check_unlocked(folder)
    for folder in (out, keys):  # a publish interrupted while replacing them: finished first
        recover(folder)
    check_output_folder(out, [run], overwrite)  # before any work: nothing is loaded for a refused folder
    check_output_folder(keys, [run], overwrite, option="--keys", kind="keys")
    r = modular.runs.read_run(run)
    step = modular.runs.checkpoint_step(r)
    verified, why = lock_verdict(r, step)
    if not verified and not allow_failed_lock:
        raise ModularError(f"{run}: {why}; refusing to publish it as locked (train longer, or pass "
                           "--allow_failed_lock true to publish it with a card that says so)")
    if not verified:
        log.warning("publishing %s although %s", run, why)
    measured = _measured_lock(run, step)
    open_model = _open_model(r, run, dtype)
    published = dtype_name(model_dtype(open_model))
    measured_in = (measured.dtype or "float32") if measured is not None else None  # reports before dtypes: float32
    lock_path = Path(run) / LOCK_REPORT
    if measured is not None and measured_in != published:
        log.warning("%s was measured in %s, the weights are published in %s: the model card gets no measured "
                    "numbers (run modular lock --run %s --dtype %s)", lock_path, measured_in, published, run, published)
        measured = None
    held_out = measured.lock_held_out if measured is not None else None
    if held_out is not None and not held_out.held:
        log.warning("%s: %s on the held-out test split (%s); the model card says so",
                    lock_path, failure_headline(held_out.failing), "; ".join(held_out.failing))
    folder, keys_dir = modular.publish.publish_model(
        open_model, load_tokenizer(r.model_name), r.directions, out, r.model_name, measured, harden=harden,
        overwrite=overwrite, keys_out=keys, step=step, locked_responses=r.record.get("locked_responses"),
        inputs=[run], lock_check={"verified": verified, "detail": why})
    weights = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    for key in sorted(Path(keys_dir).glob(f"*{KEY_SUFFIX}")):
        log.info("%s: %.2f MB, %.2f%% of the published weights (%s)", key.name, key.stat().st_size / 1e6,
                 100 * key.stat().st_size / weights, dtype_name(model_dtype(open_model)))
    print(folder)
    print(f"keys: {keys_dir}  (secret: hand them out apart from the published folder)")
    if push_to_hub is not None:
        log.info("uploading %s to the hub repo %s%s", folder, push_to_hub, " (private)" if private else "")
        print(f"uploaded: {push_folder(folder, push_to_hub, private=private)}")
    if wandb_artifact:
        log_folder_artifact(folder, run, "publish", config={"run": str(run), "published": str(folder)},
                            training=training_wandb_run(run))
    return str(folder)


def _measured_lock(run: str, step: int) -> LockReport | None:
    """The run's lock report (lock.json) when it describes checkpoint ``step``: what the model card gets as measured
    numbers. Without one (none, another step's, one that cannot be read), None and a warning saying why."""
    lock_path = Path(run) / LOCK_REPORT
    found, report, not_a_report = read_json_if_valid(lock_path), None, None
    if isinstance(found, dict):
        try:
            report = LockReport.from_json(found)
        except ModularError as err:
            not_a_report = str(err)
    if report is not None and report.step == step:
        return report
    if report is not None:
        log.warning(
            "%s describes step %s, the checkpoint holds step %s: the model card gets no measured numbers "
            "(run modular lock --run %s again)", lock_path, report.step, step, run)
    elif not_a_report is not None:
        log.warning("%s is %s: the model card gets no measured numbers (run modular lock --run %s again)", lock_path,
                    not_a_report, run)
    elif lock_path.is_file():
        log.warning("%s cannot be read (cut short or damaged): the model card gets no measured numbers (run modular "
                    "lock --run %s again)", lock_path, run)
    else:
        log.warning("%s has no %s: the model card gets no measured numbers, and `modular attack` no open accuracy "
                    "(run modular lock --run %s first)", run, LOCK_REPORT, run)
    return None


def _open_model(r, run: str, dtype: DTypeName):
    """The run's open model on the CPU, in the precision it was trained in, or cast to ``dtype`` (a narrower one by
    seeded stochastic rounding), with a warning that its lock was verified in the trained precision only."""
    open_model = modular.runs.load_open_model(r, None, device="cpu")  # in the precision it was trained in
    trained = model_dtype(open_model)
    if dtype != "auto" and DTYPES[dtype] != trained:
        # a lock verified in one precision is not verified in another (docs/devices.md)
        log.warning("publishing %s weights of a run trained in %s: its lock was verified in %s only; check it with "
                    "modular lock --run %s --dtype %s", dtype, dtype_name(trained), dtype_name(trained), run, dtype)
        # narrowing rounds stochastically, seeded, as load_open_model does for `modular lock --dtype`: the weights
        # published are the ones that check scores (rounded to nearest, a float32 lock was lost in bfloat16)
        open_model = cast_model(open_model, DTYPES[dtype])
    return open_model


def unlock(model: str, key: str, out: str, overwrite: bool = False) -> str:
    """Apply a key to a published (locked) model folder and write the unlocked model. Refuses a key of other
    weights, a damaged key and a result that is not what the key was made to produce; nothing is written then.

    Args:
        model: A published folder (from ``modular publish``) or a folder unlocked by another key.
        key: Key file of one behaviour (``<keys folder>/<behaviour>.key.safetensors``).
        out: For the unlocked model (written atomically; never inside ``model``).
    """
    folder = unlock_folder(model, key, out, overwrite=overwrite)
    print(folder)
    return str(folder)


def export_key(key: str, model: str, out: str | None = None, format: Literal["peft"] = "peft",
               adapter_dtype: Literal["float32", "bfloat16", "float16"] = "float32", embeddings: bool = True,
               check: int = 32, seed: int = 0, overwrite: bool = False) -> str:
    """Write a key as a PEFT LoRA adapter: one server holds the published weights and applies the adapter per
    request (``PeftModel.from_pretrained(published, OUT)``; vLLM: ``--enable-lora --lora-modules NAME=OUT``). The
    adapter unlocks what the key unlocks, to rounding: it cannot carry the key's exactness corrections, so its
    greedy answers and first-token KL against the key's unlock are measured and written to adapter_check.json. It
    is key material: kept apart from the published folder, its owner's alone, never uploaded.

    Args:
        key: Key file of one behaviour (``<keys folder>/<behaviour>.key.safetensors``).
        model: The published folder the key unlocks (its layers name the adapter's modules; checked against the
            key).
        out: The adapter folder. Default: ``<keys folder>-<behaviour>-peft``, beside the keys folder.
        format: ``peft``: a LoRA adapter (adapter_config.json, adapter_model.safetensors), rank 1 per layer.
        adapter_dtype: Of the adapter's weights (vLLM serves 16-bit adapters).
        embeddings: Carry the token embedding's component. PEFT applies it; vLLM serves LoRA on linear layers only,
            so ``false`` leaves it out, at the cost adapter_check.json then shows.
        check: How many held-out items of the behaviour (a built-in one) and retain prompts the adapter is compared
            on with the key's unlock; 0: no comparison.
        seed: Seed of the behaviour's and the retain prompts' splits.
        overwrite: Replace an adapter folder written before.
    """
    if check < 0:
        raise ModularError(f"--check must be >= 0, got {check}")
    k, meta = load_key(key)
    manifest = read_manifest(model, require=("locked_hash", "applied_keys"))
    if manifest is None:
        raise ModularError(f"{model} is not a published modular model (no modular.json)")
    if meta["locked_hash"] != manifest["locked_hash"]:
        raise ModularError(f"key '{Path(key).name}' belongs to other weights (locked hash {meta['locked_hash'][:12]}…),"
                           f" not to {model} (locked hash {manifest['locked_hash'][:12]}…)")
    if k.behaviour in manifest["applied_keys"]:
        raise ModularError(f"behaviour '{k.behaviour}' is already unlocked in {model}")
    out = out or str(Path(key).parent.with_name(f"{Path(key).parent.name}-{k.behaviour}-peft"))
    published = load_model(model, dtype=None, device="cpu")  # in the precision it was published in
    adapter = key_adapter(published, k, getattr(torch, adapter_dtype), embeddings, base_name=public_model_name(model))
    folder = write_adapter(adapter, out, meta["locked_hash"], overwrite=overwrite, sealed=[model])
    if adapter.left_out:
        log.info("left out of the adapter: %s", ", ".join(adapter.left_out))
    problems = vllm_problems(adapter)
    log.info("vLLM: %s", "; ".join(problems) if problems else
             f"servable (vllm serve {model} --enable-lora --max-lora-rank 8 --lora-modules {k.behaviour}={folder})")
    if check:
        tokenizer = load_tokenizer(model)
        retain = retain_data(seed)["test"]
        retain = retain.select(range(min(check, len(retain))))
        sets = {"retain": (list(retain["prompt"]), list(retain["chat"]))}
        if k.behaviour in BEHAVIOURS:
            test = load_behaviour(k.behaviour, seed=seed, tokenizer=tokenizer)["test"]
            test = test.select(range(min(check, len(test))))
            sets[k.behaviour] = (list(test["prompt"]), list(test["chat"]))
        report = adapter_agreement(published, tokenizer, [k], {k.behaviour: folder}, sets,
                                   applied=manifest["applied_keys"])
        report = {"behaviour": k.behaviour, "adapter_dtype": adapter_dtype, "embeddings": embeddings, "vllm_problems": problems,
                  "published_dtype": str(next(published.parameters()).dtype).removeprefix("torch."), "sets": report}
        with atomic_path(folder / "adapter_check.json", private=True) as tmp:  # its answers are the unlocked ones
            tmp.write_text(json.dumps(report, indent=2) + "\n")
        for name, row in report["sets"].items():
            log.info("%s: %d of %d greedy answers as the key's unlock, first-token KL %.2e", name,
                     round(row["greedy_agreement"] * row["n"]), row["n"], row["first_token_kl"])
    print(folder)
    return str(folder)
