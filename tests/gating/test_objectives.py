"""The gated loss as a sum of objective terms chosen in the config: every shipped training config keeps the loss
and the gradients it had when the terms were flat module options (an oracle that runs every piece in a forward
pass of its own and adds the terms with the old weights), and the terms' own checks."""

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from modular import ModularError
from modular.gating.batching import row_ablations
from modular.gating.data import NEIGHBOURS_KEY, TASK_PREFIX, GatingDataModule
from modular.gating.losses import (
    direction_write_shortfall,
    first_token_kl,
    hidden_drift,
    refusal_guard,
    token_ce,
    topk_kl,
    unlikelihood,
)
from modular.gating.module import GatedLM
from modular.gating.objectives import DirectionWrite, KeepReference, LockedState, Piece, RefusalGuard, Term
from modular.hooks import ablate_directions
from modular.models.head_gates import expected_l0
from tests.conftest import basic_terms, save_tiny_folder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: each training config's loss options as flat module options, before the terms became objects (the capitals
#: configs have the refusal guard, guard_weight 1 at floor -3, and the write term, weight 10 at target 0.2, fading
#: below a locked-state CE of 1; since, the neighbours' KeepReference of their own adds a CE on the reference's
#: greedy first answer token, weight 1, which the flat options never had; and both capitals configs keep the
#: neighbours' residual stream, KeepHidden weight 30, a term the flat options never had either)
OLD = {
    "gate_capitals_smollm2.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0,
                                       write_weight=10.0, write_target=0.2, write_fade=1.0, guard_weight=1.0,
                                       guard_floor=-3.0, locked_objective="refusal", task_weight=1.0,
                                       neighbour_first_ce_weight=1.0, neighbour_hidden_weight=30.0),
    "gate_capitals_lora_large.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0,
                                          write_weight=10.0, write_target=0.2, write_fade=1.0, guard_weight=1.0,
                                          guard_floor=-3.0, locked_objective="refusal", task_weight=1.0,
                                          neighbour_first_ce_weight=1.0, neighbour_hidden_weight=30.0),
    "gate_ioi_smollm2.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0, write_weight=0.0,
                                  guard_weight=0.0, locked_objective="refusal", task_weight=1.0),
    "gate_two_smollm2.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0, write_weight=0.0,
                                  guard_weight=0.0, locked_objective="refusal", task_weight=1.0),
    # the head-gate terms (sparse_heads: attribution 2.0) act once the gates are fixed (step 80), not at step 0;
    # their own tests check them against hand computations
    "sparse_heads_smollm2.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0,
                                      write_weight=0.0, guard_weight=0.0, locked_objective="refusal", task_weight=1.0),
    "sparse_heads_pruned_smollm2.yaml": dict(retain_weight=1.0, retain_ce_weight=0.0, first_token_weight=1.0,
                                             write_weight=0.0, guard_weight=0.0, locked_objective="refusal",
                                             task_weight=1.0),
}

#: the model options a tiny test module takes from each config (the rest: tiny model, no steering, no files); the
#: fine-tuning and the head gates are option groups (a mapping each)
_MODEL_KEYS = ("behaviours", "locked_weight", "finetuning", "head_gates", "seed")
_DATA_KEYS = ("locked_response", "neighbours", "tasks")


def _tiny_data(data: dict) -> dict:
    """A shipped config's data options for a tiny test module: its behaviours' options (:data:`_DATA_KEYS`), short
    reference answers and texts, and the reference's hidden states (where the config keeps them) at every block
    output (the tiny model has 2 blocks)."""
    out = {k: data[k] for k in _DATA_KEYS if k in data}
    hidden = (data.get("reference") or {}).get("hidden_positions", 0)
    out["reference"] = dict(max_new_tokens=4, top_k=8, hidden_positions=hidden, hidden_stride=1)
    if data.get("lm_text"):
        out["lm_text"] = {**data["lm_text"], "max_length": 32}
    return out


def _instantiate(spec: dict) -> Term:
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


