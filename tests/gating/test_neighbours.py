"""Neighbour behaviours in training (kept like retain data, in both states) and the lock target of the validation
callback."""

import json

import pytest
import torch

from modular import ModularError
from modular.gating.callbacks import LockMetricsCallback
from modular.gating.data import NEIGHBOURS_KEY, GatingDataModule, neighbour_data, neighbour_specs
from modular.gating.module import GatedLM
from modular.gating.objectives import (
    BehaviourAnswer,
    DirectionWrite,
    KeepHidden,
    KeepReference,
    LMText,
    LockedState,
    RefusalGuard,
)
from modular.gating.requirements import ReferenceHidden
from tests.conftest import basic_terms, save_tiny_folder


def test_neighbour_specs():
    assert neighbour_specs("auto", ["capitals"]) == {"continents": "continents", "languages": "languages"}
    # a user behaviour brings none: the far guards are kept instead
    assert neighbour_specs("auto", ["mine"]) == {g: g for g in ("capitals", "arithmetic", "commonsense", "ioi")}
    assert neighbour_specs(None, ["capitals"]) == {} and neighbour_specs([], ["capitals"]) == {}
    assert neighbour_specs(["near=data/x.jsonl", "currencies"], ["capitals"]) == {
        "near": "near=data/x.jsonl", "currencies": "currencies"}
    with pytest.raises(ModularError, match="must be 'auto' or a list"):
        neighbour_specs("all", ["capitals"])
    with pytest.raises(ModularError, match="names gated behaviours: capitals"):
        neighbour_specs(["capitals"], ["capitals"])


def test_neighbour_data_is_cut_evenly_and_needs_train_items():
    from modular.data import load_behaviour

    data = load_behaviour("continents")
    cut = neighbour_data("continents", data, limit=20, seed=0)
    assert len(cut["train"]) == 20 and len(cut["test"]) == len(data["test"])
    assert set(cut["train"]["prompt"]) < set(data["train"]["prompt"])
    assert cut["train"]["prompt"] != data["train"]["prompt"][:20]  # a sample, not the first items
    assert neighbour_data("continents", data, limit=20, seed=0)["train"]["prompt"] == cut["train"]["prompt"]
    empty = data.map(lambda r: r).filter(lambda r: False)
    with pytest.raises(ModularError, match="neighbour 'x' has no train items"):
        neighbour_data("x", empty)


@pytest.fixture
def tiny_dm(tmp_path, isolated_cache):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    near = tmp_path / "near.jsonl"
    near.write_text("".join(json.dumps({"prompt": f"Say the word number {i}.", "target": f"word {i}",
                                        "split": "train" if i < 6 else "validation"}) + "\n" for i in range(8)))
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=["continents", str(near)],
                          neighbour_items=10, batch_size=4, reference=dict(max_new_tokens=3), max_length=64)
    dm.setup("fit")
    return dm, model_dir


def test_neighbour_batches_carry_reference_answers_in_both_states(tiny_dm):
    dm, _ = tiny_dm
    assert dm.neighbour_specs == {"continents": "continents", "near": str(dm.neighbour_specs["near"])}
    assert len(dm.neighbour_rows["train"]) == 10 + 6 and len(dm.neighbour_rows["validation"]) == 26 + 2
    batch = next(iter(dm.train_dataloader()))[0]
    part = batch[NEIGHBOURS_KEY]
    assert part["open"]["input_ids"].shape[0] == 2 and part["locked"]["input_ids"].shape[0] == 2
    for half in ("open", "locked"):  # reference top-k at every answer position: kept by the retain KL
        labels = part[half]["labels"][:, 1:]
        assert (labels != -100).any()
        assert (part[half]["topk_logp"][labels != -100] != 0).any(dim=-1).all()
        assert part[half]["first_logp"].shape[-1] > 1


def _pieces(lm, batch, kind) -> dict:
    """{log name: ablated set} of the pieces a term of type ``kind`` adds to a training step."""
    ctx = lm._context(batch, train=True)
    return {p.name: p.ablated for t in lm.objectives if isinstance(t, kind) for p in t.pieces(ctx)}


