"""Sparse post-training: head gates inside the gating LightningModule, tasks without a lock, the LM-text term,
checkpoints and loading the run folder as a plain model with the gates folded in."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from modular import ModularError
from modular.gating.data import GatingDataModule
from modular.gating.losses import first_token_kl, token_ce, topk_kl
from modular.gating.module import GatedLM
from modular.gating.objectives import (
    ClosedAttribution,
    HeadConsistency,
    HeadInterchange,
    HeadMargin,
)
from modular.gating.requirements import TaskCounterfactuals
from modular.models import load_model
from modular.models.adapter import ArchitectureAdapter
from modular.models.head_gates import GatedOutputProjection, deterministic_gate_values, head_gate_modules
from tests.conftest import basic_terms, save_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_folder(tmp_path_factory, monkeypatch):
    """Tiny model folders and a cache shared by this module's tests (reference outputs are computed once)."""
    base = tmp_path_factory.getbasetemp() / "sparse-heads"
    monkeypatch.setenv("MODULAR_CACHE", str(base / "cache"))

    def make(arch):
        path = base / arch
        if not (path / "config.json").exists():
            save_tiny_folder(path, arch)
        return path

    return make


def _fit(module, dm, root, steps=3):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=str(root))
    trainer.fit(module, datamodule=dm)
    return trainer


def _sparse(model_dir, head=None, finetuning="full", gated=True, **gates):
    """A sparse post-training module on a tiny model, its head gates' options ``gates`` (learning rate 0.1 unless
    given; ``gated`` false: no gates); ``head``: a head-gate term added to the basic terms."""
    return GatedLM(model_name=str(model_dir), behaviours=[], finetuning={"mode": finetuning}, optimizer={"lr": 1e-3},
                   head_gates={"lr": 0.1, **gates} if gated else None,
                   objectives=[*basic_terms(), *([head] if head is not None else [])])


def _fix_gates_from(module, step: int) -> None:
    """The module's head gates fixed from ``step`` on (its ``head_gates.freeze_step``)."""
    module.head_gates.options = dataclasses.replace(module.head_gates.options, freeze_step=step)


def _counterfactual_batch(dm, key):
    """The first training batch in which some of ``key``'s rows have a counterfactual other than their own prompt
    (the tiny tokenizer encodes some counterfactuals to another length; those rows keep their own prompt)."""
    for batch in dm.train_dataloader():
        batch = batch[0] if isinstance(batch, tuple) else batch
        if (batch[key]["counterfactual"]["input_ids"] != batch[key]["open"]["input_ids"]).any():
            return batch
    raise AssertionError(f"no {key} row with a counterfactual of its own")


def _counterfactual_run(module, task):
    """The plain model on ``task``'s counterfactual prompts: every head's input, and the last position's logits."""
    cf = task["counterfactual"]
    return module.head_gates.counterfactual_run(module, {"cf_input_ids": cf["input_ids"],
                                                         "cf_attention_mask": cf["attention_mask"]}, False)


def _scoped_run(module, task):
    """The task rows with closed heads fed their counterfactual input (the scoped run of the step)."""
    from modular.models.head_gates import head_gate_scope

    cf_inputs, _ = _counterfactual_run(module, task)
    with torch.no_grad(), head_gate_scope(module.hf_model, replacements=cf_inputs):
        return module.model(input_ids=task["open"]["input_ids"], attention_mask=task["open"]["attention_mask"]).logits


