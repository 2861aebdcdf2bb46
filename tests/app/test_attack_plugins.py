"""Attacks as plug-ins: an attack of one's own is one class (here, in this file), named on the command line; its
entry, its part of the log line and its bar come from the class alone, and what it measures is kept over a
restart as the built-in attacks' is."""

import json

import pytest
import torch

from modular import ModularError
from modular.evaluation.attacks import Attack
from tests.app.test_attack import _tiny_release

calls = []


def noise_attack(model, tokenizer, test, scale: float, refusals, batch_size: int) -> dict:
    """Held-out accuracy with a random direction of norm ``scale`` added to the residual after every block."""
    from modular.evaluation.behaviour import evaluate_behaviour
    from modular.hooks import add_vectors
    from modular.models.adapter import ArchitectureAdapter

    calls.append(scale)
    adapter = ArchitectureAdapter(model)
    v = torch.nn.functional.normalize(torch.randn(adapter.d_model, generator=torch.Generator().manual_seed(0)), dim=0)
    r = evaluate_behaviour(model, tokenizer, test, max_new_tokens=4, batch_size=batch_size, desc=False,
                           intervention=lambda: add_vectors(adapter, {i: scale * v for i in range(adapter.n_layers)}),
                           refusals=refusals)
    return {"accuracy": r.accuracy, "n": r.n, "scale": scale}


class NoiseAttack(Attack):
    """(f) A random direction, ``alpha`` residual norms long, added after every block."""

    key, title = "h_noise", "(h) noise"

    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def run(self, ctx):
        return ctx.part(self.key, noise_attack, ctx.locked, ctx.tokenizer, ctx.test, self.alpha * ctx.residual_scale,
                        ctx.refusals, ctx.batch_size)


class Clash(Attack):
    key, title = "baselines", "(g) clash"


def test_an_attack_of_ones_own_is_one_class_added_on_the_command_line(tmp_path, drawn, monkeypatch, caplog):
    """``--attacks+=module.Class`` runs the five built-in attacks and the new one: its entry is in attack.json after
    theirs (theirs unchanged in layout), the log line ends with its summary, the figure draws its bar; it runs before
    the fine-tuning sweeps, so an attack cut short in (c) has it saved, and the run started again does not measure
    it again."""
    import modular.evaluation.relearning as relearning
    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=1)
    out = tmp_path / "attack"
    args = ["attack", "--model", str(pub), "--base", str(base), "--attacks+=tests.app.test_attack_plugins.NoiseAttack",
            "--alphas", "[1]", "--n_pairs", "2", "--n_examples", "[2]", "--seeds", "[0]", "--relearn_modes", "[full]",
            "--full_lrs", "[1e-3]", "--relearn_steps", "1", "--neutral", "false", "--unrelated", "false", "--baselines", "[]",
            "--limit", "2",
            "--quantized", "[int8]",
            "--out", str(out)]
    real = relearning.recovery_curve

    def killed(*a, **kw):
        raise KeyboardInterrupt  # the job is killed in the first relearning setting

    calls.clear()
    monkeypatch.setattr(relearning, "recovery_curve", killed)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    saved = json.loads((out / "attack.partial.json").read_text())["behaviours"]["capitals"]["parts"]
    assert {"a_weights", "b_steering", "e_prefill", "f_quantized", "h_noise"} <= set(saved) and len(calls) == 1

    monkeypatch.setattr(relearning, "recovery_curve", real)
    with caplog.at_level("INFO", logger="modular"):
        assert main(args) == 0
    assert len(calls) == 1  # taken over from attack.partial.json
    r = json.loads((out / "attack.json").read_text())["behaviours"]["capitals"]
    assert list(r) == ["base_accuracy", "open_accuracy", "open_accuracy_from", "locked_accuracy", "residual_scale",
                       "a_weights", "b_steering", "c_relearning", "d_neutral", "e_prefill", "f_quantized", "g_unrelated",
                       "h_noise", "baselines", "advantage"]
    f = r["h_noise"]
    assert f == saved["h_noise"] and f["n"] == 2 and f["scale"] == pytest.approx(r["residual_scale"])
    line = next(x for x in caplog.messages if x.startswith("capitals: base"))
    q = r["f_quantized"]["schemes"]["int8"]
    assert line.endswith(f" | (e) prefilled {r['e_prefill']['accuracy']:.3f} (base prefilled "
                         f"{r['e_prefill']['base_accuracy']:.3f}) | (f) re-quantised int8 {q['accuracy']:.3f} (base "
                         f"{q['base_accuracy']:.3f}) | (g) unrelated: not run | (h) noise {f['accuracy']:.3f}")
    assert f"| (a) weights best {r['a_weights']['best']['accuracy']:.3f} |" in line
    assert "| (d) neutral: not run |" in line
    bars = drawn["attack.png"]["axes"][0]
    assert bars["xticklabels"] == ["base", "open (base)", "locked", "(a) weights", "(b) steering", "(c) relearning",
                                   "(e) prefill", "(f) int8", "(h) noise"]  # (d), (g): not run, no bar
    assert bars["bars"][-1] == pytest.approx(f["accuracy"]) and bars["texts"][-1] == f"{f['accuracy']:.2f}"