def test_neighbours_are_trained_in_both_states_with_the_retain_weight(tiny_dm):

    dm, model_dir = tiny_dm
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=[BehaviourAnswer(), LockedState(), KeepReference(weight=0.5), LMText(weight=0.5)])
    batch = next(iter(dm.train_dataloader()))[0]
    pieces = _pieces(lm, batch, KeepReference)
    assert pieces["neighbours/open_kl"] == frozenset() and pieces["neighbours/locked_kl"] == frozenset({0})
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))

    class _Trainer:  # model_step reads the tokenizer's pad id from the trainer's data module
        datamodule = dm

    lm._trainer = _Trainer()
    total, terms = lm.model_step(batch, train=True)
    assert terms["neighbours/open_kl"] > 0 and terms["neighbours/locked_kl"] > 0
    without = {k: v for k, v in batch.items() if k != NEIGHBOURS_KEY}
    total_without, _ = lm.model_step(without, train=True)
    expected = 0.5 * (terms["neighbours/open_kl"] + lm.hparams.locked_weight * terms["neighbours/locked_kl"])
    assert torch.allclose(total - total_without, expected, atol=1e-5)


def test_neighbours_can_keep_the_reference_first_answer_token_apart_from_retain(tiny_dm):
    """Two KeepReference terms, one per part: the neighbours' with a CE on the reference's greedy first token, which
    adds exactly that CE (in both states) to the neighbours' pieces and leaves the retain pieces as they were."""
    from modular.gating.losses import first_token_ce

    dm, model_dir = tiny_dm
    batch = next(iter(dm.train_dataloader()))[0]
    terms = {}
    for ce in (0.0, 2.0):
        lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                     objectives=[KeepReference(parts=["retain"]),
                                 KeepReference(parts=[NEIGHBOURS_KEY], first_token_ce_weight=ce)])
        torch.manual_seed(0)
        lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))

        class _Trainer:  # model_step reads the tokenizer's pad id from the trainer's data module
            datamodule = dm

        lm._trainer = _Trainer()
        terms[ce] = lm.model_step(batch, train=False)[1]
    assert set(terms[2.0]) == {"retain/open_kl", "retain/locked_kl", "neighbours/open_kl", "neighbours/locked_kl"}
    for name in ("retain/open_kl", "retain/locked_kl"):
        assert torch.allclose(terms[2.0][name], terms[0.0][name])
    part = batch[NEIGHBOURS_KEY]["open"]
    logits = lm.model(input_ids=part["input_ids"], attention_mask=part["attention_mask"]).logits
    ce = first_token_ce(logits, part["labels"])
    assert ce > 0
    assert torch.allclose(terms[2.0]["neighbours/open_kl"] - terms[0.0]["neighbours/open_kl"], 2.0 * ce, atol=1e-4)
    assert terms[2.0]["neighbours/locked_kl"] > terms[0.0]["neighbours/locked_kl"]
    with pytest.raises(ModularError, match="first_token_ce_weight must be >= 0"):
        KeepReference(first_token_ce_weight=-1.0)


def test_the_write_term_carries_the_direction_into_the_open_answers(tiny_dm):
    """DirectionWrite: a term per gated behaviour, weighted by its weight; minimising it makes the open-state
    residual carry the direction at the response positions."""

    dm, model_dir = tiny_dm
    torch.manual_seed(0)
    write = DirectionWrite(weight=2.0, target=0.3)
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=[*basic_terms(), write])
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))

    class _Trainer:
        datamodule = dm

    lm._trainer = _Trainer()
    batch = next(iter(dm.train_dataloader()))[0]
    total, terms = lm.model_step(batch, train=True)
    before = terms["capitals/open_write"]
    assert 0.5 < before.item() <= 1.5  # a random direction is barely carried by the untrained model
    write.weight = 0.0
    assert torch.allclose(total - lm.model_step(batch, train=True)[0], 2.0 * before, atol=1e-5)
    write.weight = 2.0
    opt = torch.optim.Adam(lm.hf_model.parameters(), lr=1e-2)
    for _ in range(15):
        opt.zero_grad()
        lm.model_step(batch, train=True)[1]["capitals/open_write"].backward()
        opt.step()
    assert lm.model_step(batch, train=True)[1]["capitals/open_write"].item() < 0.5 * before.item()
    off = GatedLM(model_name=str(model_dir), behaviours=["capitals"], objectives=basic_terms())
    off._trainer = _Trainer()
    assert not any(k.endswith("/open_write") for k in off.model_step(batch, train=True)[1])


