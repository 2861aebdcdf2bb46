"""The lock-off control's config: the run's recipe with the lock's terms left out, the run's steps exactly."""

import pytest
import yaml

from modular import ModularError
from modular.gating import objectives
from modular.gating.control import control_config, term_class
from tests.app.test_train import ROOT


def _shipped() -> dict:
    return yaml.safe_load((ROOT / "configs" / "gate_capitals_smollm2.yaml").read_text())


def test_the_control_trains_every_term_but_the_locks_for_the_runs_steps():
    config = _shipped()
    config["trainer"]["logger"]["init_args"].update(id="r1234abcd", group="capitals-run")
    cfg, left_out = control_config(config, steps=57, folder="runs/ctl")
    paths = [t["class_path"].rsplit(".", 1)[-1] for t in config["model"]["objectives"]]
    kept = [t["class_path"].rsplit(".", 1)[-1] for t in cfg["model"]["objectives"]]
    assert [p.rsplit(".", 1)[-1] for p in left_out] == ["LockedState", "DirectionWrite"]
    assert kept == [p for p in paths if p not in ("LockedState", "DirectionWrite")]
    assert kept == ["BehaviourAnswer", "KeepReference", "KeepReference", "LMText", "RefusalGuard", "KeepHidden"]
    # the keep terms as the run had them, options and all
    assert cfg["model"]["objectives"][-1] == config["model"]["objectives"][-1]
    assert cfg["model"]["steering"] is None and config["model"]["steering"] is not None  # the run's left as it was
    assert cfg["trainer"]["max_steps"] == 57 and cfg["trainer"]["default_root_dir"] == "runs/ctl"
    lock = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("LockMetricsCallback"))
    assert lock["init_args"]["stop"] is False and lock["init_args"]["max_passes"] is None
    logger = cfg["trainer"]["logger"]["init_args"]
    assert logger["id"] is None and logger["group"] == "capitals-run" and logger["job_type"] == "lock-off-control"
    assert cfg["data"] == config["data"] and cfg["seed_everything"] == config["seed_everything"]


def test_each_term_says_whether_it_is_part_of_the_lock():
    lock = {"LockedState", "LockedAnswer", "DirectionWrite", "RelearningAdversary", "WeightNoiseLock",
            "QuantizedLock"}
    for name in objectives.__all__:
        cls = getattr(objectives, name)
        if isinstance(cls, type) and issubclass(cls, objectives.Term) and cls is not objectives.Term:
            assert cls.makes_the_lock == (name in lock), name
    assert term_class("LockedState") is objectives.LockedState


def test_a_config_the_control_cannot_be_made_of_is_one_line():
    config = _shipped()
    for terms, said in (([{"class_path": "modular.gating.objectives.BehaviourAnswer"}], "no term of the lock"),
                        ([{"class_path": "modular.gating.objectives.Nothing"}], "does not exist"),
                        ([{"class_path": "modular.gating.control.control_config"}], "which is not a term")):
        config["model"]["objectives"] = terms
        with pytest.raises(ModularError, match=said):
            control_config(config, 3, "x")
    config["model"]["behaviours"] = []
    with pytest.raises(ModularError, match="gates no behaviour"):
        control_config(config, 3, "x")


def test_a_run_trained_before_the_data_groups_gets_a_control_in_todays_layout():
    """A run folder's config.yaml written when the data options were flat (the default run of an earlier build):
    its control config has them in their groups, and today's check of moved options passes."""
    from modular.gating.data_options import check_moved_data_options

    config = _shipped()
    flat = {k: v for k, v in config["data"].items() if k not in ("reference", "lm_text")}
    flat.update(lm_text="neutral", lm_max_length=128, reference_max_new_tokens=48, reference_top_k=32,
                hidden_positions=8, hidden_stride=4, hidden_parts=["neighbours"], answer_rows=False)
    config["data"] = flat
    with pytest.raises(ModularError):
        check_moved_data_options(config["data"])
    cfg, _ = control_config(config, 10, "x")
    check_moved_data_options(cfg["data"])
    assert cfg["data"]["reference"] == {"max_new_tokens": 48, "top_k": 32, "hidden_positions": 8, "hidden_stride": 4}
    assert cfg["data"]["lm_text"] == {"source": "neutral", "max_length": 128}
    assert "hidden_parts" not in cfg["data"] and "answer_rows" not in cfg["data"]
    assert cfg["data"]["neighbours"] == config["data"]["neighbours"]