def _data(model_dir, counterfactuals: bool = False, lm_max_length: int = 32, **kw):
    """Task data on a tiny model; ``counterfactuals``: the task items carry their counterfactual prompts (what a
    trainer's module with gates scoped to the tasks requires)."""
    args = dict(model_name=str(model_dir), behaviours=[], tasks=["ioi", "greater_than"],
                lm_text=dict(source="neutral", max_length=lm_max_length), batch_size=4, max_length=64,
                reference=dict(max_new_tokens=4, top_k=8))
    args.update(kw)
    dm = GatingDataModule(**args)
    return dm.require(TaskCounterfactuals()) if counterfactuals else dm


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_gates_only_training_keeps_base_weights_and_saves_gates(tmp_path, tiny_folder, arch):
    model_dir = tiny_folder(arch)
    module = _sparse(model_dir, finetuning="none", sparsity="penalty", sparsity_weight=1.0)
    names = [n for n, _ in module.named_parameters()]
    n_layers = ArchitectureAdapter(module.hf_model).n_layers
    assert sum(n.endswith("head_gate.log_alpha") for n in names) == n_layers
    assert {n for n, p in module.named_parameters() if p.requires_grad} == {n for n in names if "head_gate." in n}
    trainer = _fit(module, _data(model_dir), tmp_path / "run")
    base = load_model(str(model_dir)).state_dict()
    trained = {k.replace(".base_layer", ""): v for k, v in module.hf_model.state_dict().items() if "head_gate" not in k}
    for k, v in base.items():
        torch.testing.assert_close(trained[k], v, atol=0, rtol=0)
    moved = torch.cat([g.log_alpha.detach() for g in head_gate_modules(module.hf_model)])
    assert not torch.allclose(moved, torch.full_like(moved, 3.0))  # the gates did train
    path = tmp_path / "gates.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert sum(k.endswith("head_gate.log_alpha") for k in state) == n_layers
    assert sum(k.endswith("head_gate.fixed") for k in state) == n_layers
    assert not any(k.endswith("weight") and "head_gate" not in k for k in state)  # frozen base is referenced


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_penalty_lowers_expected_l0_jointly_with_full_finetuning(tmp_path, tiny_folder, arch):
    model_dir = tiny_folder(arch)
    module = _sparse(model_dir, sparsity="penalty", sparsity_weight=10.0, lr=0.2, init=0.0)
    with torch.no_grad():
        start = sum(g.expected_l0() for g in head_gate_modules(module.hf_model)).item()
    _fit(module, _data(model_dir), tmp_path / "run", steps=6)
    with torch.no_grad():
        end = sum(g.expected_l0() for g in head_gate_modules(module.hf_model)).item()
    assert end < start - 0.5


def test_gates_freeze_at_the_given_step_and_the_weights_go_on_training(tmp_path, tiny_folder):
    """Prune, then fine-tune: after head_gates.freeze_step the gates are fixed (saved) and only the weights move."""
    model_dir = tiny_folder("llama")
    module = _sparse(model_dir, sparsity="penalty", sparsity_weight=10.0, lr=0.2, init=0.0, freeze_step=3)
    _fit(module, _data(model_dir), tmp_path / "run", steps=3)
    gates = head_gate_modules(module.hf_model)
    assert all(torch.isnan(g.fixed).all() for g in gates)  # steps 0-2 learn the gates
    weight = module.hf_model.lm_head.weight.detach().clone()
    trainer = _fit(module, _data(model_dir), tmp_path / "run2", steps=5)  # steps 0..4 again: frozen from step 3
    frozen = deterministic_gate_values(module.hf_model)
    assert not any(torch.isnan(g.fixed).any() for g in gates)
    module.train()
    for _ in range(3):  # training mode: no noise any more, the fixed values are what the model uses
        torch.testing.assert_close(torch.stack([g() for g in gates]), frozen)
    assert not torch.equal(weight, module.hf_model.lm_head.weight.detach())
    path = tmp_path / "f.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert not any(torch.isnan(v).any() for k, v in saved.items() if k.endswith("head_gate.fixed"))


