"""Which behaviours `modular attack` attacks, and with which data, before any model is loaded."""

import pytest
import torch

from modular import ModularError
from modular.app.attacking import attack
from modular.publish import publish_model
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer, save_tiny_folder


@pytest.fixture
def published(tmp_path):
    u = torch.zeros(D)
    u[0] = 1.0
    out, _ = publish_model(make_tiny_model("llama"), make_tiny_tokenizer(), {"mine": u}, tmp_path / "pub", "tiny")
    return out


def test_attack_needs_the_data_of_a_behaviour_gated_from_user_data(published, monkeypatch):
    with pytest.raises(ModularError, match=r'gated from user data: give it as --behaviours\+=mine=<'):
        attack(str(published))  # the manifest names 'mine', not where its data is
    with pytest.raises(ModularError, match="behaviour 'capitals' is not locked"):
        attack(str(published), behaviours=["capitals"])
    with pytest.raises(ModularError, match="behaviour 'other' is not locked"):
        attack(str(published), behaviours=["other=/data/mine.jsonl"])
    manifest = (published / "modular.json").read_text()
    (published / "modular.json").write_text(manifest[:20])  # cut short: one line naming the file, no traceback
    with pytest.raises(ModularError, match=r"pub/modular.json is not readable"):
        attack(str(published), behaviours=["mine=/data/mine.jsonl"])
    (published / "modular.json").write_text(manifest)

    # a data file named by its stem, or NAME=<file>, is the locked behaviour's data: the attack goes on to load it
    import modular.app.attacking as evaluations

    seen = []

    def stop(source, **kw):
        seen.append(source)
        raise ModularError("stop")

    monkeypatch.setattr(evaluations, "load_behaviour", stop)
    for spec in ("/data/mine.jsonl", "mine=/data/other.jsonl"):
        with pytest.raises(ModularError, match="stop"):
            attack(str(published), behaviours=[spec], n_examples=[8], base=str(published))
    assert seen == ["/data/mine.jsonl", "/data/other.jsonl"]


def _tiny_release(tmp_path, seed: int):
    """A tiny base model folder and a published folder of a (seed-``seed``) tiny model with capitals locked."""
    base = save_tiny_folder(tmp_path / "base", "llama")
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    pub, _ = publish_model(make_tiny_model("llama", seed=seed), make_tiny_tokenizer(), {"capitals": u},
                           tmp_path / "pub", "tiny")
    return base, pub


