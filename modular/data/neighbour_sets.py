"""The sets the lock evaluation scores a neighbour on: as many independent held-out items as the data allows, each
with its unit (what a paired comparison resamples as one).

A neighbour's built-in test split holds 40-128 items, too few to tell a lock's move from noise (random weight noise
at a run's retain KL moves such figures by 2-3 points). The report sets are larger where the data allows:

- the country relations (capitals, continents, languages, currencies, demonyms) ask about every country outside
  the train split (validation and test countries: no run trains on them), in every phrasing; the unit is the
  country, so three phrasings of one country count once;
- the generated tasks (IOI's thanks, the year copy, the docstring call; IOI and arithmetic, two of the far guards
  a behaviour without neighbours keeps) draw :data:`GENERATED_ITEMS` distinct test items from the same held-out
  names, centuries and operand ranges; each item is its own unit;
- every other neighbour (a user's JSONL, a hub dataset, a built-in whose data is fixed) is its test split, each
  item its own unit.

Training never sees these sets; its validation split only displays neighbours (it does not stop on them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modular.data import generators as g
from modular.data.behaviours import load_behaviour, parse_behaviour
from modular.data.schema import to_dataset_dict

if TYPE_CHECKING:
    import datasets

#: distinct test items drawn for a generated neighbour's report set
GENERATED_ITEMS = 384
#: the country behaviours, whose report sets are every held-out country in every phrasing
COUNTRY_BEHAVIOURS = ("capitals", "continents", "languages", "currencies", "demonyms")
#: the generated neighbours whose test split can be drawn larger
GENERATED = {"ioi_thanks": g.ioi_thanks, "year_copy": g.year_copy, "docstring_call": g.docstring_call,
             "ioi": g.ioi, "arithmetic": g.arithmetic}  # the last two: far guards kept as a user's neighbours


def report_set(spec: str, seed: int = 0, tokenizer=None) -> tuple[datasets.Dataset, list[str]]:
    """The items a neighbour (a behaviour spec: built-in, ``.jsonl``, ``hf:``, ``NAME=source``) is scored on in the
    lock evaluation, and each item's unit (items of one unit are resampled together)."""
    source = parse_behaviour(spec)[1]
    if source in COUNTRY_BEHAVIOURS:
        pairs = g.held_out_countries(source, seed)
        return _dataset([r for r, _ in pairs]), [unit for _, unit in pairs]
    if source in GENERATED:
        drawn = GENERATED[source](seed=seed, tokenizer=tokenizer, test=2 * GENERATED_ITEMS)["test"]
        rows = list({r["prompt"]: r for r in drawn}.values())[:GENERATED_ITEMS]  # each prompt once, in draw order
        return _dataset(rows), [r["prompt"] for r in rows]
    test = load_behaviour(spec, seed=seed, tokenizer=tokenizer)["test"]
    return test, [str(i) for i in range(len(test))]


def _dataset(rows: list[dict]) -> datasets.Dataset:
    return to_dataset_dict({"test": rows})["test"]