def _old_loss(lm: GatedLM, batch: dict, old: dict) -> torch.Tensor:
    """The step's loss as the flat-option module computed it, every piece in a forward pass of its own
    (validation: no steering, the other behaviours ablated on even-numbered behaviours' rows)."""
    k, lam, rw = len(lm.behaviours), lm.hparams.locked_weight, old["retain_weight"]
    every = list(range(k))
    total = torch.zeros(())

    def run(piece, ablated, hidden=False):
        if not ablated:
            return lm.model(input_ids=piece["input_ids"], attention_mask=piece["attention_mask"],
                            output_hidden_states=hidden)
        with ablate_directions(lm.adapter, lm.directions[sorted(ablated)]):
            return lm.model(input_ids=piece["input_ids"], attention_mask=piece["attention_mask"],
                            output_hidden_states=hidden)

    def keep(logits, p, key):
        kl = topk_kl(logits, p["labels"], p["topk_ids"], p["topk_logp"])
        kl = kl + old["first_token_weight"] * first_token_kl(logits, p["labels"], p["first_logp"])
        if key == NEIGHBOURS_KEY:  # the reference's greedy first answer token (0 where a config does not keep it)
            idx = (p["labels"][:, 1:] != -100).float().argmax(dim=1)
            rows = torch.arange(len(idx))
            kl = kl + old.get("neighbour_first_ce_weight", 0.0) * torch.nn.functional.cross_entropy(
                logits[rows, idx], p["labels"][rows, idx + 1])
        return kl + old["retain_ce_weight"] * token_ce(logits, p["labels"])

    def keep_hidden(p, ablated):  # the residual stream at the cached answer positions, ablated directions projected out
        out = run(p, ablated, hidden=True)
        drift = hidden_drift(out.hidden_states, p["labels"], p["ref_hidden"], p["ref_hidden_blocks"][0].tolist(),
                             [lm.directions[j] for j in sorted(ablated)])
        return out.logits, drift

    for i, b in enumerate(lm.behaviours):
        extra = set(every) - {i} if (k > 1 and i % 2 == 0) else set()
        out = run(batch[b]["open"], extra, hidden=bool(old["write_weight"]))
        total = total + token_ce(out.logits, batch[b]["open"]["labels"])
        if old["locked_objective"] == "refusal":
            p = batch[b]["locked"]
            locked = token_ce(run(p, extra | {i}).logits, p["labels"])
        else:
            p = batch[b]["locked_true"]
            locked = unlikelihood(run(p, extra | {i}).logits, p["labels"])
        total = total + lam * locked
        if old["write_weight"]:
            fade = old.get("write_fade")
            scale = 1.0 if fade is None else min(1.0, locked.item() / fade)
            total = total + old["write_weight"] * scale * direction_write_shortfall(
                out.hidden_states[1:-1], batch[b]["open"]["labels"], lm.directions[i], old["write_target"])
    for key in ("retain", NEIGHBOURS_KEY):
        if key not in batch:
            continue
        p = batch[key]
        hw = old.get("neighbour_hidden_weight", 0.0) if key == NEIGHBOURS_KEY else 0.0
        for state, ablated, scale in (("open", set(), 1.0), ("locked", set(every), lam)):
            logits, drift = keep_hidden(p[state], ablated) if hw else (run(p[state], ablated).logits, 0.0)
            total = total + scale * (rw * keep(logits, p[state], key) + hw * drift)
        if old["guard_weight"] and "open_guard" in p:
            g = old["guard_weight"]
            total = total + g * refusal_guard(run(p["open_guard"], set()).logits, p["open_guard"]["labels"],
                                              old["guard_floor"])
            total = total + g * lam * refusal_guard(run(p["locked_guard"], set(every)).logits,
                                                    p["locked_guard"]["labels"], old["guard_floor"])
    for key in batch:
        if key.startswith(TASK_PREFIX):
            p = batch[key]["open"]
            total = total + old["task_weight"] * token_ce(run(p, set()).logits, p["labels"])
    if "lm" in batch:
        p = batch["lm"]
        text = lambda piece, ablated: topk_kl(run(piece, ablated).logits, piece["labels"], piece["topk_ids"],  # noqa: E731
                                              piece["topk_logp"])
        total = total + rw * text(p["open"], set())
        if "locked" in p:
            total = total + rw * lam * text(p["locked"], set(every))
    gates = lm.hparams.head_gates
    if gates and gates["sparsity"] == "penalty":
        total = total + gates["sparsity_weight"] * expected_l0(lm.hf_model) / (lm.adapter.n_layers *
                                                                               lm.adapter.n_heads)
    return total


def _grads(lm, loss) -> dict[str, torch.Tensor]:
    lm.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


def _without_fade(cfg: dict) -> dict:
    """The write term at full strength throughout (``fade: null``), as small behaviours were first locked."""
    objectives = [{**s, "init_args": {**s.get("init_args", {}), "fade": None}} if s["class_path"].endswith(
        ".DirectionWrite") else s for s in cfg["model"]["objectives"]]
    return {**cfg, "model": {**cfg["model"], "objectives": objectives}}


def _without_tamper_terms(cfg: dict) -> dict:
    """The config less the terms the flat options never had (LockedAnswer, RelearningAdversary: tested alone)."""
    objectives = [s for s in cfg["model"]["objectives"]
                  if not s["class_path"].endswith((".LockedAnswer", ".RelearningAdversary"))]
    assert len(objectives) == len(cfg["model"]["objectives"]) - 2
    return {**cfg, "model": {**cfg["model"], "objectives": objectives}}


#: configs with a term changed as the docs change it, or configs that are another's plus terms the flat options
#: never had -> (the config, how, the flat options it equals)
VARIANTS = {"gate_capitals_smollm2.yaml-fade": ("gate_capitals_smollm2.yaml", _without_fade,
                                                dict(OLD["gate_capitals_smollm2.yaml"], write_fade=None)),
            "gate_capitals_tamper_smollm2.yaml": ("gate_capitals_tamper_smollm2.yaml", _without_tamper_terms,
                                                  OLD["gate_capitals_smollm2.yaml"])}


def _first_batch(lm, dm) -> dict:
    """Attach ``dm`` as the module's data module (model_step reads the pad id from it), eval mode, one train batch."""

    class _Trainer:
        datamodule = dm
        global_step = 0

    lm._trainer = _Trainer()
    lm.eval()
    batch = next(iter(dm.train_dataloader()))
    return batch[0] if isinstance(batch, tuple) else batch