def test_constraint_multiplier_is_a_checkpointed_buffer(tmp_path, tiny_folder):
    model_dir = tiny_folder("llama")
    module = _sparse(model_dir, sparsity="constraint", lm_loss_target=1e-6, multiplier_lr=0.5, multiplier_ema=0.0)
    trainer = _fit(module, _data(model_dir), tmp_path / "run", steps=3)
    assert module.sparsity.multiplier.item() > 1.0  # violated (τ tiny): μ rose
    assert "train/multiplier" in trainer.callback_metrics and "train/expected_l0" in trainer.callback_metrics
    assert {"train/lm_loss", "train/open_heads", "train/lm/kl", "train/ioi/task_ce"} <= set(trainer.callback_metrics)
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["state_dict"]["sparsity.multiplier"].item() > 1.0


def test_lm_and_task_batches_are_open_only(tmp_path, tiny_folder):
    model_dir = tiny_folder("llama")
    dm = _data(model_dir)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    batch = batch[0] if isinstance(batch, tuple) else batch
    assert set(batch) == {"retain", "task:ioi", "task:greater_than", "lm"}
    assert set(batch["task:ioi"]) == {"open"} and set(batch["lm"]) == {"open"}
    lm = batch["lm"]["open"]
    assert lm["topk_ids"].shape[:2] == (4, lm["input_ids"].shape[1] - 1)
    assert (lm["labels"][:, 1:] != -100).sum() == lm["attention_mask"][:, 1:].sum()  # every real token


def test_nothing_to_train_is_an_error():
    from modular import ModularError

    with pytest.raises(ModularError):
        GatingDataModule(behaviours=[], tasks=[])
    with pytest.raises(ModularError):
        GatedLM(model_name="unused-alias", finetuning={"mode": "none"})


@pytest.mark.parametrize("arch,finetuning", [("llama", "full"), ("gpt2", "lora"), ("gemma3_text", "none")])
def test_run_folder_loads_with_gates_folded(tmp_path, tiny_folder, arch, finetuning):
    from modular.runs import load_open_model, read_run

    model_dir = tiny_folder(arch)
    module = _sparse(model_dir, finetuning=finetuning, sparsity="penalty", sparsity_weight=5.0, lr=0.5)
    run = tmp_path / "run"
    trainer = _fit(module, _data(model_dir), run, steps=4)
    with torch.no_grad():  # make sure some heads are closed, some half-open
        gates = head_gate_modules(module.hf_model)
        gates[0].log_alpha[0] = -10.0
        gates[-1].log_alpha[1] = 0.3
    trainer.save_checkpoint(run / "last.ckpt")
    (run / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": [],
                                              "finetuning": finetuning, "checkpoint": str(run / "last.ckpt")}))
    module.eval()
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module.model(input_ids=tokens).logits
        values = deterministic_gate_values(module.hf_model)
    assert values[0, 0] == 0 and 0 < values[-1, 1] < 1
    plain = load_open_model(read_run(run))
    assert not any(isinstance(m, GatedOutputProjection) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=tokens).logits, expected, atol=2e-5, rtol=1e-4)
    # every command's model loader takes the run folder too
    from modular.runs import load_model_or_run, load_tokenizer_or_run

    with torch.no_grad():
        torch.testing.assert_close(load_model_or_run(run)(input_ids=tokens).logits, expected, atol=2e-5, rtol=1e-4)
    assert load_tokenizer_or_run(run).padding_side == "left"


def tiny_sparse_config(tmp_path, model_dir, name="sparse_heads_pruned_smollm2.yaml"):
    cfg = yaml.safe_load((ROOT / "configs" / name).read_text())
    run = tmp_path / "run"
    cfg["model"].update({"model_name": str(model_dir), "optimizer": {**cfg["model"]["optimizer"], "lr": 1e-3}})
    cfg["model"]["head_gates"].update({"lm_loss_target": 0.05, "freeze_step": 2})
    cfg["data"].update({"reference": {**cfg["data"]["reference"], "max_new_tokens": 4}, "batch_size": 2,
                        "max_length": 64, "lm_text": {**cfg["data"]["lm_text"], "max_length": 32},
                        "tasks": ["ioi", "docstring"]})
    cfg["trainer"].update({"default_root_dir": str(run), "max_steps": 3, "val_check_interval": 3,
                           "limit_val_batches": 1, "log_every_n_steps": 1, "enable_progress_bar": False})
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(run)
    cfg["trainer"]["callbacks"][0]["init_args"].update({"dirpath": str(run), "every_n_train_steps": 2})
    cfg["trainer"]["callbacks"][1]["init_args"].update({"limit": 4, "max_new_tokens": 3})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run