def test_attack_end_to_end_on_a_tiny_published_folder(tmp_path, drawn, monkeypatch):
    """Every attack runs on a published tiny model: attack.json holds (a), (b), the relearning sweep (c), the
    neutral sweep (d), the prefill attack (e), the quantisations (f) and both baselines with self-consistent
    numbers, and the published model's advantage over the base after the same attacks; attack.png draws exactly the
    JSON's accuracies under their labels and every sweep's best-so-far curve, attack_advantage.png each
    condition's advantage."""
    import json

    from modular.app.cli import main
    from modular.evaluation.attack import envelope

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=1)
    out = tmp_path / "attack"
    rc = main(["attack", "--model", str(pub), "--base", str(base), "--alphas", "[-1, 1]", "--n_pairs", "4",
               "--n_examples", "[2, 4]", "--seeds", "[0, 1]", "--full_lrs", "[1e-4, 1e-3]", "--lora_lrs", "[1e-2]",
               "--relearn_steps", "3", "--refusal_steps", "2", "--limit", "3", "--quantized", "[int8, q4_0]",
               "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "attack.json").read_text())
    r = report["behaviours"]["capitals"]
    a, s = r["a_weights"], r["b_steering"]
    assert [p["scale"] for p in a["scan"]] == [-1, 1] and a["best"]["accuracy"] == max(p["accuracy"] for p in a["scan"])
    assert s["pairs"] == 4 and all([p["scale"] for p in v["scan"]] == [1] for v in s["layers"].values())
    assert s["best"]["accuracy"] == max(v["best"]["accuracy"] for v in s["layers"].values())
    for key in ("a_weights", "b_steering"):
        assert r[key]["recovered_fraction_of_base"] == pytest.approx(
            r[key]["best"]["accuracy"] / max(r["base_accuracy"], 1e-9))
    c, d = r["c_relearning"], r["d_neutral"]
    # (c): modes × their rates × N × seeds; (d): every mode and rate, the largest N, the first seed
    assert sorted((x["mode"], x["lr"], x["n"], x["seed"]) for x in c["settings"]) == sorted(
        [("full", lr, n, sd) for lr in (1e-4, 1e-3) for n in (2, 4) for sd in (0, 1)]
        + [("lora", 1e-2, n, sd) for n in (2, 4) for sd in (0, 1)])
    assert sorted((x["mode"], x["lr"], x["n"], x["seed"], x["data"]) for x in d["settings"]) == sorted(
        [("full", 1e-4, 4, 0, "neutral"), ("full", 1e-3, 4, 0, "neutral"), ("lora", 1e-2, 4, 0, "neutral")])
    g = r["g_unrelated"]  # (g): as (d), on an unrelated task's examples
    assert sorted((x["mode"], x["lr"], x["n"], x["seed"], x["data"]) for x in g["settings"]) == sorted(
        [("full", 1e-4, 4, 0, "unrelated"), ("full", 1e-3, 4, 0, "unrelated"), ("lora", 1e-2, 4, 0, "unrelated")])
    for x in c["settings"] + d["settings"]:
        assert x["curve"][0] == {"step": 0, "examples_seen": 0, "accuracy": r["locked_accuracy"]}
        assert [p["step"] for p in x["curve"]] == [0, 1, 2, 3][:len(x["curve"])]
    assert report["sweep"]["eval_steps"] == [1, 2, 3]
    assert set(r["baselines"]) == {"refusal", "base"}
    assert r["baselines"]["base"]["start_accuracy"] == r["base_accuracy"]
    assert r["baselines"]["refusal"]["steps"] == 2 and r["baselines"]["refusal"]["retain_first_token_kl"] > 0
    for v in r["baselines"].values():
        assert len(v["c_relearning"]["settings"]) == len(c["settings"])
        assert v["c_relearning"]["settings"][0]["curve"][0]["accuracy"] == v["start_accuracy"]
    fig = drawn["attack.png"]["axes"]
    bars, curves = fig[0], fig[1]
    e = r["e_prefill"]  # capitals' targets all have a frame ("The capital of X is")
    assert (e["n"], e["framed_items"], len(e["examples"])) == (3, 3, 3)
    assert e["recovered_fraction_of_base"] == pytest.approx(e["accuracy"] / max(e["base_accuracy"], 1e-9))
    assert all(x["prefill"].startswith("The capital of ") for x in e["examples"])
    assert 0 <= r["baselines"]["refusal"]["e_prefill_accuracy"] <= 1
    # published without `modular lock`: no open accuracy recorded, the base's stands in, and the figure says so
    assert r["open_accuracy_from"] == "base model" and r["open_accuracy"] == r["base_accuracy"]
    q = r["f_quantized"]["schemes"]
    assert list(q) == ["int8", "q4_0"] and all(0 <= v[k] <= 1 for v in q.values() for k in ("accuracy", "base_accuracy"))
    assert bars["xticklabels"] == ["base", "open (base)", "locked", "(a) weights", "(b) steering", "(c) relearning",
                                   "(d) neutral", "(e) prefill", "(f) int8", "(f) q4_0", "(g) unrelated"]
    assert bars["bars"] == pytest.approx([r["base_accuracy"], r["open_accuracy"], r["locked_accuracy"],
                                          a["best"]["accuracy"], s["best"]["accuracy"],
                                          max(x["best_accuracy"] for x in c["settings"]),
                                          max(x["best_accuracy"] for x in d["settings"]), e["accuracy"],
                                          q["int8"]["accuracy"], q["q4_0"]["accuracy"],
                                          max(x["best_accuracy"] for x in g["settings"])])
    assert bars["texts"] == [f"{v:.2f}" for v in bars["bars"]]
    assert curves["lines"][f"gated (c) relearning, {len(c['settings'])} settings"] == pytest.approx(envelope(c)[1])
    assert curves["lines"][f"refusal baseline (c) relearning, {len(c['settings'])} settings"] == pytest.approx(
        envelope(r["baselines"]["refusal"]["c_relearning"])[1])
    assert f"gated (d) neutral, {len(d['settings'])} settings" in curves["lines"]
    assert f"base baseline (c) relearning, {len(c['settings'])} settings" in curves["lines"]
    # the same neutral and unrelated sweeps on the base, not on the refusal baseline
    for k, own in (("d_neutral", d), ("g_unrelated", g)):
        assert len(r["baselines"]["base"][k]["settings"]) == len(own["settings"]) and k not in r["baselines"]["refusal"]
    # the advantage: every setting of (c) and (d) against the base's under the same setting, prefilling, each
    # quantisation; (a) and (b) have no counterpart on the base
    adv = r["advantage"]
    base_best = {(k, x["label"]): x["best_accuracy"] for k in ("c_relearning", "d_neutral", "g_unrelated")
                 for x in r["baselines"]["base"][k]["settings"]}
    expected = ([("c_relearning", x["label"], x["best_accuracy"], base_best["c_relearning", x["label"]])
                 for x in c["settings"]]
                + [("d_neutral", x["label"], x["best_accuracy"], base_best["d_neutral", x["label"]])
                   for x in d["settings"]]
                + [("e_prefill", "prefilled", e["accuracy"], e["base_accuracy"])]
                + [("f_quantized", k, v["accuracy"], v["base_accuracy"]) for k, v in q.items()]
                + [("g_unrelated", x["label"], x["best_accuracy"], base_best["g_unrelated", x["label"]])
                   for x in g["settings"]])
    assert sorted((x["attack"], x["condition"], x["published"], x["base"]) for x in adv["rows"]) == sorted(expected)
    assert all(x["advantage"] == pytest.approx(x["published"] - x["base"]) for x in adv["rows"])
    assert adv["worst"]["advantage"] == max(x["advantage"] for x in adv["rows"]) and adv["conditions"] == len(expected)
    panel = drawn["attack_advantage.png"]["axes"][0]
    assert panel["widths"] == pytest.approx([100 * x["advantage"] for x in adv["rows"]])
    w = adv["worst"]
    assert panel["title"] == f"capitals: worst {100 * w['advantage']:+.1f} points ({w['title']}, {w['condition']})"
    assert panel["yticklabels"] == [f"{x['title']}: {x['condition']}" for x in adv["rows"]]


def test_quantized_evaluation_on_a_tiny_published_folder(tmp_path, drawn, monkeypatch, caplog):
    """`modular quantized`: both models quantised alike per scheme, the JSON's numbers consistent with each other
    (no KL between a model and itself unquantised, none between identical weights) and drawn as they are; each
    scheme's line says how many locked answers are the locked response (an int4 model can score 0 by breaking)."""
    import json

    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=0)
    out = tmp_path / "q"
    with caplog.at_level("INFO", logger="modular"):
        assert main(["quantized", "--model", str(pub), "--base", str(base), "--limit", "3", "--max_new_tokens", "3",
                     "--out", str(out)]) == 0
    report = json.loads((out / "quantized.json").read_text())
    assert list(report["schemes"]) == ["none", "int8", "int4"]
    rows = report["schemes"]
    assert rows["none"]["retain_first_token_kl_base_vs_unquantised"] == pytest.approx(0, abs=1e-9)
    assert 0 < rows["int8"]["retain_first_token_kl_base_vs_unquantised"] < rows["int4"][
        "retain_first_token_kl_base_vs_unquantised"]
    for row in rows.values():
        assert row["retain_first_token_kl"] > 0  # the published weights differ from the base's
        held = all(v["locked"]["accuracy"] <= 0.05 for v in row["behaviours"].values()) \
            and row["retain_first_token_kl"] <= 0.05
        assert row["lock_held"] == held
        assert row["behaviours"]["capitals"]["locked"]["n"] == 3
    for scheme, row in rows.items():
        b, locked = row["behaviours"]["capitals"]["base"], row["behaviours"]["capitals"]["locked"]
        assert (f"{scheme}: capitals base {b['accuracy']:.3f} locked {locked['accuracy']:.3f} (locked responses "
                f"{locked['refusal_rate']:.0%}) | retain KL") in caplog.text
    bars = drawn["quantized.png"]["axes"][0]
    assert bars["bars"] == pytest.approx([rows[s]["behaviours"]["capitals"][k]["accuracy"]
                                          for s in rows for k in ("base", "locked")])
    assert bars["xticklabels"][3] == f"int8\ncapitals\nlocked\nKL {rows['int8']['retain_first_token_kl']:.3f}"


def test_quantized_int4_group_size(tmp_path, monkeypatch):
    """`--group_size` reaches the quantiser (int4 in groups of 32 is not the per-channel int4 the tiny model gets by
    default) and is recorded; a group size without int4, or one that divides no layer, fails before any output."""
    import json

    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=0)
    args = ["quantized", "--model", str(pub), "--base", str(base), "--limit", "2", "--max_new_tokens", "2",
            "--schemes", "[int4]"]
    kl = {}
    for group in (None, 32):
        out = tmp_path / f"q{group}"
        assert main(args + ["--out", str(out)] + (["--group_size", str(group)] if group else [])) == 0
        report = json.loads((out / "quantized.json").read_text())
        assert report["int4_group_size"] == group
        kl[group] = report["schemes"]["int4"]["retain_first_token_kl_base_vs_unquantised"]
    assert kl[None] > 0 and kl[32] > 0 and abs(kl[None] - kl[32]) > 1e-6 * kl[None]
    for bad in (["--schemes", "[int8]", "--group_size", "32"], ["--group_size", "48"]):
        out = tmp_path / "bad"
        assert main(args[:-2] + bad + ["--out", str(out)]) != 0
        assert not out.exists()