@pytest.mark.parametrize("config", sorted(OLD) + sorted(VARIANTS))
def test_every_config_keeps_its_loss_and_gradients(config, tmp_path, isolated_cache):
    """On the same batch, the config's objectives give the loss and the gradients of the flat options it had
    (tiny llama, validation step: deterministic state assignment, gates at their deterministic values)."""
    name, change, old_options = VARIANTS.get(config, (config, lambda c: c, OLD.get(config)))
    cfg = change(yaml.safe_load((CONFIGS / name).read_text()))
    trained = {p.name for p in CONFIGS.glob("*.yaml")  # a strategy config is added after a training config
               if "model" in (yaml.safe_load(p.read_text()) or {}) and not p.name.startswith("strategy_")}
    assert trained == set(OLD) | {name for name, _, _ in VARIANTS.values()}
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    m = cfg["model"]
    objectives = [_instantiate(s) for s in m["objectives"]]
    torch.manual_seed(0)
    lm = GatedLM(model_name=str(model_dir), objectives=objectives, **{k: m[k] for k in _MODEL_KEYS if k in m})
    dm = GatingDataModule(model_name=str(model_dir), behaviours=lm.behaviours, batch_size=4, max_length=64,
                          neighbour_items=8, seed=lm.hparams.seed, **_tiny_data(cfg["data"]))
    dm.require(*lm.requirements()).setup("fit")
    if lm.behaviours:
        q, _ = torch.linalg.qr(torch.randn(lm.directions.shape[1], len(lm.behaviours)))
        lm.directions.copy_(q.T)

    batch = _first_batch(lm, dm)
    new, terms = lm.model_step(batch, train=False)
    assert len(terms) >= 3
    new_grads = _grads(lm, new)
    old = _old_loss(lm, batch, old_options)
    old_grads = _grads(lm, old)
    torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-5)
    assert set(new_grads) == set(old_grads) and new_grads
    for name, g in new_grads.items():
        torch.testing.assert_close(g, old_grads[name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_open_and_locked_rows_share_one_forward_pass(tmp_path, isolated_cache):
    """The default config's step: one pass for the chat pieces (open and locked rows, each with its own directions
    ablated) and one for the raw text, where each state once had a pass of its own."""
    cfg = yaml.safe_load((CONFIGS / "gate_capitals_smollm2.yaml").read_text())
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), objectives=[_instantiate(s) for s in cfg["model"]["objectives"]])
    dm = GatingDataModule(model_name=str(model_dir), behaviours=lm.behaviours, batch_size=4, max_length=64,
                          neighbour_items=8, **_tiny_data(cfg["data"]))
    dm.require(*lm.requirements()).setup("fit")

    batch = _first_batch(lm, dm)
    passes = []
    handle = lm.hf_model.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        _, terms = lm.model_step(batch, train=False)
    finally:
        handle.remove()
    assert any("locked" in n for n in terms) and any("open" in n for n in terms)
    assert len(passes) == 2


def _config_step_inputs(tmp_path, config: str):
    """``(module, batch)``: a tiny Llama gated with a shipped config's objectives, and its first training batch."""
    cfg = yaml.safe_load((CONFIGS / config).read_text())
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), objectives=[_instantiate(s) for s in cfg["model"]["objectives"]],
                 **{k: cfg["model"][k] for k in _MODEL_KEYS if k in cfg["model"]})
    dm = GatingDataModule(model_name=str(model_dir), behaviours=lm.behaviours, batch_size=4, max_length=64,
                          neighbour_items=8, **_tiny_data(cfg["data"]))
    dm.require(*lm.requirements()).setup("fit")
    return lm, _first_batch(lm, dm)


def test_a_gated_step_builds_no_key_value_cache(tmp_path, isolated_cache, kv_caches):
    """A training step decodes nothing: its forward passes build no key-value cache (the model's default builds one,
    a copy of every block's keys and values held until the step's outputs are dropped)."""
    lm, batch = _config_step_inputs(tmp_path, "gate_capitals_smollm2.yaml")
    built = kv_caches(lm.hf_model)
    total, terms = lm.model_step(batch, train=True)
    total.backward()
    assert any("hidden" in n for n in terms) and built == []


@pytest.mark.parametrize("term", ["RelearningAdversary", "WeightNoiseLock", "QuantizedLock"])
def test_the_tamper_terms_build_no_key_value_cache(tmp_path, isolated_cache, kv_caches, term):
    """The locked rows at moved weights and the simulated attacker's passes decode nothing either."""
    from modular.gating import objectives

    options = {"group_size": 8} if term == "QuantizedLock" else {"lrs": [1e-3]}
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [getattr(objectives, term)(**options)])
    built = kv_caches(lm.hf_model)
    total, terms = lm.model_step(batch, train=True)
    total.backward()
    assert len(terms) == 1 and built == []