def test_sparse_config_trains_through_train_py_and_resumes(tmp_path, tiny_folder):
    import os

    model_dir = tiny_folder("qwen2")
    cfg, run = tiny_sparse_config(tmp_path, model_dir)
    env = dict(os.environ, WANDB_MODE="offline")
    cmd = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(cfg)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["head_gates"] and record["tasks"] == ["ioi", "docstring"] and record["behaviours"] == []
    assert record["n_heads"] == 2 * 4 and 0 <= record["open_heads"] <= 8
    assert {"train/expected_l0", "train/lm_loss", "val/open_heads", "val/ioi/accuracy",
            "val/neutral_perplexity"} <= set(record["metrics"])
    assert json.loads((run / "head_gates.json").read_text())["n_heads"] == 8
    assert not (run / "directions.safetensors").exists()
    out = subprocess.run(cmd + ["--trainer.max_steps", "4"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Restoring states from the checkpoint" in out.stderr + out.stdout
    assert json.loads((run / "run.json").read_text())["global_step"] == 4
    saved = torch.load(run / "last.ckpt", weights_only=False)["state_dict"]  # pruned at step 2, then fine-tuned
    fixed = [v for k, v in saved.items() if k.endswith("head_gate.fixed")]
    assert len(fixed) == 2 and not any(torch.isnan(v).any() for v in fixed)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_raw_text_runs_in_a_forward_of_its_own_and_terms_match_piece_by_piece(tiny_folder, arch):
    """The gated step groups pieces by ablation set, raw LM text apart: the short chat pieces are not padded
    to the text's length, and every term equals the one from the piece's own forward."""
    model_dir = tiny_folder(arch)
    dm = _data(model_dir, lm_max_length=96)
    dm.setup("fit")
    module = _sparse(model_dir, gated=False).eval()
    batch = next(iter(dm.train_dataloader()))
    batch = batch[0] if isinstance(batch, tuple) else batch
    lm_width = batch["lm"]["open"]["input_ids"].shape[1]
    chat_width = max(p["input_ids"].shape[1] for k in batch if k != "lm" for p in batch[k].values())
    assert lm_width > chat_width  # otherwise the test could not tell the groupings apart
    shapes = []
    handle = module.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        with torch.no_grad():
            _, terms = module.model_step(batch, train=False)
    finally:
        handle.remove()
    n_lm = batch["lm"]["open"]["input_ids"].shape[0]
    n_chat = sum(p["input_ids"].shape[0] for k in batch if k != "lm" for p in batch[k].values())
    assert sorted(shapes) == sorted([(n_lm, lm_width), (n_chat, chat_width)])
    names = {("lm", "open"): "lm/kl", ("retain", "open"): "retain/open_kl",
             ("retain", "locked"): "retain/locked_kl",  # nothing to ablate without behaviours: same forward
             ("task:ioi", "open"): "ioi/task_ce", ("task:greater_than", "open"): "greater_than/task_ce"}
    assert set(terms) == set(names.values())
    with torch.no_grad():
        for (key, state), name in names.items():
            piece = batch[key][state]
            logits = module.model(input_ids=piece["input_ids"], attention_mask=piece["attention_mask"]).logits
            expected = (token_ce(logits, piece["labels"]) if key.startswith("task:")
                        else topk_kl(logits, piece["labels"], piece["topk_ids"], piece["topk_logp"]))
            if key == "retain":  # KeepReference: the first response token's full KL at weight 1 on top
                expected = expected + first_token_kl(logits, piece["labels"], piece["first_logp"])
            torch.testing.assert_close(terms[name], expected, atol=1e-4, rtol=1e-4)


def test_gates_scoped_to_tasks_swap_closed_heads_on_task_items_only(tiny_folder):
    """head_gates.scope: tasks: retain and LM text run the plain model whatever the gates; a task item runs with each
    closed head's input swapped for its input on the counterfactual prompt."""
    from modular.hooks import capture_head_inputs, replace_heads
    from modular.models.head_gates import head_gate_scope

    model_dir = tiny_folder("llama")
    dm = _data(model_dir, counterfactuals=True)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    batch = batch[0] if isinstance(batch, tuple) else batch
    task = batch["task:greater_than"]  # other numbers, same token count: every item aligned
    assert task["counterfactual"]["input_ids"].shape == task["open"]["input_ids"].shape
    assert torch.equal(task["counterfactual"]["attention_mask"], task["open"]["attention_mask"])
    assert not torch.equal(task["counterfactual"]["input_ids"], task["open"]["input_ids"])
    module = _sparse(model_dir, scope="tasks").eval()
    with torch.no_grad():
        _, open_terms = module.model_step(batch, train=False)
        gates = head_gate_modules(module.hf_model)
        for g in gates:
            g.fixed.fill_(0.0)  # every head closed on the tasks
        _, closed_terms = module.model_step(batch, train=False)
    for name in ("retain/open_kl", "lm/kl"):
        torch.testing.assert_close(closed_terms[name], open_terms[name], atol=0, rtol=0)
    assert closed_terms["greater_than/task_ce"] != open_terms["greater_than/task_ce"]
    adapter = ArchitectureAdapter(module.hf_model)
    heads = [(i, h) for i in range(adapter.n_layers) for h in range(adapter.n_heads)]
    with torch.no_grad(), head_gate_scope(module.hf_model, active=False):
        with capture_head_inputs(adapter) as z:
            module.model(input_ids=task["counterfactual"]["input_ids"],
                         attention_mask=task["counterfactual"]["attention_mask"])
        with replace_heads(adapter, heads, dict(z)):
            logits = module.model(input_ids=task["open"]["input_ids"], attention_mask=task["open"]["attention_mask"]).logits
    torch.testing.assert_close(closed_terms["greater_than/task_ce"], token_ce(logits, task["open"]["labels"]),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ModularError, match="counterfactual"):
        module.model_step({k: {"open": v["open"]} if k.startswith("task:") else v for k, v in batch.items()}, False)


def test_run_folder_drops_gates_scoped_to_tasks(tmp_path, tiny_folder):
    from modular.models.head_gates import head_gate_scope
    from modular.runs import load_open_model, read_run

    model_dir = tiny_folder("qwen2")
    module = _sparse(model_dir, scope="tasks", sparsity="penalty", sparsity_weight=5.0, lr=0.5)
    run = tmp_path / "run"
    trainer = _fit(module, _data(model_dir), run, steps=2)  # the module's gates require the counterfactuals
    with torch.no_grad():
        head_gate_modules(module.hf_model)[0].log_alpha[0] = -10.0  # closed on the tasks
    trainer.save_checkpoint(run / "last.ckpt")
    (run / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": [],
                                              "finetuning": "full", "checkpoint": str(run / "last.ckpt")}))
    module.eval()
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), head_gate_scope(module.hf_model, active=False):
        expected = module.model(input_ids=tokens).logits
    plain = load_open_model(read_run(run))
    assert not any(isinstance(m, GatedOutputProjection) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=tokens).logits, expected, atol=2e-5, rtol=1e-4)