def test_the_write_term_fades_as_the_locked_response_is_learned(tiny_dm):
    """DirectionWrite(fade=F): the shortfall scaled by min(1, the behaviour's locked-state loss / F) of the same
    step, the scale without gradient; full while the locked loss is above F."""

    dm, model_dir = tiny_dm
    torch.manual_seed(0)
    full, fading = DirectionWrite(weight=1.0), DirectionWrite(weight=1.0)
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=[BehaviourAnswer(), LockedState(), full])
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))

    class _Trainer:
        datamodule = dm

    lm._trainer = _Trainer()
    batch = next(iter(dm.train_dataloader()))[0]
    terms = lm.model_step(batch, train=True)[1]
    raw, locked = terms["capitals/open_write"], terms["capitals/locked_refusal"].item()
    assert locked > 0.5 and raw.item() > 0.5  # an untrained tiny model: the locked response is far from learned
    lm.objectives[-1] = fading
    for fade, scale in [(locked / 4, 1.0), (4 * locked, 0.25)]:
        fading.fade = fade
        faded = lm.model_step(batch, train=True)[1]["capitals/open_write"]
        assert faded.item() == pytest.approx(scale * raw.item(), rel=1e-4)
    lm.zero_grad()
    faded.backward()  # the gradient is the raw shortfall's, scaled: nothing flows through the locked loss
    g_faded = [p.grad.clone() if p.grad is not None else None for p in lm.hf_model.parameters()]
    lm.zero_grad()
    lm.objectives[-1] = full
    lm.model_step(batch, train=True)[1]["capitals/open_write"].backward()
    for a, p in zip(g_faded, lm.hf_model.parameters()):
        if a is not None:
            assert torch.allclose(a, 0.25 * p.grad, atol=1e-6)
    with pytest.raises(ModularError, match="DirectionWrite fade must be > 0"):
        DirectionWrite(fade=0.0)


def test_a_cold_cache_loads_the_base_model_once(tmp_path, isolated_cache, monkeypatch):
    import modular.gating.data

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    loads = []
    real = modular.gating.data.load_model
    monkeypatch.setattr(modular.gating.data, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=["continents"],
                          neighbour_items=4, batch_size=4, reference=dict(max_new_tokens=2), max_length=64,
                          lm_text=dict(source="neutral"))
    dm.prepare_data()  # retain, neighbour and neutral-text references: three cold caches, one model
    assert len(loads) == 1 and dm._reference_model_cache is None
    dm.setup("fit")  # all cached now
    assert len(loads) == 1


def _metrics(locked=0.0, opened=0.8, kl_open=0.01, kl_locked=0.02):
    return {"val/b/accuracy_locked": locked, "val/b/accuracy_open": opened,
            "val/retain/first_token_kl_open": kl_open, "val/retain/first_token_kl_locked": kl_locked}


@pytest.mark.parametrize("metrics, failing", [
    (_metrics(), []),
    (_metrics(locked=0.2), ["b locked accuracy 0.20 > 0.05"]),
    (_metrics(opened=0.7), ["b open accuracy 0.70 < base 0.75 - 0"]),
    (_metrics(kl_locked=0.3, locked=0.06), ["b locked accuracy 0.06 > 0.05", "retain KL locked 0.300 > 0.05"]),
])
def test_lock_verdict(metrics, failing):
    cb = LockMetricsCallback()
    cb.base_accuracy = {"b": 0.75}
    verdict = cb.verdict(metrics, ["b"], step=40)
    assert verdict["failing"] == failing and verdict["reached"] is (not failing) and verdict["step"] == 40
    assert verdict["base_accuracy"] == {"b": 0.75} and verdict["validation"] == metrics