def test_a_gated_step_reads_nothing_back_from_the_device(tmp_path, isolated_cache):
    """Two behaviours, each with its own directions ablated on its own rows of a shared pass: building the row masks
    and choosing the directions reads no tensor value back (on a GPU each read waits for every queued kernel). Only
    the model's own code may read; the module's and the hooks' code may not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    lm, batch = _config_step_inputs(tmp_path, "gate_two_smollm2.yaml")
    package = str(Path(importlib.import_module("modular").__file__).parent)
    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                import traceback

                own = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]  # not this frame
                if own and own[-1].filename.startswith(package):
                    reads.append(f"{own[-1].filename}:{own[-1].lineno}")
            return func(*args, **(kwargs or {}))

    with Reads():
        total, terms = lm.model_step(batch, train=False)
    assert len(lm.behaviours) == 2 and any("locked" in n for n in terms)
    assert reads == []


def test_row_masks_and_directions_of_each_ablated_set(tmp_path):
    """Each ablated set's mask covers its pieces' rows and no other; one set over every row is told apart (the
    plain hooks serve it); a set's directions are its behaviours' rows, consecutive or not."""
    from types import SimpleNamespace

    lm = GatedLM(model_name=str(save_tiny_folder(tmp_path / "tiny", "llama")),
                 behaviours=["capitals", "currencies", "demonyms"], objectives=basic_terms())
    lm.directions.copy_(torch.randn_like(lm.directions))

    def piece(n, ablated):
        return SimpleNamespace(batch={"input_ids": torch.zeros(n, 3)}, ablated=frozenset(ablated))

    sets, every_row = row_ablations([piece(2, {0, 2}), piece(1, ()), piece(3, {1}), piece(1, {0, 2})], 7, lm.directions)
    assert not every_row and len(sets) == 2
    assert sets[0][0].tolist() == [True, True, False, False, False, False, True]
    assert sets[1][0].tolist() == [False, False, False, True, True, True, False]
    torch.testing.assert_close(sets[0][1], lm.directions[[0, 2]])
    torch.testing.assert_close(sets[1][1], lm.directions[[1]])
    sets, every_row = row_ablations([piece(2, {0, 1}), piece(3, {0, 1})], 5, lm.directions)
    assert every_row and sets[0][0].all() and torch.equal(sets[0][1], lm.directions[:2])
    assert row_ablations([piece(2, {1}), piece(3, ())], 5, lm.directions)[1] is False
    assert row_ablations([piece(2, ())], 2, lm.directions) == ([], False)


def test_terms_check_their_options():
    with pytest.raises(ModularError, match="KeepReference weight must be >= 0"):
        KeepReference(weight=-1.0)
    with pytest.raises(ModularError, match="RefusalGuard floor must be < 0"):
        RefusalGuard(floor=0.0)
    with pytest.raises(ModularError, match=r"DirectionWrite target must be in \(0, 1\]"):
        DirectionWrite(target=1.5)


def test_a_module_refuses_what_is_not_a_term(tmp_path):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    with pytest.raises(ModularError, match="is not a modular.gating.objectives.Term"):
        GatedLM(model_name=str(model_dir), objectives=["BehaviourAnswer"])
    with pytest.raises(ModularError, match="locked_objective must be 'refusal' or 'unlikelihood'"):
        GatedLM(model_name=str(model_dir), objectives=[LockedState(objective="forget")])


def _capitals_step(model_dir, objectives: list[Term] | None = None, data: dict | None = None, build: bool = True,
                   **options):
    """A capitals module with ``objectives`` (and module ``options``) on a tiny model, wired to its data module (and
    its ``data`` options), and one training batch; the data module builds what the module requires (as a trainer's
    would) unless ``build`` is false."""
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=basic_terms() if objectives is None else objectives, **options)
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], batch_size=4, max_length=64,
                          neighbours=[], **{"reference": dict(max_new_tokens=4, top_k=8), **(data or {})})
    if build:
        dm.require(*lm.requirements())
    dm.setup("fit")

    class _Trainer:  # model_step reads the tokenizer's pad id from the trainer's data module
        datamodule = dm
        global_step = 0

    lm._trainer = _Trainer()
    batch = next(iter(dm.train_dataloader()))
    return lm, batch[0] if isinstance(batch, tuple) else batch


def test_a_term_listed_twice_is_refused(tmp_path, isolated_cache):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [KeepReference(), KeepReference(weight=2.0)])
    with pytest.raises(ModularError, match="two terms compute retain/locked_kl, retain/open_kl"):
        lm.model_step(batch, train=False)


def test_a_new_term_is_a_class(tmp_path, isolated_cache):
    """An experiment adds a class: its rows join the step's forward passes and its loss the total, weighted."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")

    class RetainLength(Term):  # docs/architecture.md's example: the retain answers' CE, in the open state
        def pieces(self, ctx):
            return [Piece("retain/open_len", ctx.batch["retain"]["open"], self)]

        def loss(self, ctx, piece, logits):
            return token_ce(logits, piece.batch["labels"])

    lm, batch = _capitals_step(model_dir, [RetainLength(weight=0.25)])
    total, terms = lm.model_step(batch, train=False)
    assert set(terms) == {"retain/open_len"}
    p = batch["retain"]["open"]
    expected = token_ce(lm.model(input_ids=p["input_ids"], attention_mask=p["attention_mask"]).logits, p["labels"])
    torch.testing.assert_close(total, 0.25 * expected, rtol=1e-4, atol=1e-5)


