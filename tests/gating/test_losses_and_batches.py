import pytest
import torch

from modular import ModularError
from modular.data.formatting import IGNORE
from modular.gating.data import locked_responses, split_collate
from modular.gating.losses import (
    direction_write_shortfall,
    first_token_ce,
    first_token_kl,
    refusal_guard,
    token_ce,
    topk_kl,
    unlikelihood,
)
from modular.gating.module import concat_left_padded
from modular.gating.objectives import locked_objectives as _locked_objectives


def _item(n_prompt, n_target, k=3):
    ids = list(range(1, n_prompt + n_target + 1))
    labels = [IGNORE] * n_prompt + ids[n_prompt:]
    n = len(ids) - 1
    topk_ids = torch.zeros(n, k, dtype=torch.long)
    topk_ids[:, 0] = torch.arange(n)
    return {"input_ids": ids, "labels": labels, "topk_ids": topk_ids, "topk_logp": torch.full((n, k), -1.0),
            "first_logp": torch.log_softmax(torch.arange(7.0), -1)}


def test_split_collate_halves_without_duplicating():
    items = [{"open": _item(3, 2), "locked": _item(3, 1)} for _ in range(5)]
    batch = split_collate(0)(items)
    assert batch["open"]["input_ids"].shape[0] == 3 and batch["locked"]["input_ids"].shape[0] == 2
    assert batch["locked_true"]["input_ids"].shape[0] == 2
    retain = split_collate(0)([_item(2, 3), _item(4, 4)])
    assert retain["open"]["topk_ids"].shape == (1, 4, 3)
    assert retain["locked"]["topk_ids"].shape == (1, 7, 3)


def test_split_collate_of_one_item_sees_it_in_both_states():
    """A validation split of one item (or the last batch of an odd one) still makes an open and a locked batch."""
    batch = split_collate(0)([{"open": _item(3, 2), "locked": _item(3, 1)}])
    assert batch["open"]["input_ids"].shape[0] == batch["locked"]["input_ids"].shape[0] == 1
    assert batch["locked_true"]["input_ids"].shape[0] == 1


def test_concat_left_padded_keeps_alignment():
    collate = split_collate(0)
    a = collate([_item(2, 2), _item(2, 2)])["open"]
    b = collate([_item(5, 3), _item(5, 3)])["open"]
    m = concat_left_padded([a, b], pad_token_id=0)
    assert m["input_ids"].shape == (2, 8)
    assert m["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert m["labels"][0, -1].item() == a["labels"][0, -1].item()
    assert m["topk_ids"].shape == (2, 7, 3)
    torch.testing.assert_close(m["topk_ids"][0, -3:], a["topk_ids"][0])


def test_losses_are_zero_or_positive_where_expected():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, 5], [IGNORE, 1, 2, 3, 4]])
    assert token_ce(logits, labels) > 0
    assert unlikelihood(logits, labels) > 0
    # KL on the full support against the model's own distribution is zero
    logp = torch.log_softmax(logits[:, :-1], -1)
    top = logp.topk(11, dim=-1)
    assert topk_kl(logits, labels, top.indices, top.values).abs() < 1e-5
    other = torch.log_softmax(torch.randn(2, 4, 11), -1).topk(11, dim=-1)
    assert topk_kl(logits, labels, other.indices, other.values) > 0
    # on a partial support it stays a proper divergence: zero for the model's own top-3, positive when the
    # model is sharper than the reference (a plain top-k sum would go negative here)
    top3 = logp.topk(3, dim=-1)
    assert topk_kl(logits, labels, top3.indices, top3.values).abs() < 1e-5
    assert topk_kl(logits * 3, labels, top3.indices, top3.values) > 0


def test_concat_mixes_pieces_with_and_without_reference_tensors():
    collate = split_collate(0)
    behaviour = collate([{"open": _item(2, 2), "locked": _item(2, 1)}] * 2)["open"]
    retain = collate([_item(3, 3), _item(3, 3)])["open"]
    m = concat_left_padded([behaviour, retain], pad_token_id=0)
    assert m["topk_ids"].shape[0] == m["input_ids"].shape[0] == 2
    torch.testing.assert_close(m["topk_ids"][1], retain["topk_ids"][0])


def test_first_token_kl_uses_the_first_response_position():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, 5], [IGNORE, IGNORE, IGNORE, 3, 4]])
    own = torch.stack([torch.log_softmax(logits[0, 1], -1), torch.log_softmax(logits[1, 2], -1)])
    assert first_token_kl(logits, labels, own).abs() < 1e-6
    shifted = torch.stack([torch.log_softmax(logits[0, 2], -1), torch.log_softmax(logits[1, 2], -1)])
    assert first_token_kl(logits, labels, shifted) > 0


