"""The typed reports (modular.reports): every lock.json and attack.json committed under docs/measurements reads
through them and is written back as it was, plus its version; what is not a report, or a later version's, is one
line."""

import json
from pathlib import Path

import pytest

from modular import ModularError
from modular.reports import (
    ATTACK_REPORT_VERSION,
    LOCK_REPORT_VERSION,
    AttackEntry,
    AttackReport,
    HeldOut,
    LockReport,
    Score,
    StateRow,
)

MEASUREMENTS = Path(__file__).resolve().parents[1] / "docs" / "measurements"


def _committed(kind: str) -> list[Path]:
    """The committed JSON files that are reports of ``kind``, told by their content: a lock report has ``states``,
    an attack report ``behaviours`` and ``sweep``."""
    found = []
    for path in sorted(MEASUREMENTS.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and ("states" in data if kind == "lock" else {"behaviours", "sweep"} <= set(data)):
            found.append(path)
    return found


LOCKS, ATTACKS = _committed("lock"), _committed("attack")


def test_the_committed_measurements_hold_lock_and_attack_reports():
    assert len(LOCKS) >= 20 and all(p.name.startswith("lock_") for p in LOCKS)
    assert len(ATTACKS) >= 20 and all(p.name.startswith("attack_") for p in ATTACKS)


def _as_written(data: dict, original: str) -> str:
    """The report as the file holds it: files written before reports were versioned have no version key."""
    versioned = "version" in json.loads(original)
    return json.dumps({k: v for k, v in data.items() if versioned or k != "version"}, indent=2) + "\n"


@pytest.mark.parametrize("path", LOCKS, ids=lambda p: p.name)
def test_every_committed_lock_report_reads_and_is_written_back_as_it_was(path):
    report = LockReport.read(path)
    assert report.version == 1 and report.gated and "base" in report.states
    assert all(isinstance(row, StateRow) for row in report.states.values())
    assert report.accuracies("base") == {b: json.loads(path.read_text())["states"]["base"]["behaviours"][b]["accuracy"]
                                         for b in report.gated}
    out = report.to_json()
    assert list(out)[0] == "version" and out["version"] == 1
    assert _as_written(out, path.read_text()) == path.read_text()  # the same keys, in the same order, the same values


@pytest.mark.parametrize("path", ATTACKS, ids=lambda p: p.name)
def test_every_committed_attack_report_reads_and_is_written_back_as_it_was(path):
    report = AttackReport.read(path)
    assert report.version == 1 and report.behaviours
    for entry in report.behaviours.values():
        assert entry.base_accuracy is not None and entry.attacks  # the report's own fields are not read as attacks
        assert not {"baselines", "advantage", "base_accuracy"} & set(entry.attacks)
    out = report.to_json()
    assert list(out)[0] == "version" and out["version"] == 1
    assert _as_written(out, path.read_text()) == path.read_text()


def test_a_report_is_written_with_its_version_and_reads_back_the_same(tmp_path):
    row = StateRow(behaviours={"capitals": Score(0.5, 4, 0.0, ci95=(0.2, 0.8))}, retain_first_token_kl=0.01,
                   perplexity=12.0, perplexity_ratio=1.01)
    lock = LockReport(states={"base": row, "open": row}, gated=["capitals"], step=3,
                      lock_held_out=HeldOut(False, ["capitals locked accuracy 0.50 > 0.05"], {"locked_accuracy": 0.05}))
    lock.write(tmp_path / "lock.json")
    written = json.loads((tmp_path / "lock.json").read_text())
    assert written["version"] == LOCK_REPORT_VERSION and written["step"] == 3
    assert written["states"]["open"]["behaviours"]["capitals"] == {"accuracy": 0.5, "n": 4, "refusal_rate": 0.0,
                                                                   "ci95": [0.2, 0.8]}
    assert written["lock_held_out"] == {"held": False, "failing": ["capitals locked accuracy 0.50 > 0.05"],
                                        "targets": {"locked_accuracy": 0.05}}
    assert LockReport.read(tmp_path / "lock.json") == lock
    attack = AttackReport(behaviours={"capitals": AttackEntry(0.4, 0.6, "published folder", 0.0, 100.0,
                                                              {"a_weights": {"best": {"accuracy": 0.1}}})},
                          model="pub", base="base", dtype="float32", sweep={"max_steps": 4})
    attack.write(tmp_path / "attack.json")
    written = json.loads((tmp_path / "attack.json").read_text())
    assert written["version"] == ATTACK_REPORT_VERSION
    assert list(written["behaviours"]["capitals"]) == ["base_accuracy", "open_accuracy", "open_accuracy_from",
                                                       "locked_accuracy", "residual_scale", "a_weights", "baselines"]
    assert AttackReport.read(tmp_path / "attack.json") == attack


def test_what_is_not_a_report_or_is_a_later_version_is_one_line(tmp_path):
    path = tmp_path / "lock.json"
    path.write_text('{"step": ')
    with pytest.raises(ModularError, match=r"lock\.json is not a readable lock report"):
        LockReport.read(path)
    path.write_text(json.dumps({"step": 3}))
    with pytest.raises(ModularError, match=r"lock\.json is not a lock report \(no 'states' entry\)"):
        LockReport.read(path)
    path.write_text(json.dumps({"version": LOCK_REPORT_VERSION + 1, "states": {}}))
    with pytest.raises(ModularError, match=f"version {LOCK_REPORT_VERSION + 1}: this modular reads versions 1 to"):
        LockReport.read(path)
    path.write_text(json.dumps({"behaviours": {"capitals": {"base_accuracy": 0.5}}, "version": "1"}))
    with pytest.raises(ModularError, match="attack report of version '1'") as err:
        AttackReport.read(path)
    assert "\n" not in str(err.value)
    with pytest.raises(ModularError, match=r"not a score \(no 'accuracy' entry\)"):
        LockReport.from_json({"states": {"open": {"behaviours": {"capitals": {"n": 3}}}}})


def test_unknown_entries_are_kept():
    data = {"states": {}, "gated": [], "later_entry": {"x": 1}}
    assert LockReport.from_json(data).to_json()["later_entry"] == {"x": 1}
    entry = AttackEntry.from_json({"base_accuracy": 0.5, "f_noise": {"accuracy": 0.2}, "baselines": {}})
    assert entry.attacks == {"f_noise": {"accuracy": 0.2}} and entry.to_json() == {
        "base_accuracy": 0.5, "f_noise": {"accuracy": 0.2}, "baselines": {}}


@pytest.mark.parametrize("lock, verdict", [
    (None, (False, "the lock was never checked in training (no LockMetricsCallback in its config)")),
    ({"step": 4, "reached": True}, (False, "the lock was checked at step 4, the checkpoint holds step 5")),
    ({"step": 5, "reached": False, "failing": ["b locked accuracy 0.20 > 0.05"]},
     (False, "not locked on validation at step 5: b locked accuracy 0.20 > 0.05")),
    ({"step": 5, "reached": True, "failing": [], "history": []}, (True, "the lock held on validation at step 5")),
])
def test_the_run_records_lock_check_reads_typed(tmp_path, lock, verdict):
    from modular.runs import Run, lock_verdict, recorded_check

    run = Run(tmp_path, "tiny", ["b"], {}, {"lock": lock})
    assert lock_verdict(run, 5) == verdict
    check = recorded_check(run)
    assert check is None if lock is None else (check.step, check.reached) == (lock["step"], lock["reached"])


def test_a_verdict_names_what_failed_and_never_calls_a_lock_that_held_not_locked():
    """Each phrase training's check and the lock evaluation write (modular.evaluation.targets.lock_failures) is
    classified, and the headline says "not locked" only where a locked state still answers."""
    from modular.evaluation.targets import TARGETS, lock_failures
    from modular.reports import HeldOut, failed_kinds, failure_headline

    def failing(locked=0.0, opened=0.6, kl=0.01):
        return lock_failures(TARGETS, {"b": opened}, {"locked": {"b": locked}, "published_locked": {"b": locked}},
                             {"b": 0.5}, {"open": kl, "locked": kl})

    assert failure_headline(failing()) == "" and failed_kinds(failing()) == []
    assert failed_kinds(failing(locked=0.3)) == ["locked"]
    assert failure_headline(failing(locked=0.3)) == "not locked"
    assert failed_kinds(failing(opened=0.4, kl=0.2)) == ["open", "retain"]
    assert failure_headline(failing(opened=0.4, kl=0.2)) == ("locked, but the open state is below its target and "
                                                             "the retain KL is above its target")
    assert failure_headline(failing(locked=0.3, kl=0.2)) == "not locked (and the retain KL is above its target)"
    assert failure_headline(failing(opened=0.1)) == "locked, but the open state is below its target"
    assert HeldOut(False, failing(kl=0.2)).text() == ("LOCKED, but the retain KL is above its target on the held-out "
                                                      "test split: " + "; ".join(failing(kl=0.2)))
    assert HeldOut(False, failing(locked=0.3)).text().startswith("NOT LOCKED on the held-out test split: b locked")