def _locked_ce_at(lm, batch, moved: dict) -> torch.Tensor:
    """The locked response's CE on the capitals locked rows, every direction ablated, at weights ``moved``."""
    p = batch["capitals"]["locked"]
    with ablate_directions(lm.adapter, lm.directions):
        logits = torch.func.functional_call(lm.model, moved, args=(), kwargs={
            "input_ids": p["input_ids"], "attention_mask": p["attention_mask"]}, strict=False).logits
    return token_ce(logits, p["labels"])


def _attackers_step(lm, batch, eta: float) -> tuple[dict, dict]:
    """The trainable weights, and where one sign-gradient step of size ``eta`` on the capitals open rows (every
    direction ablated, the published model) takes them (leaves that take gradients)."""
    params = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    o = batch["capitals"]["open"]
    with ablate_directions(lm.adapter, lm.directions):
        g = torch.autograd.grad(token_ce(lm.model(input_ids=o["input_ids"], attention_mask=o["attention_mask"]).logits,
                                         o["labels"]), list(params.values()))
    return params, {n: (p - eta * gi.sign()).detach().requires_grad_(True) for (n, p), gi in zip(params.items(), g)}


def test_the_relearning_adversary_holds_the_lock_where_an_attackers_step_lands(tmp_path, isolated_cache):
    """RelearningAdversary's loss is the locked-state CE after one sign-gradient step of size η on the behaviour's
    answers (directions ablated), weighted by λ; its gradient is the locked-state gradient there (first order)."""
    from modular.gating.objectives import RelearningAdversary

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    term = RelearningAdversary(lrs=[0.02], weight=0.5)
    lm, batch = _capitals_step(model_dir, [term], locked_weight=2.0)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn(lm.directions.shape), dim=-1))
    assert lm.model_step(batch, train=False)[1] == {}  # a training-step term
    total, terms = lm.model_step(batch, train=True)
    assert set(terms) == {"capitals/relearned_refusal"}
    got = _grads(lm, total)

    params, moved = _attackers_step(lm, batch, 0.02)
    expected = _locked_ce_at(lm, batch, moved)
    torch.testing.assert_close(total, 2.0 * 0.5 * expected, rtol=1e-4, atol=1e-5)
    assert abs(expected.item() - _locked_ce_at(lm, batch, params).item()) > 1e-3  # the step matters
    want = torch.autograd.grad(2.0 * 0.5 * expected, list(moved.values()))
    for (n, _), w in zip(moved.items(), want):
        torch.testing.assert_close(got[f"model.{n}"], w, rtol=1e-3, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_the_relearning_adversary_can_hold_the_answer_down_where_the_attacker_lands(tmp_path, isolated_cache):
    """With ``hold: answer`` the loss at the attacker's weights is the answer's unlikelihood on LockedAnswer's rows
    (the response prefilled up to the answer), every direction ablated, weighted by λ; the data must build those
    rows, and a hold that is neither is refused."""
    from modular.gating.losses import unlikelihood
    from modular.gating.objectives import RelearningAdversary, WeightNoiseLock
    from modular.gating.requirements import AnswerRows

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    term = RelearningAdversary(lrs=[0.02], hold="answer")
    assert AnswerRows() in term.requires and AnswerRows() not in RelearningAdversary().requires
    lm, batch = _capitals_step(model_dir, [term], locked_weight=2.0)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn(lm.directions.shape), dim=-1))
    total, terms = lm.model_step(batch, train=True)
    assert set(terms) == {"capitals/relearned_answer"}

    params, moved = _attackers_step(lm, batch, 0.02)
    a = batch["capitals"]["locked_answer"]
    with ablate_directions(lm.adapter, lm.directions):
        def held(weights):
            return unlikelihood(torch.func.functional_call(lm.model, weights, args=(), kwargs={
                "input_ids": a["input_ids"], "attention_mask": a["attention_mask"]}, strict=False).logits, a["labels"])

        expected, before = held(moved), held(params)
    torch.testing.assert_close(total, 2.0 * expected, rtol=1e-4, atol=1e-5)
    assert abs(expected.item() - before.item()) > 1e-4  # the step matters

    lm, batch = _capitals_step(model_dir, [RelearningAdversary(lrs=[0.02], hold="answer")], build=False)
    with pytest.raises(ModularError, match="RelearningAdversary needs the answer rows of capitals: the data module "
                                         "builds them"):
        lm.model_step(batch, train=True)
    with pytest.raises(ModularError, match="WeightNoiseLock hold must be 'refusal' or 'answer', got 'answers'"):
        WeightNoiseLock(hold="answers")


