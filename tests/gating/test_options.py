"""The gated module's option groups and the head-gate plug-in: each group checks its values in one line, and runs
trained when the options were flat still load (their checkpoints' hyperparameters are moved into the groups in one
place, :func:`modular.runs.grouped_model_options`), resume, and keep their identity."""

import dataclasses
import json

import pytest
import torch

from modular import ModularError
from modular.gating.head_gates import HeadGateOptions
from modular.gating.module import OPTION_GROUPS, GatedLM, check_model_options
from modular.identity import LORA_OPTIONS, RECIPE_OPTIONS, STRUCTURE_OPTIONS
from modular.runs import FLAT_MODEL_OPTIONS, flat_model_options, grouped_model_options
from tests.conftest import basic_terms, save_tiny_folder

#: the hyperparameters a checkpoint of the flat-option module kept (every option but the objectives)
LEGACY = dict(model_name="tiny", load_dtype="float32", behaviours=[], direction_strategy="low_variance",
              direction_files=None, direction_fraction=0.25, avoid_directions=None, locked_weight=1.0,
              finetuning="lora", lora_rank=4, lora_alpha=8, lr=1e-3, weight_decay=0.0, warmup_steps=0, seed=0,
              head_gates=True, gate_init=3.0, gate_lr=0.2, sparsity="penalty", sparsity_weight=40.0,
              lm_loss_target=0.45, multiplier_lr=0.05, multiplier_ema=0.9, multiplier_init=1.0, locked_steering=0.0,
              steering_refresh=20, gate_freeze_step=80, gate_scope="tasks", gate_live_prob=0.5,
              gradient_checkpointing=False, empty_init=False)


def test_the_constructor_takes_the_locks_options_and_a_group_each():
    """Twelve options: the lock's own and one per option group (head gates a plug-in of its own)."""
    import inspect

    names = [n for n in inspect.signature(GatedLM.__init__).parameters if n != "self"]
    assert len(names) <= 12
    assert set(OPTION_GROUPS) <= set(names) and "head_gates" in names


def test_every_flat_option_has_its_place_in_a_group():
    """Each flat option names a field of its group, with the default it had (the steering scale's flat default 0
    switched steering off: the group is null by default)."""
    for flat, (group, option, default) in FLAT_MODEL_OPTIONS.items():
        fields = {f.name: f.default for f in dataclasses.fields(OPTION_GROUPS[group])}
        assert option in fields, flat
        if flat != "locked_steering":
            assert fields[option] == default, flat
    covered = {(g, o) for g, o, _ in FLAT_MODEL_OPTIONS.values()}
    since = {("memory", "compile")}  # options added after the groups (no flat option had them)
    assert covered | since == {(g, f.name) for g, cls in OPTION_GROUPS.items() for f in dataclasses.fields(cls)}


