"""``modular publish`` and ``modular unlock``: the locked weights as a plain Hugging Face folder, the keys apart."""

from __future__ import annotations

import logging
from pathlib import Path

from modular import ModularError
from modular.models.names import DTypeName
from modular.tracking import read_json_if_valid

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
    # the library is loaded here, not at the top: help loads no torch, a command loads its modules when it runs
    from modular.keys import KEY_SUFFIX
    from modular.locking import check_unlocked
    from modular.models import load_tokenizer
    from modular.models.precision import DTYPES, cast_model, dtype_name, model_dtype
    from modular.publish import check_output_folder, check_upload, keys_folder_for, publish_model, push_folder, recover
    from modular.runs import LOCK_REPORT, checkpoint_step, load_open_model, lock_verdict, read_run

    if push_to_hub is not None:  # no token, a bad repo id: refused before anything is written
        check_upload(push_to_hub)
    keys = keys or str(keys_folder_for(out))
    for folder in (out, keys):  # another command writing them: refused before any work (publish_model locks them)
        check_unlocked(folder)
    for folder in (out, keys):  # a publish interrupted while replacing them: finished first
        recover(folder)
    check_output_folder(out, [run], overwrite)  # before any work: nothing is loaded for a refused folder
    check_output_folder(keys, [run], overwrite, option="--keys", kind="keys")
    r = read_run(run)
    step = checkpoint_step(r)
    verified, why = lock_verdict(r, step)
    if not verified and not allow_failed_lock:
        raise ModularError(f"{run}: {why}; refusing to publish it as locked (train longer, or pass "
                           "--allow_failed_lock true to publish it with a card that says so)")
    if not verified:
        log.warning("publishing %s although %s", run, why)
    measured = None
    lock_path = Path(run) / LOCK_REPORT
    report = read_json_if_valid(lock_path)
    if isinstance(report, dict) and report.get("step") == step:
        measured = report
    elif isinstance(report, dict):
        log.warning(
            "%s describes step %s, the checkpoint holds step %s: the model card gets no measured numbers "
            "(run modular lock --run %s again)", lock_path, report.get("step"), step, run)
    elif lock_path.is_file():
        log.warning("%s cannot be read (cut short or damaged): the model card gets no measured numbers (run modular "
                    "lock --run %s again)", lock_path, run)
    else:
        log.warning("%s has no %s: the model card gets no measured numbers, and `modular attack` no open accuracy "
                    "(run modular lock --run %s first)", run, LOCK_REPORT, run)
    open_model = load_open_model(r, None, device="cpu")  # in the precision it was trained in
    trained = model_dtype(open_model)
    if dtype != "auto" and DTYPES[dtype] != trained:
        # a lock verified in one precision is not verified in another (docs/devices.md)
        log.warning("publishing %s weights of a run trained in %s: its lock was verified in %s only; check it with "
                    "modular lock --run %s --dtype %s", dtype, dtype_name(trained), dtype_name(trained), run, dtype)
        # narrowing rounds stochastically, seeded, as load_open_model does for `modular lock --dtype`: the weights
        # published are the ones that check scores (rounded to nearest, a float32 lock was lost in bfloat16)
        open_model = cast_model(open_model, DTYPES[dtype])
    published = dtype_name(model_dtype(open_model))
    if measured is not None and measured.get("dtype", "float32") != published:  # reports before dtypes: float32
        log.warning("%s was measured in %s, the weights are published in %s: the model card gets no measured "
                    "numbers (run modular lock --run %s --dtype %s)", lock_path, measured.get("dtype", "float32"),
                    published, run, published)
        measured = None
    held_out = (measured or {}).get("lock_held_out")
    if held_out is not None and not held_out["held"]:
        log.warning("%s: the lock did not hold on the held-out test split (%s); the model card says so",
                    lock_path, "; ".join(held_out["failing"]))
    folder, keys_dir = publish_model(open_model, load_tokenizer(r.model_name), r.directions, out,
                                     r.model_name, measured, harden=harden, overwrite=overwrite, keys_out=keys,
                                     step=step, locked_responses=r.record.get("locked_responses"), inputs=[run],
                                     lock_check={"verified": verified, "detail": why})
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
        from modular.runs import training_wandb_run
        from modular.tracking import log_folder_artifact

        log_folder_artifact(folder, run, "publish", config={"run": str(run), "published": str(folder)},
                            training=training_wandb_run(run))
    return str(folder)


def unlock(model: str, key: str, out: str, overwrite: bool = False) -> str:
    """Apply a key to a published (locked) model folder and write the unlocked model. Refuses a key of other
    weights, a damaged key and a result that is not what the key was made to produce; nothing is written then.

    Args:
        model: A published folder (from ``modular publish``) or a folder unlocked by another key.
        key: Key file of one behaviour (``<keys folder>/<behaviour>.key.safetensors``).
        out: For the unlocked model (written atomically; never inside ``model``).
    """
    from modular.publish import unlock_folder

    folder = unlock_folder(model, key, out, overwrite=overwrite)
    print(folder)
    return str(folder)