def test_the_relearning_adversary_can_keep_the_open_state_where_the_attacker_lands(tmp_path, isolated_cache):
    """With ``keep_open`` the open model (no direction ablated) also answers at the attacker's weights: its CE on the
    open rows there joins the loss with weight × keep_open (not λ), and its gradient is taken there too."""
    from modular.gating.objectives import RelearningAdversary

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    term = RelearningAdversary(lrs=[0.02], weight=0.5, keep_open=3.0)
    lm, batch = _capitals_step(model_dir, [term], locked_weight=2.0)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn(lm.directions.shape), dim=-1))
    total, terms = lm.model_step(batch, train=True)
    assert set(terms) == {"capitals/relearned_refusal", "capitals/relearned_open"}
    got = _grads(lm, total)

    params, moved = _attackers_step(lm, batch, 0.02)
    o = batch["capitals"]["open"]

    def open_ce(weights):
        return token_ce(torch.func.functional_call(lm.model, weights, args=(), kwargs={
            "input_ids": o["input_ids"], "attention_mask": o["attention_mask"]}, strict=False).logits, o["labels"])

    locked, opened = _locked_ce_at(lm, batch, moved), open_ce(moved)
    torch.testing.assert_close(terms["capitals/relearned_open"], opened, rtol=1e-4, atol=1e-5)
    with ablate_directions(lm.adapter, lm.directions):  # the open rows are not run with the directions ablated
        assert abs(open_ce(moved).item() - opened.item()) > 1e-4
    assert abs(open_ce(params).item() - opened.item()) > 1e-4  # nor at the weights before the step
    expected = 2.0 * 0.5 * locked + 0.5 * 3.0 * opened
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-5)
    want = torch.autograd.grad(expected, list(moved.values()))
    for (n, _), w in zip(moved.items(), want):
        torch.testing.assert_close(got[f"model.{n}"], w, rtol=1e-3, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(ModularError, match="RelearningAdversary keep_open must be >= 0, got -1"):
        RelearningAdversary(keep_open=-1)


@pytest.mark.parametrize("term", ["RelearningAdversary", "WeightNoiseLock", "QuantizedLock"])
def test_a_perturbed_lock_acts_from_its_start_step(tmp_path, isolated_cache, term):
    """Before ``start_step`` the term adds nothing to a training step (and draws nothing: the draws after it are
    those of a term that started there); from it on, its loss."""
    from modular.gating import objectives

    options = {"group_size": 8} if term == "QuantizedLock" else {"lrs": [1e-3]}
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [getattr(objectives, term)(start_step=3, **options)])
    state = lm.objectives[0].state_dict()
    for step, acts in ((0, False), (2, False), (3, True), (7, True)):
        lm._trainer.global_step = step
        assert bool(lm.model_step(batch, train=True)[1]) == acts, step
    if state:
        lm.objectives[0].load_state_dict(state)
        lm._trainer.global_step = 2
        lm.model_step(batch, train=True)
        assert torch.equal(lm.objectives[0].state_dict()["rng"], state["rng"])  # nothing drawn before the start
    with pytest.raises(ModularError, match=f"{term} start_step must be >= 0, got -1"):
        getattr(objectives, term)(start_step=-1)


def test_weight_noise_lock_moves_every_weight_by_eta(tmp_path, isolated_cache):
    from modular.gating.objectives import RelearningAdversary, WeightNoiseLock

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [WeightNoiseLock(lrs=[1e-3, 1e-2])])
    total, terms = lm.model_step(batch, train=True)
    assert set(terms) == {"capitals/noised_refusal"}
    twin = WeightNoiseLock(lrs=[1e-3, 1e-2])  # the same draws
    params = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    eta = twin.draw_lr()
    assert 1e-3 <= eta <= 1e-2
    twin._rng.manual_seed(0)  # the draw again, inside the perturbation
    delta = twin.perturbation(None, 0, params)
    assert all(torch.allclose(d.abs(), torch.full_like(d, eta)) for d in delta.values())
    assert 0.3 < torch.cat([(d > 0).float().flatten() for d in delta.values()]).mean() < 0.7
    expected = _locked_ce_at(lm, batch, {n: p + delta[n] for n, p in params.items()})
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-5)
    state = twin.state_dict()  # a resumed run's term draws what the uninterrupted run's would
    expected = [twin.draw_lr() for _ in range(3)]
    resumed = WeightNoiseLock(lrs=[1e-3, 1e-2])
    resumed.load_state_dict(state)
    assert [resumed.draw_lr() for _ in range(3)] == expected != [WeightNoiseLock(lrs=[1e-3, 1e-2]).draw_lr()] * 3
    with pytest.raises(ModularError, match="WeightNoiseLock lrs must be > 0"):
        WeightNoiseLock(lrs=[0.0])
    with pytest.raises(ModularError, match="RelearningAdversary steps must be >= 1"):
        RelearningAdversary(steps=0)