def test_flat_hyperparameters_move_into_their_groups():
    grouped = grouped_model_options(LEGACY)
    assert grouped["finetuning"] == {"mode": "lora", "lora_rank": 4, "lora_alpha": 8}
    assert grouped["optimizer"] == {"lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0}
    assert grouped["head_gates"]["scope"] == "tasks" and grouped["head_gates"]["freeze_step"] == 80
    assert grouped["steering"] is None  # locked_steering 0: off
    assert not set(grouped) & (set(FLAT_MODEL_OPTIONS) - set(OPTION_GROUPS))
    groups = check_model_options(grouped)  # what the module takes
    assert groups["head_gates"] == HeadGateOptions(init=3.0, lr=0.2, sparsity="penalty", sparsity_weight=40.0,
                                                   lm_loss_target=0.45, multiplier_lr=0.05, freeze_step=80,
                                                   scope="tasks", live_prob=0.5)
    off = grouped_model_options({**LEGACY, "head_gates": False, "locked_steering": 2.0})
    assert off["head_gates"] is None and off["steering"] == {"scale": 2.0, "refresh": 20}
    assert grouped_model_options(grouped) == grouped  # grouped ones stay as they are


def test_identities_keep_their_flat_recipe():
    """A run's identity records the recipe in the flat form of the runs trained before the groups, so that such a
    run resumes as what it was; the same options grouped give the same recipe."""
    grouped = grouped_model_options(LEGACY)
    flat = flat_model_options(grouped)
    for key in (*RECIPE_OPTIONS, *STRUCTURE_OPTIONS, *LORA_OPTIONS):
        assert flat[key] == LEGACY[key], key
    plain = flat_model_options({"locked_weight": 1.0, "finetuning": {"mode": "full", "lora_rank": 16,
                                                                     "lora_alpha": 32}, "head_gates": None})
    assert {k: plain[k] for k in RECIPE_OPTIONS} == {"locked_weight": 1.0, "finetuning": "full", "head_gates": False,
                                                     "gate_scope": "all", "sparsity": "none", "sparsity_weight": 1.0,
                                                     "lm_loss_target": None}


@pytest.mark.parametrize("options, words", [({"optimizer": {"lr": 0.0}}, "model.optimizer.lr must be > 0"),
                                            ({"direction": {"fraction": 1.5}}, "model.direction.fraction must be in"),
                                            ({"finetuning": {"mode": "some"}}, "model.finetuning.mode must be"),
                                            ({"finetuning": {"mode": "none"}}, "trains nothing without head_gates"),
                                            ({"head_gates": {"scope": "heads"}}, "model.head_gates.scope must be"),
                                            ({"head_gates": {"sparsity": "constraint"}}, "needs lm_loss_target"),
                                            ({"head_gates": {"gate_lr": 0.1}}, "model.head_gates: no option gate_lr"),
                                            ({"head_gates": True}, "model.head_gates takes a mapping"),
                                            ({"steering": {"scale": 0.0}}, "model.steering.scale must be > 0"),
                                            ({"head_gates": {}, "memory": {"gradient_checkpointing": True}},
                                             "not available with head_gates")])
def test_a_bad_option_is_one_line(options, words):
    with pytest.raises(ModularError, match=words):
        check_model_options({"locked_weight": 1.0, **options})


def test_a_run_trained_with_flat_options_loads_as_it_was_trained(tmp_path):
    """A checkpoint whose hyperparameters are flat (LoRA of rank 4, gates scoped to the tasks): the run folder loads
    with that rank and its gates dropped, not folded (a closed head stays in the published model)."""
    from modular.models.head_gates import head_gate_modules, head_gate_scope
    from modular.runs import load_open_model, read_run

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), behaviours=[], finetuning={"mode": "lora", "lora_rank": 4, "lora_alpha": 8},
                 head_gates={"scope": "tasks"}, objectives=basic_terms()).eval()
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
        head_gate_modules(lm.hf_model)[0].log_alpha[0] = -10.0  # closed
    trainable = {f"model.{n}" for n, p in lm.model.named_parameters() if p.requires_grad}
    state = {k: v for k, v in lm.state_dict().items() if k in trainable or ".head_gate." in k}
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"state_dict": state, "global_step": 0, "hyper_parameters": {**LEGACY, "model_name": str(model_dir)}},
               run / "last.ckpt")
    (run / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": [], "finetuning": "lora",
                                              "checkpoint": str(run / "last.ckpt")}))
    tokens = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), head_gate_scope(lm.hf_model, active=False):
        plain = lm.model(input_ids=tokens).logits
    with torch.no_grad():
        gated = lm.model(input_ids=tokens).logits
    assert not torch.allclose(plain, gated, atol=1e-4)  # the closed head matters
    with torch.no_grad():
        loaded = load_open_model(read_run(run))(input_ids=tokens).logits
    torch.testing.assert_close(loaded, plain, atol=2e-5, rtol=1e-4)


def test_resuming_a_flat_checkpoint_by_path_parses_its_options(tmp_path):
    """``fit --ckpt_path FILE`` parses the checkpoint's hyperparameters back as the model's options (Lightning's
    LightningCLI): those of a run trained with flat options are moved into their groups first."""
    from modular.app.train import planned_run
    from tests.app.test_train import tiny_config

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir)
    ckpt = tmp_path / "flat.ckpt"
    hparams = {**LEGACY, "model_name": str(model_dir), "behaviours": ["capitals"], "head_gates": False}
    torch.save({"hyper_parameters": hparams, "state_dict": {}, "global_step": 0}, ckpt)
    _, identity = planned_run(["fit", "--config", str(cfg), "--ckpt_path", str(ckpt)])
    recipe = identity["recipe"]
    assert recipe["finetuning"] == "lora" and recipe["lora_rank"] == 4 and recipe["head_gates"] is False


def test_a_parsed_config_gives_its_head_gates_to_the_identity_and_the_data():
    """The training CLI parses the optional ``model.head_gates`` as a class path and its arguments: the run's
    identity still records its options, and gates of ``scope: tasks`` require counterfactual task batches."""
    from pathlib import Path

    from modular.app.train import planned_run
    from modular.gating.head_gates import HeadGateOptions, HeadGates
    from modular.gating.requirements import TaskCounterfactuals

    config = Path(__file__).resolve().parents[2] / "configs" / "sparse_heads_smollm2.yaml"
    _, identity = planned_run(["fit", "--config", str(config), "--trainer.default_root_dir", "unused-run-folder"])
    recipe = identity["recipe"]
    assert recipe["head_gates"] is True and recipe["gate_scope"] == "tasks" and recipe["sparsity_weight"] == 40.0
    assert HeadGates(HeadGateOptions(scope="tasks")).requires == (TaskCounterfactuals(),)
    assert HeadGates(HeadGateOptions(scope="all")).requires == ()