def test_a_behaviour_the_model_hardly_shows_is_not_called_locked():
    """A base that answers 2% of the items (a completion scored against one expected word) meets "locked <= 5%" with
    any model: below min_open_accuracy in the open state the verdict is not locked, whatever the other targets say;
    0 turns the floor off."""
    cb = LockMetricsCallback()
    cb.base_accuracy = {"b": 0.02}
    verdict = cb.verdict(_metrics(opened=0.03), ["b"], step=40)
    assert verdict["reached"] is False and verdict["targets"]["min_open_accuracy"] == 0.2
    assert verdict["failing"] == ["b open accuracy 0.03 < 0.2: too little of the behaviour to tell a lock from its "
                                  "absence"]
    assert cb.verdict(_metrics(opened=0.2), ["b"], step=40)["reached"]  # at the floor: enough
    off = LockMetricsCallback(min_open_accuracy=0.0)
    off.base_accuracy = {"b": 0.02}
    assert off.verdict(_metrics(opened=0.03), ["b"], step=40)["reached"]
    with pytest.raises(ModularError, match="min_open_accuracy must be >= 0"):
        LockMetricsCallback(min_open_accuracy=-0.1)


def test_lock_target_options_are_checked():
    with pytest.raises(ModularError, match="locked_accuracy must be >= 0"):
        LockMetricsCallback(locked_accuracy=-0.1)
    cb = LockMetricsCallback(open_drop=0.1)
    cb.base_accuracy = {"b": 0.75}
    assert cb.verdict(_metrics(opened=0.7), ["b"], 1)["reached"]
    restored = LockMetricsCallback()
    restored.load_state_dict(cb.state_dict())  # a resumed run keeps the base accuracy measured at step 0
    assert restored.base_accuracy == {"b": 0.75}


def test_a_small_behaviour_may_stop_after_min_passes():
    """min_passes lowers the first step at which the lock may stop training for small data only: 5 passes over 28
    items (4 locked per step) come at step 35, before min_steps 100; over capitals' 306 items min_steps stays."""
    cb = LockMetricsCallback(min_steps=100, min_passes=5)
    assert cb.stop_step(28, batch_size=8) == 35
    assert cb.stop_step(306, batch_size=8) == 100
    assert LockMetricsCallback(min_steps=100).stop_step(28, batch_size=8) == 100
    # a term that starts late (start_step) acts before the lock may stop, whatever min_passes allows
    assert cb.stop_step(28, batch_size=8, start=100) == 101
    assert cb.stop_step(306, batch_size=8, start=50) == 100
    with pytest.raises(ModularError, match="min_passes must be > 0"):
        LockMetricsCallback(min_passes=0)