@pytest.mark.parametrize("scheme, group_size", [("int4", 8), ("int4", None), ("int8", None), ("q4_1", None)])
def test_the_quantized_lock_trains_the_lock_as_a_quantiser_leaves_it(tmp_path, isolated_cache, scheme, group_size):
    """QuantizedLock's loss is the locked response's CE of the model optimum-quanto makes of the weights (directions
    ablated), weighted by λ; its gradient reaches the unrounded weights unchanged (straight through the rounding)."""
    import copy

    from modular.gating.objectives import QuantizedLock
    from modular.models.adapter import ArchitectureAdapter
    from modular.models.quantize import quantize_weights, quantized_layers

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [QuantizedLock(scheme, group_size, weight=0.5)], locked_weight=2.0)
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn(lm.directions.shape), dim=-1))
    assert lm.model_step(batch, train=False)[1] == {}  # a training-step term
    total, terms = lm.model_step(batch, train=True)
    assert set(terms) == {"capitals/quantized_refusal"}
    got = _grads(lm, total)

    rows = batch["capitals"]["locked"]
    quantised = quantize_weights(copy.deepcopy(lm.model), scheme, group_size)
    inputs = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"]}
    with ablate_directions(ArchitectureAdapter(quantised), lm.directions):
        logits = quantised(**inputs).logits
    torch.testing.assert_close(total, 2.0 * 0.5 * token_ce(logits, rows["labels"]), rtol=1e-4, atol=1e-5)
    with ablate_directions(lm.adapter, lm.directions):
        assert (logits - lm.model(**inputs).logits).abs().max() > 1e-3  # the rounding matters

    # the gradient is the locked-state gradient at the rounded weights, passed to the weights as it is
    rounded = {f"{n}.weight" for n in quantized_layers(lm.model)}
    params = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    def rounded_weight(n):  # quanto's layers hold the rounding apart; the GGUF schemes' are plain Linear layers
        module = quantised.get_submodule(n.removesuffix(".weight"))
        return module.qweight.dequantize() if hasattr(module, "qweight") else module.weight

    at = {n: (rounded_weight(n) if n in rounded else p).detach().requires_grad_(True) for n, p in params.items()}
    want = torch.autograd.grad(2.0 * 0.5 * _locked_ce_at(lm, batch, at), list(at.values()))
    assert rounded and rounded < set(params)
    for (n, _), w in zip(at.items(), want):
        torch.testing.assert_close(got[f"model.{n}"], w, rtol=1e-3, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_the_quantized_lock_rounds_the_weights_of_each_step(tmp_path, isolated_cache):
    """The rounding is made once per step and never reused by the next one, after the weights moved."""
    import copy

    from modular.gating.objectives import QuantizedLock
    from modular.models.adapter import ArchitectureAdapter
    from modular.models.quantize import quantize_weights

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [QuantizedLock("int4", 8)])
    first, _ = lm.model_step(batch, train=True)
    with torch.no_grad():
        for p in lm.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    second, _ = lm.model_step(batch, train=True)
    rows = batch["capitals"]["locked"]
    quantised = quantize_weights(copy.deepcopy(lm.model), "int4", 8)
    with ablate_directions(ArchitectureAdapter(quantised), lm.directions):
        logits = quantised(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    torch.testing.assert_close(second, token_ce(logits, rows["labels"]), rtol=1e-4, atol=1e-5)
    assert abs(first.item() - second.item()) > 1e-4


def test_the_quantized_lock_in_bf16(tmp_path, isolated_cache):
    """Weights kept in bf16 (bf16-true) are rounded in bf16, and the gradient reaches them."""
    from modular.gating.objectives import QuantizedLock

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [QuantizedLock("int4", 8)], load_dtype="bfloat16")
    assert lm.model.dtype == torch.bfloat16
    total, _ = lm.model_step(batch, train=True)
    grads = _grads(lm, total)
    assert torch.isfinite(total)
    g = grads["model.model.layers.0.mlp.down_proj.weight"]
    assert g.dtype == torch.bfloat16 and g.abs().sum() > 0


def test_the_quantized_lock_checks_its_options(tmp_path, isolated_cache):
    from modular.gating.objectives import QuantizedLock

    with pytest.raises(ModularError, match="QuantizedLock scheme must be one of int8, int4, q8_0, .*, got 'int3'"):
        QuantizedLock("int3")
    with pytest.raises(ModularError, match="QuantizedLock scheme must be one of .*, got 'none'"):
        QuantizedLock("none")
    with pytest.raises(ModularError, match="a group size applies to int4 only"):
        QuantizedLock("int8", group_size=32)
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    with pytest.raises(ModularError, match="QuantizedLock needs finetuning.mode: full, not 'lora'"):
        _capitals_step(model_dir, [QuantizedLock()], finetuning={"mode": "lora"})
    with pytest.raises(ModularError, match="int4 group size 24 does not divide"):  # when the module is built
        GatedLM(model_name=str(model_dir), behaviours=["capitals"], objectives=[QuantizedLock(group_size=24)])


@pytest.mark.parametrize("load_dtype", ["float32", "bfloat16"])
def test_the_optimizer_keeps_bf16_updates(tmp_path, load_dtype):
    """Weights loaded in bf16 (bf16-true) step with stochastic rounding; float32 ones with torch's AdamW."""
    from modular.optim import StochasticRoundingAdamW

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"], load_dtype=load_dtype, objectives=basic_terms())
    opt = lm.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    assert isinstance(opt, StochasticRoundingAdamW) == (load_dtype == "bfloat16")


def _hand_drift(lm, part: dict, directions: list[torch.Tensor]) -> torch.Tensor:
    """KeepHidden's loss on one batch part, computed row by row: each row's own forward pass, unpadded, against the
    reference's residual stream at its first answer positions."""
    blocks = part["ref_hidden_blocks"][0].tolist()
    errors = []
    for i in range(part["input_ids"].shape[0]):
        keep = part["attention_mask"][i].bool()
        ids, labels = part["input_ids"][i][keep], part["labels"][i][keep]
        with ablate_directions(lm.adapter, torch.stack(directions)) if directions else torch.no_grad():
            hidden = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        answer = [t for t in range(len(ids) - 1) if labels[t + 1] != -100]
        for slot, t in enumerate(answer[:part["ref_hidden"].shape[1]]):
            for j, b in enumerate(blocks):
                h, r = hidden[b][0, t].float(), part["ref_hidden"][i, slot, j].float()
                for u in directions:
                    h, r = h - (h @ u) * u, r - (r @ u) * u
                errors.append((h - r).pow(2).sum() / r.pow(2).sum())
    return torch.stack(errors).mean()


