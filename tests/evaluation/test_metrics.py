"""The evaluations' metrics (torchmetrics objects) against hand computations, and their sync over processes."""

import json
import math

import datasets
import pytest
import torch
import torch.nn.functional as F

from modular.evaluation import behaviour as ev
from modular.evaluation.metrics import Share, TokenPerplexity, mean, metric_device, share
from modular.evaluation.retain import first_token_logp, mean_kl, perplexity
from tests.conftest import VOCAB, make_tiny_model, make_tiny_tokenizer


def _rows(targets, wrong=None):
    n = len(targets)
    return datasets.Dataset.from_dict({
        "prompt": [f"Question {i}?" for i in range(n)], "target": targets, "answers": [[t] for t in targets],
        "prefixes": [[] for _ in targets], "wrong": wrong or [""] * n, "counterfactual": [""] * n,
        "chat": [True] * n,
    })


def test_share_is_the_exact_ratio_of_counts():
    metric = Share()
    metric.update([True, False, True])
    metric.update(torch.tensor([True, True, False, False]))
    assert metric.compute().item() == 4 / 7
    assert share([True] + [False] * 19) == 0.05  # exact: a float32 mean gives 0.0500000007 > 0.05 (a lock target)
    assert share([]) == 0.0


def test_mean_keeps_nan():
    assert mean(torch.tensor([1.0, 2.0, 4.5])) == pytest.approx(2.5)
    assert math.isnan(mean(torch.tensor([1.0, float("nan")])))


def _hand_perplexity(logits, target, mask):
    nll = -torch.log_softmax(logits.double(), -1).gather(-1, target[..., None])[..., 0]
    return math.exp(nll[mask].sum().item() / mask.sum().item())