def test_an_unknown_attack_is_one_line_before_anything_is_loaded_or_written(tmp_path, monkeypatch, capsys):
    """A name that is no built-in attack and no importable class, a class that is not an Attack, options the class
    does not take, two attacks of one key, or a key the report uses itself: one line, before a model is loaded or
    the output folder made."""
    import modular.models
    from modular.app.attacking import attack
    from modular.app.cli import main
    from modular.evaluation.attacks import BUILTIN_ATTACKS, build_attacks, default_attacks
    from modular.evaluation.defaults import DEFAULT_ATTACKS

    base, pub = _tiny_release(tmp_path, seed=1)
    loaded = []
    monkeypatch.setattr(modular.models, "load_model", lambda *a, **kw: loaded.append(a))
    here = "tests.app.test_attack_plugins"
    cases = [
        (["nope"], "attacks: no attack 'nope' (built-in: weights, steering, relearning, neutral, prefill, quantized, "
                   "unrelated; or the class path of a modular.evaluation.attacks.Attack)"),
        ([f"{here}.Missing"], f"attacks: no attack '{here}.Missing'"),
        ([f"{here}.noise_attack"], f"attacks: {here}.noise_attack is not a modular.evaluation.attacks.Attack"),
        ([{"class_path": f"{here}.NoiseAttack", "init_args": {"beta": 2}}], f"attacks: {here}.NoiseAttack: "),
        (["weights", "steering", "weights"], "attacks: the key 'a_weights' of WeightAttack is taken (by another attack"),
        ([f"{here}.Clash"], "attacks: the key 'baselines' of Clash is taken (by the report)"),
    ]
    out = tmp_path / "out"
    for specs, said in cases:
        with pytest.raises(ModularError) as err:
            attack(str(pub), base=str(base), attacks=specs, out=str(out))
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    capsys.readouterr()
    assert main(["attack", "--model", str(pub), "--base", str(base), "--attacks+=nope", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {cases[0][1]}"]
    assert not out.exists() and loaded == []

    # the default list is the seven built-in attacks, under the keys attack.json has always had; options reach a class
    assert DEFAULT_ATTACKS == list(BUILTIN_ATTACKS)
    assert [a.key for a in default_attacks()] == ["a_weights", "b_steering", "c_relearning", "d_neutral", "e_prefill",
                                                  "f_quantized", "g_unrelated"]
    (noise,) = build_attacks([{"class_path": f"{here}.NoiseAttack", "init_args": {"alpha": 2}}])
    assert isinstance(noise, NoiseAttack) and noise.alpha == 2