def test_scoped_config_trains_through_train_py_with_counterfactual_task_batches(tmp_path, tiny_folder):
    """train.py links model.head_gates.scope: tasks to the data's counterfactual task batches."""
    import os

    from modular.runs import load_open_model, read_run

    cfg, run = tiny_sparse_config(tmp_path, tiny_folder("llama"), "sparse_heads_smollm2.yaml")
    cmd = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(cfg)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline"))
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["global_step"] == 3 and {"train/ioi/task_ce", "val/neutral_perplexity"} <= set(record["metrics"])
    hp = yaml.safe_load((run / "config.yaml").read_text())
    assert hp["model"]["head_gates"]["scope"] == "tasks"  # the step raises without counterfactual task batches
    assert not any(isinstance(m, GatedOutputProjection) for m in load_open_model(read_run(run)).modules())


def test_consistency_term_matches_plain_and_scoped_task_logits_once_gates_are_fixed(tiny_folder):
    """HeadConsistency: the task items' centred logits with every head its own input and with closed heads
    counterfactual are matched; the term is zero with every gate open and absent before the gates are fixed."""
    from modular.gating.losses import response_logit_mse
    from modular.models.head_gates import head_gate_scope

    model_dir = tiny_folder("llama")
    dm = _data(model_dir, tasks=["greater_than"], counterfactuals=True)  # one task: its rows are the group
    dm.setup("fit")
    batch = _counterfactual_batch(dm, "task:greater_than")
    module = _sparse(model_dir, scope="tasks", head=HeadConsistency(2.0), freeze_step=5).eval()
    with torch.no_grad():
        assert "tasks/consistency_mse" not in module.model_step(batch, train=False)[1]  # step 0 < head_gates.freeze_step
        _fix_gates_from(module, 0)
        _, open_terms = module.model_step(batch, train=False)
        for g in head_gate_modules(module.hf_model):
            g.fixed.fill_(0.0)  # every head closed on the tasks
        total, terms = module.model_step(batch, train=False)
    assert open_terms["tasks/consistency_mse"].abs() < 1e-9  # every gate open: the scoped run is the plain run
    assert terms["tasks/consistency_mse"] > 1e-6
    rest = sum(v for k, v in terms.items() if k.endswith(("_kl", "_ce")))
    torch.testing.assert_close(total, rest + 2.0 * terms["tasks/consistency_mse"], atol=1e-5, rtol=1e-5)
    task = batch["task:greater_than"]
    with torch.no_grad(), head_gate_scope(module.hf_model, active=False):
        plain = module.model(input_ids=task["open"]["input_ids"], attention_mask=task["open"]["attention_mask"]).logits
    # the term compares the scoped run with the plain run (every head its own input, not a closed head removed)
    scoped = _scoped_run(module, task)
    assert response_logit_mse(scoped, plain, task["open"]["labels"]) > 1e-6
    torch.testing.assert_close(terms["tasks/consistency_mse"], response_logit_mse(scoped, plain, task["open"]["labels"]),
                               atol=1e-6, rtol=1e-4)
    with pytest.raises(ModularError, match="head_gates.scope 'tasks'"):
        _sparse(model_dir, head=HeadConsistency(1.0))