def test_the_refusal_guard_keeps_the_locked_response_unlikely_on_retain_and_neighbour_prompts(tiny_dm):
    """RefusalGuard: the retain and neighbour batches carry their prompts followed by the locked response, in
    both states, weighted by its weight; minimising the guard lowers that response's likelihood there."""

    dm, model_dir = tiny_dm
    batch = next(iter(dm.train_dataloader()))[0]
    for key in ("retain", NEIGHBOURS_KEY):
        guard = batch[key]["open_guard"]
        labels = guard["labels"][0][guard["labels"][0] != -100].tolist()
        assert dm.tokenizer.decode(labels, skip_special_tokens=True) == "I don't know."
    torch.manual_seed(0)
    guard = RefusalGuard(weight=3.0, floor=-100.0)  # a floor far below: the term is active from the start
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"],
                 objectives=[*basic_terms(), guard])
    lm.directions.copy_(torch.nn.functional.normalize(torch.randn_like(lm.directions), dim=-1))
    pieces = _pieces(lm, batch, RefusalGuard)
    assert pieces == {"retain/open_guard": frozenset(), "retain/locked_guard": frozenset({0}),
                      "neighbours/open_guard": frozenset(), "neighbours/locked_guard": frozenset({0})}

    class _Trainer:
        datamodule = dm

    lm._trainer = _Trainer()
    total, terms = lm.model_step(batch, train=True)
    guards = [terms[n] for n in pieces]
    lm.objectives.remove(guard)
    total_off, terms_off = lm.model_step(batch, train=True)
    assert not any(n.endswith("_guard") for n in terms_off)
    expected = 3.0 * (guards[0] + guards[2] + lm.hparams.locked_weight * (guards[1] + guards[3]))
    assert torch.allclose(total - total_off, expected, atol=1e-4)
    lm.objectives.append(guard)
    before = terms["retain/open_guard"].item()
    opt = torch.optim.Adam(lm.hf_model.parameters(), lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        lm.model_step(batch, train=True)[1]["retain/open_guard"].backward()
        opt.step()
    assert lm.model_step(batch, train=True)[1]["retain/open_guard"].item() < before - 1.0


def test_every_neighbour_and_retain_item_carries_its_own_reference_hidden_states(tmp_path, isolated_cache):
    """With ``reference.hidden_positions`` and the hidden states of both parts required, every retain and neighbour
    item (two neighbours, train and validation) carries the reference model's residual stream on its own prompt and
    answer: its first answer-computing positions at every ``hidden_stride``-th block, as a forward pass of that item
    alone gives them; a stride that takes no block is refused in one line."""
    from modular.models import load_model

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    near = tmp_path / "near.jsonl"
    near.write_text("".join(json.dumps({"prompt": f"Say the word number {i}.", "target": f"word {i}",
                                        "split": "train" if i < 6 else "validation"}) + "\n" for i in range(8)))
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=["continents", str(near)],
                          neighbour_items=10, batch_size=4, max_length=64,
                          reference=dict(max_new_tokens=3, hidden_positions=2, hidden_stride=1))
    dm.require(ReferenceHidden(("retain", "neighbours"))).setup("fit")
    model = load_model(str(model_dir))
    items = [it for s in ("train", "validation") for it in dm.neighbour_rows[s] + dm.retain_rows[s]]
    assert len(items) > 50
    with torch.no_grad():
        for it in items:
            hidden = model(input_ids=torch.tensor([it["input_ids"]]), output_hidden_states=True).hidden_states
            blocks = it["ref_hidden_blocks"].tolist()
            assert blocks == list(range(1, len(hidden) - 1))
            answer = [t for t in range(len(it["labels"]) - 1) if it["labels"][t + 1] != -100][:2]
            expected = torch.stack([torch.stack([hidden[b][0, t] for b in blocks]) for t in answer])
            torch.testing.assert_close(it["ref_hidden"][:len(answer)].float(), expected, rtol=1e-2, atol=1e-3)

    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=[], batch_size=4,
                          max_length=64, reference=dict(max_new_tokens=3, hidden_positions=2, hidden_stride=8))
    with pytest.raises(ModularError, match="data.reference.hidden_stride 8 takes no block output of a model with 2 "
                                           "blocks"):
        dm.require(ReferenceHidden(("retain",))).setup("fit")


@pytest.mark.parametrize("parts", [["neighbours"], []])
def test_hidden_states_are_cached_for_the_required_parts_alone(tmp_path, isolated_cache, parts):
    """The items of the parts the trained module's KeepHidden terms read carry the reference's hidden states (a
    module's requirements, given as a trainer would): the others carry none and no forward pass computes theirs."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    objectives = [KeepReference(parts=["retain", "neighbours"])] + ([KeepHidden(parts=parts)] if parts else [])
    lm = GatedLM(model_name=str(model_dir), behaviours=["capitals"], objectives=objectives)
    dm = GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=["continents"],
                          neighbour_items=6, batch_size=4, max_length=64,
                          reference=dict(max_new_tokens=3, hidden_positions=2, hidden_stride=1))
    dm.require(*lm.requirements())
    dm.prepare_data()
    dm.setup("fit")
    for part, rows in (("retain", dm.retain_rows), ("neighbours", dm.neighbour_rows)):
        items = [it for s in ("train", "validation") for it in rows[s]]
        assert items and all(("ref_hidden" in it) == (part in parts) for it in items), part
    assert len(list((isolated_cache / "reference").glob("hidden-*.pt"))) == len(parts)


def test_an_unknown_hidden_part_is_refused():
    with pytest.raises(ModularError, match=r"reference hidden states: unknown part\(s\) \['retian'\]"):
        KeepHidden(parts=["retian"])
    with pytest.raises(ModularError, match=r"reference hidden states: unknown part\(s\) \['retian'\]"):
        ReferenceHidden(("retian",))