def test_token_perplexity_weighs_texts_by_their_tokens():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 6, 11, generator=g)
    target = torch.randint(0, 11, (2, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)  # 5 and 2 tokens
    metric = TokenPerplexity()
    metric.update(logits[:1], target[:1], mask[:1])
    metric.update(logits[1:], target[1:], mask[1:])
    expected = _hand_perplexity(logits, target, mask)
    assert metric.compute().item() == pytest.approx(expected, rel=1e-6)
    per_text = [_hand_perplexity(logits[i:i + 1], target[i:i + 1], mask[i:i + 1]) for i in range(2)]
    assert abs(sum(per_text) / 2 - expected) > 1e-3 * expected  # not the mean of per-text perplexities
    none = TokenPerplexity()
    none.update(logits, target, torch.zeros_like(mask))
    assert none.compute().item() == 1.0  # no tokens


def test_perplexity_of_texts_of_unequal_length_is_token_weighted():
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    texts = ["The river runs to the sea, past the old mill and the bridge.", "A cat.",
             "Bread is baked early in the morning."]
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in texts:  # one text at a time: no padding
            ids = tok(text, return_tensors="pt")["input_ids"]
            nll += F.cross_entropy(model(input_ids=ids).logits[0, :-1].double(), ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    lengths = {len(tok(t)["input_ids"]) for t in texts}
    assert len(lengths) == 3  # the batch is padded
    assert perplexity(model, tok, texts, batch_size=2) == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_scoring_passes_build_no_key_value_cache(kv_caches):
    """Perplexity and the next-token logits behind the retain KL and choice scoring decode nothing."""
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    built = kv_caches(model)
    perplexity(model, tok, ["The river runs to the sea.", "A cat."], batch_size=2)
    first_token_logp(model, tok, ["Name a colour.", "Say hello."], [True, False])
    assert built == []


def test_mean_kl_is_kl_of_the_reference_to_the_model():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(5, 13, generator=g), -1)
    logp = torch.log_softmax(torch.randn(5, 13, generator=g), -1)
    expected = F.kl_div(logp, ref, log_target=True, reduction="batchmean").item()
    assert mean_kl(ref, logp) == pytest.approx(expected, rel=1e-5)
    assert mean_kl(ref, logp) != pytest.approx(mean_kl(logp, ref), rel=1e-3)  # the direction matters
    assert mean_kl(ref, ref) == pytest.approx(0.0, abs=1e-6)


def test_behaviour_accuracy_and_refusals_are_counted(monkeypatch):
    rows = _rows(["Paris", "Rome", "Oslo", "Bern", "Lima"])
    responses = ["Paris.", "I don't know.", "It is Oslo", "No comment.", "Madrid"]
    monkeypatch.setattr(ev, "generate", lambda *a, **k: list(responses))
    r = ev.evaluate_behaviour(None, None, rows, refusals=("I don't know.", "No comment."))
    assert (r.accuracy, r.refusal_rate, r.n) == (2 / 5, 2 / 5, 5)
    assert [i["correct"] for i in r.items] == [True, False, True, False, False]
    assert [i["refusal"] for i in r.items] == [False, True, False, True, False]
    r = ev.evaluate_behaviour(None, None, rows, refusals=("I don't know.",))
    assert (r.accuracy, r.refusal_rate) == (2 / 5, 1 / 5)
    assert r.summary() == {"accuracy": 0.4, "n": 5, "refusal_rate": 0.2}


def test_choice_scores_are_the_mean_logit_difference_and_the_share_of_wins(monkeypatch):
    tok = make_tiny_tokenizer()
    targets, wrong = ["Paris", "Rome", "Oslo", "Bern"], ["London", "Madrid", "Berlin", "Vienna"]
    good, bad = ev.first_token_ids(tok, targets), ev.first_token_ids(tok, wrong)
    assert (good != bad).all()
    diffs = torch.tensor([2.0, -1.0, 0.5, 0.0])  # a tie is not a win
    logits = torch.zeros(4, VOCAB)
    logits[torch.arange(4), good] = diffs
    monkeypatch.setattr(ev, "last_logits", lambda *a, **k: logits.clone())
    rows = _rows(targets, wrong)
    r = ev.evaluate_behaviour(None, tok, rows, choice_only=True)
    assert (r.accuracy, r.choice_accuracy, r.items) == (0.5, 0.5, [])
    assert r.logit_diff == pytest.approx(0.375)
    monkeypatch.setattr(ev, "generate", lambda *a, **k: ["Paris", "Rome", "no", "no"])
    r = ev.evaluate_behaviour(None, tok, rows)
    assert (r.accuracy, r.choice_accuracy, r.refusal_rate) == (0.5, 0.5, 0.0)
    assert r.logit_diff == pytest.approx(0.375)


def test_a_task_with_many_right_answers_is_scored_by_generation_even_where_a_choice_is_asked(monkeypatch):
    """Greater-than accepts any later year: a first-token choice against the wrong year would call " 35" after
    "1732 to the year 17" a loss (its first token ties with " 32"'s), so choice_only scores such items by their
    greedy responses; a task with one right answer each keeps the choice."""
    tok = make_tiny_tokenizer()
    rows = _rows(["Paris", "Rome"], ["London", "Madrid"])
    assert ev.choice_measures(rows)
    many = rows.remove_columns(["prefixes", "answers"]).add_column("prefixes", [["Paris", "Parma"], []]) \
        .add_column("answers", [[], []])  # scored by the prefixes, or by the target where there are none
    assert not ev.choice_measures(many) and not ev.choice_measures(_rows(["Paris", "Rome"]))
    wrong = ev.first_token_ids(tok, ["London", "Madrid"])
    logits = torch.zeros(2, VOCAB)
    logits[torch.arange(2), wrong] = 1.0  # the wrong answers win the choice
    monkeypatch.setattr(ev, "last_logits", lambda *a, **k: logits.clone())
    monkeypatch.setattr(ev, "generate", lambda *a, **k: ["Parma", "Rome"])
    r = ev.evaluate_behaviour(None, tok, many, choice_only=True)
    assert (r.accuracy, r.choice_accuracy, len(r.items)) == (1.0, 0.0, 2)
    r = ev.evaluate_behaviour(None, tok, rows, choice_only=True)
    assert (r.accuracy, r.choice_accuracy, r.items) == (0.0, 0.0, [])


# --- the same metrics in two processes, each scoring its own shard ---------------------------------------------

def _data():
    g = torch.Generator().manual_seed(2)
    n = 10
    return {
        "flags": torch.rand(n, generator=g) < 0.4,
        "values": torch.randn(n, generator=g),
        "ref": torch.log_softmax(torch.randn(n, 17, generator=g), -1),
        "logp": torch.log_softmax(torch.randn(n, 17, generator=g), -1),
        "logits": 2 * torch.randn(n, 8, 17, generator=g),
        "target": torch.randint(0, 17, (n, 8), generator=g),
        "mask": torch.arange(8)[None, :] < torch.randint(1, 9, (n, 1), generator=g),  # unequal lengths
    }


def _scores(data, rows) -> dict:
    ppl = TokenPerplexity().to(metric_device())
    for i in rows:  # one text per update
        ppl.update(data["logits"][i:i + 1], data["target"][i:i + 1], data["mask"][i:i + 1])
    return {"share": share(data["flags"][rows]), "mean": mean(data["values"][rows]),
            "kl": mean_kl(data["ref"][rows], data["logp"][rows]), "perplexity": ppl.compute().item()}


SHARDS = [list(range(0, 3)), list(range(3, 10))]  # unequal shards: a mean of the two shards' values is wrong


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        scores = _scores(_data(), SHARDS[rank])
        scores["device"] = str(metric_device())
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(scores, f)
        dist.barrier()  # neither process tears gloo down while the other may still be in a collective
    finally:
        dist.destroy_process_group()


def test_metrics_are_synced_over_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    data = _data()
    full = _scores(data, list(range(10)))
    alone = [_scores(data, rows) for rows in SHARDS]  # without processes: each shard's own value
    for rank in range(2):
        synced = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert synced.pop("device") == "cpu"
        assert synced["share"] == full["share"]
        for name in ("mean", "kl", "perplexity"):
            assert synced[name] == pytest.approx(full[name], rel=1e-5), name
        for name in full:  # the shards differ from the whole: the test sees a missing sync
            assert alone[rank][name] != pytest.approx(full[name], rel=1e-3), name


def test_a_kl_made_negative_by_rounding_is_zero():
    """A reference cached in float16 against the same model in float32 (the first validation of a run): the KL is 0,
    never the -0.000 that progress lines and run.json showed (issue 80.6)."""
    logp = torch.log_softmax(torch.zeros(2, 3), -1)  # -log 3 rounds down in float16: the raw KL is about -2e-5
    assert mean_kl(logp.half().float(), logp) == 0.0
    assert mean_kl(logp, torch.log_softmax(torch.tensor([[0.5, 0.0, 0.0]] * 2), -1)) > 0  # a real difference stays