def test_margin_term_matches_plain_and_scoped_answer_margins_once_gates_are_fixed(tiny_folder):
    """HeadMargin: logit(answer) - logit(wrong) at the first response position, plain vs scoped."""
    from modular.gating.losses import response_margin_mse
    from modular.models.head_gates import head_gate_scope

    model_dir = tiny_folder("llama")
    dm = _data(model_dir, tasks=["ioi"], counterfactuals=True)  # one task: its rows are the group
    dm.setup("fit")
    batch = _counterfactual_batch(dm, "task:ioi")
    task = batch["task:ioi"]
    wrong = [dm.tokenizer(r["wrong"], add_special_tokens=False)["input_ids"][0] for r in dm.task_data["ioi"]["train"]]
    assert set(task["open"]["wrong_ids"].tolist()) <= set(wrong) and (task["open"]["wrong_ids"] >= 0).all()
    # the tiny tokenizer starts every name with the same " " token, which the term skips: compete with another token
    labels = task["open"]["labels"]
    answer = labels[torch.arange(len(labels)), (labels[:, 1:] != -100).float().argmax(1) + 1]
    task["open"]["wrong_ids"] = (answer + 1) % json.loads((model_dir / "config.json").read_text())["vocab_size"]
    module = _sparse(model_dir, scope="tasks", head=HeadMargin(3.0), freeze_step=5).eval()
    with torch.no_grad():
        assert "tasks/consistency_margin" not in module.model_step(batch, train=False)[1]  # before the freeze
        _fix_gates_from(module, 0)
        _, open_terms = module.model_step(batch, train=False)
        for g in head_gate_modules(module.hf_model):
            g.fixed.fill_(0.0)
        total, terms = module.model_step(batch, train=False)
        with head_gate_scope(module.hf_model, active=False):
            plain = module.model(input_ids=task["open"]["input_ids"], attention_mask=task["open"]["attention_mask"]).logits
    scoped = _scoped_run(module, task)
    assert "tasks/consistency_mse" not in terms  # only the margin term is weighted
    assert open_terms["tasks/consistency_margin"].abs() < 1e-9
    expected = response_margin_mse(scoped, plain, task["open"]["labels"], task["open"]["wrong_ids"])
    assert expected > 1e-6
    torch.testing.assert_close(terms["tasks/consistency_margin"], expected, atol=1e-6, rtol=1e-4)
    rest = sum(v for k, v in terms.items() if k.endswith(("_kl", "_ce")))
    torch.testing.assert_close(total, rest + 3.0 * expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ModularError, match="HeadMargin needs head_gates.scope 'tasks'"):
        _sparse(model_dir, head=HeadMargin(1.0))