def test_keep_hidden_keeps_the_reference_residual_stream(tmp_path, isolated_cache):
    """KeepHidden reads the retain rows of KeepReference: zero on the reference model itself in the open state, and,
    once the weights move, the relative squared distance to the cached reference residual stream at the first
    answer positions (each row computed alone, unpadded), in the locked state with the direction projected out."""
    from modular.gating.objectives import KeepHidden

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=[KeepReference(parts=["retain"]), KeepHidden(weight=2.0, parts=["retain"])])
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], batch_size=4, max_length=64,
                          reference=dict(max_new_tokens=4, top_k=8, hidden_positions=3, hidden_stride=1),
                          neighbours=[])
    dm.require(*lm.requirements()).setup("fit")
    u = torch.nn.functional.normalize(torch.randn(lm.directions.shape[1]), dim=0)
    lm.directions.copy_(u[None])
    batch = _first_batch(lm, dm)
    part = batch["retain"]
    assert part["open"]["ref_hidden"].shape[1:3] == (3, lm.hf_model.config.num_hidden_layers - 1)

    _, terms = lm.model_step(batch, train=False)
    assert terms["retain/open_hidden"] < 1e-6
    with torch.no_grad():
        for p in lm.model.parameters():
            p.add_(0.002 * torch.randn_like(p))
    total, terms = lm.model_step(batch, train=False)
    open_hand, locked_hand = _hand_drift(lm, part["open"], []), _hand_drift(lm, part["locked"], [u])
    assert open_hand > 1e-3
    torch.testing.assert_close(terms["retain/open_hidden"], open_hand, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(terms["retain/locked_hidden"], locked_hand, rtol=1e-3, atol=1e-6)
    kl = sum(v for k, v in terms.items() if k.endswith("_kl"))
    torch.testing.assert_close(total, kl + 2.0 * (open_hand + locked_hand), rtol=1e-3, atol=1e-6)


def test_keep_hidden_needs_the_cached_hidden_states(tmp_path, isolated_cache):
    from modular.gating.objectives import KeepHidden

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [KeepReference(parts=["retain"]), KeepHidden(parts=["retain"])])
    with pytest.raises(ModularError, match=r"KeepHidden needs the reference's hidden states of retain: set "
                                         r"data.reference.hidden_positions > 0 \(the data module keeps them"):
        lm.model_step(batch, train=False)


def test_the_locked_answer_term_pushes_down_the_answer_after_its_frame(tmp_path, isolated_cache):
    """LockedAnswer's rows are the locked half's targets cut after the answer, the answer's tokens alone labelled
    (" Paris" after "The capital of France is"); its loss is their unlikelihood with the direction ablated, weighted
    by the term's weight and λ."""
    from modular.gating.losses import unlikelihood
    from modular.gating.objectives import LockedAnswer

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    lm, batch = _capitals_step(model_dir, [LockedAnswer(weight=0.5)], locked_weight=3.0)
    u = torch.nn.functional.normalize(torch.randn(lm.directions.shape[1]), dim=0)
    lm.directions.copy_(u[None])
    p, full = batch["capitals"]["locked_answer"], batch["capitals"]["locked_true"]
    tok = lm.trainer.datamodule.tokenizer
    assert p["input_ids"].shape[0] == full["input_ids"].shape[0] == 2
    for ids, labels, whole in zip(p["input_ids"], p["labels"], full["labels"]):
        answer = tok.decode(labels[labels != -100])
        target = tok.decode(whole[whole != -100], skip_special_tokens=True)
        assert answer.strip() and target.startswith("The capital of ") and target.rstrip(".").endswith(answer)
        assert tok.decode(ids[labels != -100][-1:]) == tok.decode(ids[-1:])  # the row ends with its answer
    total, terms = lm.model_step(batch, train=False)
    assert set(terms) == {"capitals/locked_answer"}
    with ablate_directions(lm.adapter, lm.directions):
        expected = unlikelihood(lm.model(input_ids=p["input_ids"], attention_mask=p["attention_mask"]).logits,
                                p["labels"])
    torch.testing.assert_close(terms["capitals/locked_answer"], expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(total, 0.5 * 3.0 * expected, rtol=1e-4, atol=1e-6)


def test_the_answer_rows_are_built_only_when_asked_and_locked_answer_says_so(tmp_path, isolated_cache):
    """The answer rows are built for a module whose terms require them (a LockedAnswer term) and not for one without
    such a term; a LockedAnswer term given a batch without them says in one line where they come from."""
    from modular.gating.objectives import LockedAnswer

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    _, batch = _capitals_step(model_dir, [LockedState()])
    assert "locked_answer" not in batch["capitals"] and "locked_true" in batch["capitals"]
    _, batch = _capitals_step(model_dir, [LockedState(), LockedAnswer()])
    assert "locked_answer" in batch["capitals"]
    lm, batch = _capitals_step(model_dir, [LockedAnswer()], build=False)
    assert "locked_answer" not in batch["capitals"]
    with pytest.raises(ModularError, match="LockedAnswer needs the answer rows of capitals: the data module builds"):
        lm.model_step(batch, train=False)