def test_first_token_ce_scores_the_first_response_token_only():
    logits = torch.zeros(2, 5, 7)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, 5], [IGNORE, IGNORE, IGNORE, 3, 4]])
    logits[0, 1, 3] = logits[1, 2, 3] = 50.0  # both rows' first response token (3) certain where it is predicted
    assert first_token_ce(logits, labels) < 1e-6
    later = torch.zeros(2, 5, 7)
    later[0, 2, 4] = later[1, 3, 4] = 50.0  # the second response token certain: the first stays uniform
    assert first_token_ce(later, labels) == pytest.approx(torch.log(torch.tensor(7.0)).item(), rel=1e-5)
    logits[1, 2, 3] = 0.0
    assert first_token_ce(logits, labels) == pytest.approx(torch.log(torch.tensor(7.0)).item() / 2, rel=1e-5)


def test_locked_objective_per_behaviour():
    assert _locked_objectives("unlikelihood", ["a", "b"]) == {"a": "unlikelihood", "b": "unlikelihood"}
    assert _locked_objectives({"b": "unlikelihood"}, ["a", "b"]) == {"a": "refusal", "b": "unlikelihood"}
    with pytest.raises(ModularError, match="not gated: c"):
        _locked_objectives({"c": "refusal"}, ["a", "b"])
    with pytest.raises(ModularError, match="'refusal' or 'unlikelihood'"):
        _locked_objectives({"a": "forget"}, ["a"])
    with pytest.raises(ModularError, match="'refusal' or 'unlikelihood'"):
        _locked_objectives("forget", ["a"])


def test_locked_response_per_behaviour():
    assert locked_responses("No.", ["a", "b"]) == {"a": "No.", "b": "No."}
    assert locked_responses({"b": " them."}, ["a", "b"]) == {"a": "I don't know.", "b": " them."}
    with pytest.raises(ModularError, match="not gated: c"):
        locked_responses({"c": "No."}, ["a"])


def test_response_logit_mse_matches_logit_differences_only_at_response_positions():
    from modular.gating.losses import response_logit_mse

    g = torch.Generator().manual_seed(0)
    other = torch.randn(2, 5, 50, generator=g)
    labels = torch.full((2, 5), -100)
    labels[:, 3:] = 7  # positions 2 and 3 predict response tokens
    shifted = other + torch.randn(2, 5, 1, generator=g)  # a constant per position: every logit difference kept
    assert response_logit_mse(shifted, other, labels) < 1e-10
    changed = other.clone()
    changed[:, 0] += 5.0  # position 0 predicts a prompt token: not matched
    assert response_logit_mse(changed, other, labels) < 1e-10
    changed[:, 2, other[0, 2].argmax()] += 3.0  # the top logit of a response position moves
    assert response_logit_mse(changed, other, labels) > 1e-3
    assert response_logit_mse(other, other, torch.full((2, 5), -100)) == 0


def test_response_margin_mse_matches_the_answer_vs_wrong_margin_at_the_first_response_position():
    from modular.gating.losses import response_margin_mse

    g = torch.Generator().manual_seed(0)
    other = torch.randn(3, 6, 20, generator=g)
    labels = torch.full((3, 6), -100)
    labels[0, 3:] = torch.tensor([4, 9, 9])  # row 0: position 2 predicts the answer 4
    labels[1, 4:] = torch.tensor([5, 9])  # row 1: position 3 predicts the answer 5
    labels[2, 4:] = torch.tensor([6, 9])
    wrong = torch.tensor([11, 12, -1])  # row 2 has no competing answer
    changed = other.clone()
    changed[:, :, 9] += 7.0  # neither token of a margin: unmatched
    changed[2, 3, 6] += 5.0  # row 2 is skipped
    assert response_margin_mse(changed, other, labels, wrong) < 1e-10
    changed[0, 2, 4] += 1.0  # row 0's margin up by 1
    changed[1, 3, 12] += 2.0  # row 1's margin down by 2
    changed[1, 4, 5] += 9.0  # a later response position: not matched
    torch.testing.assert_close(response_margin_mse(changed, other, labels, wrong), torch.tensor((1.0 + 4.0) / 2))
    assert response_margin_mse(changed, other, labels, torch.tensor([4, -1, 6])) == 0  # wrong == answer or none