def test_interchange_term_matches_the_counterfactual_run_with_open_heads_swapped_once_gates_are_fixed(tiny_folder):
    """HeadInterchange: with open heads counterfactual and closed heads their own input, the task rows
    must predict the plain counterfactual run's first response token; rows without a counterfactual are skipped."""
    from modular.gating.losses import first_token_kl
    from modular.models.head_gates import head_gate_scope

    model_dir = tiny_folder("llama")
    dm = _data(model_dir, tasks=["ioi"], counterfactuals=True)
    dm.setup("fit")
    batch = _counterfactual_batch(dm, "task:ioi")
    task = batch["task:ioi"]
    module = _sparse(model_dir, scope="tasks", head=HeadInterchange(4.0), freeze_step=5).eval()
    closed = [(0, 1), (1, 0)]
    with torch.no_grad():
        assert "tasks/interchange_kl" not in module.model_step(batch, train=False)[1]  # before the freeze
        _fix_gates_from(module, 0)
        for layer, h in closed:
            head_gate_modules(module.hf_model)[layer].fixed[h] = 0.0
        total, terms = module.model_step(batch, train=False)
        cf_inputs, _ = _counterfactual_run(module, task)
        adapter = ArchitectureAdapter(module.hf_model)
        everything = [(i, h) for i in range(adapter.n_layers) for h in range(adapter.n_heads)]
        from modular.hooks import replace_heads

        with head_gate_scope(module.hf_model, active=False), \
                replace_heads(adapter, [hh for hh in everything if hh not in closed], cf_inputs):
            swapped = module.model(input_ids=task["open"]["input_ids"],
                                   attention_mask=task["open"]["attention_mask"]).logits
        with head_gate_scope(module.hf_model, active=False):
            cf = module.model(input_ids=task["counterfactual"]["input_ids"],
                              attention_mask=task["counterfactual"]["attention_mask"]).logits
    labels = task["open"]["labels"]
    keep = (task["counterfactual"]["input_ids"] != task["open"]["input_ids"]).any(1)
    idx = (labels[:, 1:] != -100).float().argmax(1)
    ref = torch.log_softmax(cf[torch.arange(len(idx)), idx], -1)
    expected = first_token_kl(swapped[keep], labels[keep], ref[keep])
    assert expected > 1e-6
    torch.testing.assert_close(terms["tasks/interchange_kl"], expected, atol=1e-6, rtol=1e-4)
    rest = sum(v for k, v in terms.items() if k.endswith(("_kl", "_ce")) and k != "tasks/interchange_kl")
    torch.testing.assert_close(total, rest + 4.0 * expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ModularError, match="HeadInterchange needs head_gates.scope 'tasks'"):
        _sparse(model_dir, head=HeadInterchange(1.0))


