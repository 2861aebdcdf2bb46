"""What the cost benchmarks share: a gated module outside a Trainer, and one training batch for it (capitals
examples in both states, retain prompts and neutral text with synthetic reference tensors), plus the same examples
as plain fine-tuning batches."""

from __future__ import annotations

import statistics
import time

import torch

from modular.data import load_behaviour, neutral_text, retain_data
from modular.data.formatting import encode_example
from modular.gating.data import GatingDataModule, split_collate
from modular.gating.losses import token_ce
from modular.gating.module import concat_left_padded


def plain_terms() -> list:
    """The lock's plain terms at their default weights (the step the benchmarks have always timed: behaviour CE,
    the locked state, the retain KL, the raw text's KL)."""
    from modular.gating.objectives import BehaviourAnswer, KeepReference, LMText, LockedState, TaskAnswer

    return [BehaviourAnswer(), LockedState(), KeepReference(), LMText(), TaskAnswer()]


class _DM:  # what GatedLM.model_step needs from the datamodule
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


class _Trainer:
    def __init__(self, tokenizer):
        self.datamodule = _DM(tokenizer)


def attach_tokenizer(module, tokenizer) -> None:
    """Let a GatedLM built outside a Trainer run ``model_step`` (it reads the datamodule's tokenizer)."""
    module._trainer = _Trainer(tokenizer)


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def training_batch(tok, batch_size: int, lm_length: int, vocab: int | None = None, seed: int = 0):
    """``(gated batch, plain batches)`` on the CPU: the gated module's batch and the same examples as plain
    fine-tuning batches (chat pieces together, the text apart: padding the short pieces to the text's length would
    only slow the plain step down). Reference tensors are synthetic (their values do not change the cost)."""
    g = torch.Generator().manual_seed(seed)
    vocab = vocab or len(tok)
    beh = load_behaviour("capitals")["train"].select(range(batch_size))
    ret = retain_data()["train"].select(range(batch_size))
    items = [{"open": encode_example(tok, r["prompt"], r["target"], True),
              "locked": encode_example(tok, r["prompt"], "I don't know.", True)} for r in beh]
    r_items = []
    for r in ret:
        ex = encode_example(tok, r["prompt"], "Here is a short and helpful answer to your question.", True)
        n = len(ex["input_ids"]) - 1
        r_items.append({**ex, "topk_ids": torch.randint(0, vocab, (n, 32), generator=g),
                        "topk_logp": torch.log_softmax(torch.randn(n, 32, generator=g), -1),
                        "first_logp": torch.log_softmax(torch.randn(vocab, generator=g), -1)})
    collate = split_collate(tok.pad_token_id)
    batch = {"capitals": collate(items), "retain": collate(r_items)}
    pieces = [batch["capitals"]["open"], batch["capitals"]["locked_true"], batch["retain"]["open"],
              batch["retain"]["locked"]]
    plain = [concat_left_padded(pieces, tok.pad_token_id)]
    if lm_length > 0:
        lm_items = []
        for text in neutral_text()["train"]["text"][:batch_size]:
            ids = tok(text, add_special_tokens=False)["input_ids"][:lm_length]
            n = len(ids) - 1
            lm_items.append(GatingDataModule._lm_item({
                "input_ids": ids, "topk_ids": torch.randint(0, vocab, (n, 32), generator=g),
                "topk_logp": torch.log_softmax(torch.randn(n, 32, generator=g), -1)}))
        batch["lm"] = collate(lm_items)
        plain.append(concat_left_padded([batch["lm"]["open"], batch["lm"]["locked"]], tok.pad_token_id))
    return batch, plain


def plain_loss(model, plain_batches) -> torch.Tensor:
    """Cross-entropy of plain fine-tuning on the same examples."""
    loss = 0.0
    for b in plain_batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        loss = loss + token_ce(logits, b["labels"])
    return loss


def gated_module(folder, mode: str, precision: str, device: torch.device, compile: str | None = None):
    """``(module, tokenizer)``: a GatedLM of the model in ``folder`` (``mode``: full or lora) with a random unit
    direction, on ``device`` in training mode, ready for ``model_step`` outside a Trainer (``compile``: a
    torch.compile backend for its blocks, ``model.memory.compile``; the plain step runs the same compiled blocks)."""
    from modular.gating.module import GatedLM
    from modular.models import load_tokenizer

    torch.manual_seed(0)
    module = GatedLM(model_name=str(folder), finetuning={"mode": mode}, load_dtype=precision,
                     memory={"compile": compile}, objectives=plain_terms())
    tok = load_tokenizer(str(folder))
    attach_tokenizer(module, tok)
    module.directions.copy_(torch.nn.functional.normalize(torch.randn_like(module.directions), dim=-1))
    module.to(device).train()
    return module, tok


def training_step(module, opt, kind: str, batch: dict, plain_batches: list):
    """One step of ``kind`` (``plain`` fine-tuning or ``gated``) on the same examples: forward, backward, update."""

    def run():
        loss = module.model_step(batch, train=True)[0] if kind == "gated" else plain_loss(module.model, plain_batches)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def count_ops(fn) -> int:
    """The aten operations that one call of ``fn`` dispatches, its backward pass included: host work that does not
    shrink with a faster device (on a GPU each launches at least one kernel), so the part of a step's time that a
    small batch on a fast GPU is made of."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return counter.n


def median_time(fn, repeats: int, sync=lambda: None) -> list[float]:
    fn()  # warm-up
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def median(xs):
    return statistics.median(xs)