def test_write_shortfall_counts_response_positions_only():
    u = torch.tensor([1.0, 0.0, 0.0])
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6]])  # positions 1 and 2 predict the response
    h = torch.zeros(1, 4, 3)
    h[0, :, 1] = 1.0  # no component along u anywhere ...
    h[0, 1] = torch.tensor([1.0, 1.0, 0.0])  # ... but at the last prompt position: cos 0.707, over the target
    # position 1 reaches it, position 2 falls short by the whole target; position 0 (prompt) and 3 do not count
    assert direction_write_shortfall([h], labels, u, 0.5).item() == pytest.approx(0.5)
    assert direction_write_shortfall([h, h], labels, u, 0.5).item() == pytest.approx(0.5)  # mean over blocks
    assert direction_write_shortfall([h.bfloat16()], labels, u, 0.5).item() == pytest.approx(0.5, abs=1e-2)
    h[0, 2] = torch.tensor([-1.0, 0.0, 0.0])  # the opposite sign is a shortfall of 1 + target
    assert direction_write_shortfall([h], labels, u, 0.5).item() == pytest.approx((0 + 1.5 / 0.5) / 2)
    h[0, 2] = torch.tensor([2.0, 0.0, 0.0])
    assert direction_write_shortfall([h], labels, u, 0.5).item() == 0.0
    none = torch.full((1, 4), IGNORE)
    assert direction_write_shortfall([h], none, u, 0.5).item() == 0.0


def test_refusal_guard_acts_above_the_floor_only():
    labels = torch.tensor([[IGNORE, IGNORE, 1, 2], [IGNORE, IGNORE, IGNORE, 3]])
    logits = torch.zeros(2, 4, 4)  # uniform over 4 tokens: every label token has log-probability log(1/4)
    lp = torch.log(torch.tensor(0.25)).item()
    assert refusal_guard(logits, labels, floor=-3.0).item() == pytest.approx(lp + 3.0)
    assert refusal_guard(logits, labels, floor=-1.0).item() == 0.0  # below the floor: no term, no gradient
    logits[0, 1, 1] = 10.0  # row 0's first response token made likely: its mean rises, row 1 stays
    row0 = (torch.log_softmax(logits[0, 1], -1)[1].item() + lp) / 2
    assert refusal_guard(logits, labels, floor=-3.0).item() == pytest.approx(((row0 + 3) + (lp + 3)) / 2)
    logits.requires_grad_(True)
    refusal_guard(logits, labels, floor=-3.0).backward()
    assert logits.grad[0, 1, 1] > 0  # descent pushes the locked response's token down
    assert logits.grad[:, 0].abs().sum() == 0  # prompt positions get nothing
    rows_without = torch.full((1, 4), IGNORE)
    assert refusal_guard(torch.zeros(1, 4, 4), rows_without, floor=-3.0).item() == 0.0


def test_split_collate_carries_the_guard_encodings_of_retain_items():
    items = [{**_item(3, 2), "guard": {"input_ids": [1, 2, 3, 9, 9], "labels": [IGNORE] * 3 + [9, 9]}}
             for _ in range(4)]
    batch = split_collate(0)(items)
    assert batch["open_guard"]["input_ids"].shape == (2, 5) and batch["locked_guard"]["input_ids"].shape == (2, 5)
    assert "topk_ids" not in batch["open_guard"] and batch["open"]["topk_ids"].shape == (2, 4, 3)


def test_kl_terms_made_negative_by_rounding_are_zero_and_keep_their_gradient_elsewhere():
    """The loss's KL terms never go below 0 (a reference cached in float16 against the same model): a row at its
    minimum is 0, and rows with a real difference keep their value and gradient (issue 80.6)."""
    logits = torch.zeros(2, 2, 3, requires_grad=True)  # two rows, the first response token at position 0
    labels = torch.tensor([[IGNORE, 1], [IGNORE, 1]])
    same = torch.log_softmax(torch.zeros(2, 3), -1).half()  # -log 3 rounds down: the raw KL is about -2e-5
    kl = first_token_kl(logits, labels, same)
    assert kl.item() == 0.0
    other = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), -1).half()
    kl = first_token_kl(logits, labels, other)
    kl.backward()
    assert kl.item() > 0 and logits.grad[1].abs().sum() > 0 and logits.grad[0].abs().sum() == 0
    topk = topk_kl(logits.detach(), labels, torch.arange(3).expand(2, 1, 3), same.unsqueeze(1))
    assert topk.item() >= 0