def test_quantized_gguf_block_formats(tmp_path, monkeypatch):
    """llama.cpp's block formats are schemes like the others: both models rounded alike, the coarser format further
    from the unrounded base."""
    import json

    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=0)
    out = tmp_path / "q"
    assert main(["quantized", "--model", str(pub), "--base", str(base), "--limit", "2", "--max_new_tokens", "2",
                 "--schemes", "[q8_0, q4_0]", "--out", str(out)]) == 0
    rows = json.loads((out / "quantized.json").read_text())["schemes"]
    assert list(rows) == ["q8_0", "q4_0"]
    assert 0 < rows["q8_0"]["retain_first_token_kl_base_vs_unquantised"] < rows["q4_0"][
        "retain_first_token_kl_base_vs_unquantised"]
    with pytest.raises(SystemExit):  # k-quants have no reference quantiser: not a choice
        main(["quantized", "--model", str(pub), "--schemes", "[q4_k]", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_an_attack_cut_short_resumes_where_it_stopped(tmp_path, monkeypatch, caplog):
    """An attack killed mid-sweep leaves what it measured in attack.partial.json (no attack.json); started again
    with the same options it trains only the settings still missing and writes the report an uncut run writes,
    then removes the partial file; with other options it measures everything afresh."""
    import json

    import modular.evaluation.relearning as relearning
    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base, pub = _tiny_release(tmp_path, seed=1)
    args = ["attack", "--model", str(pub), "--base", str(base), "--alphas", "[1]", "--n_pairs", "2",
            "--n_examples", "[2]", "--seeds", "[0]", "--full_lrs", "[1e-3]", "--lora_lrs", "[1e-2]",
            "--relearn_steps", "2", "--baselines", "[refusal]", "--refusal_steps", "1", "--quantized", "[int8]",
            "--unrelated", "false", "--limit", "2"]
    real, trained = relearning.recovery_curve, []

    def counted(model, tokenizer, rows, test, setting, *a, **kw):
        if len(trained) == stop_at:
            raise KeyboardInterrupt  # the job is killed here
        trained.append(setting.label)
        return real(model, tokenizer, rows, test, setting, *a, **kw)

    monkeypatch.setattr(relearning, "recovery_curve", counted)
    stop_at = None
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "attack.json").read_text())
    assert len(trained) == 6 and not (tmp_path / "whole" / "attack.partial.json").exists()  # (c), (d), refusal (c)
    order = list(trained)

    out = tmp_path / "cut"
    trained.clear()
    stop_at = 3
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(out)])
    assert not (out / "attack.json").exists()
    saved = json.loads((out / "attack.partial.json").read_text())["behaviours"]["capitals"]
    assert set(saved["parts"]) == {"base_accuracy", "locked_accuracy", "residual_scale", "a_weights", "b_steering",
                                   "e_prefill", "f_quantized"}
    assert {k: len(v["settings"]) for k, v in saved["sweeps"].items()} == {"c_relearning": 2, "d_neutral": 1}

    assert trained == order[:3]
    stop_at = None
    trained.clear()
    with caplog.at_level("INFO", logger="modular"):
        assert main([*args, "--out", str(out)]) == 0
    assert "resuming the attack cut short" in caplog.text and "7 parts and 3 relearning settings" in caplog.text
    assert trained == order[3:]  # the rest only: (d)'s second setting, the refusal baseline's sweep
    assert json.loads((out / "attack.json").read_text()) == whole
    assert not (out / "attack.partial.json").exists()

    # other options: nothing taken over
    trained.clear()
    stop_at = 1
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(out)])
    stop_at = None
    trained.clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="modular"):
        assert main([*args[:-1], "1", "--out", str(out)]) == 0  # --limit 1
    assert "measuring afresh" in caplog.text and len(trained) == 6