def test_attribution_term_sums_the_closed_heads_attribution_estimates_and_trains_them_down(tiny_folder):
    """ClosedAttribution: the closed heads' share of the summed |gradient · (counterfactual − own input)| on
    the answer margin, averaged over rows; differentiable in the weights; absent without gradients."""
    from modular.gating.losses import response_margins
    from modular.hooks import capture_head_inputs
    from modular.models.head_gates import head_gate_scope

    model_dir = tiny_folder("llama")
    dm = _data(model_dir, tasks=["ioi"], counterfactuals=True)
    dm.setup("fit")
    batch = _counterfactual_batch(dm, "task:ioi")
    task = batch["task:ioi"]
    labels = task["open"]["labels"]
    answer = labels[torch.arange(len(labels)), (labels[:, 1:] != -100).float().argmax(1) + 1]
    task["open"]["wrong_ids"] = (answer + 1) % json.loads((model_dir / "config.json").read_text())["vocab_size"]
    module = _sparse(model_dir, scope="tasks", head=ClosedAttribution(2.0), freeze_step=0).eval()
    closed = [(0, 1), (1, 0)]
    for layer, h in closed:
        head_gate_modules(module.hf_model)[layer].fixed[h] = 0.0
    with torch.no_grad():
        assert "tasks/closed_attribution" not in module.model_step(batch, train=False)[1]  # no gradients
    total, terms = module.model_step(batch, train=True)
    term = terms["tasks/closed_attribution"]
    # by hand: the plain run, the margin's gradient at every head input, times the counterfactual difference
    cf_inputs, _ = _counterfactual_run(module, task)
    with head_gate_scope(module.hf_model, active=False), capture_head_inputs(module.adapter, detach=False) as z:
        logits = module.model(input_ids=task["open"]["input_ids"], attention_mask=task["open"]["attention_mask"]).logits
    margins, keep = response_margins(logits, labels, task["open"]["wrong_ids"])
    keep = keep & (task["counterfactual"]["input_ids"] != task["open"]["input_ids"]).any(1)
    grads = torch.autograd.grad(margins[keep].sum(), [z[i] for i in sorted(z)])
    estimates = [(g * (cf_inputs[i] - z[i])).sum(dim=(1, 3)).abs() for i, g in zip(sorted(z), grads)]
    everything = sum(e.sum(-1) for e in estimates)
    expected = (sum(estimates[layer][:, h] for layer, h in closed) / everything)[keep].mean()
    assert 1e-6 < expected < 1
    torch.testing.assert_close(term.detach(), expected.detach(), atol=1e-6, rtol=1e-4)
    rest = sum(v for k, v in terms.items() if k.endswith(("_kl", "_ce")))
    torch.testing.assert_close(total.detach(), (rest + 2.0 * term).detach(), atol=1e-5, rtol=1e-5)
    # the penalty reaches the weights through the gradient itself (a second backward pass)
    params = [p for p in module.model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in torch.autograd.grad(term, params, allow_unused=True))
    with pytest.raises(ModularError, match="ClosedAttribution needs head_gates.scope 'tasks'"):
        _sparse(model_dir, head=ClosedAttribution(1.0))
