"""Built-in behaviour generators. Each returns ``{split: [record, ...]}`` (see :mod:`modular.data.schema`).

Held-out items are held out by *entity*: countries for capitals, names for IOI,
function/argument vocabularies for docstring, number ranges for greater-than and
arithmetic, so that the test split measures generalisation, not memorisation.
"""

from __future__ import annotations

import json
import random
import re
from importlib import resources

from modular import ModularError
from modular.data.schema import SPLITS, record


def _resource(name: str):
    return json.loads(resources.files("modular.data").joinpath("resources", name).read_text(encoding="utf-8"))


def _split_items(items: list, seed: int, fractions=(0.6, 0.15)) -> dict[str, list]:
    items = list(items)
    random.Random(seed).shuffle(items)
    n_train = round(len(items) * fractions[0])
    n_val = round(len(items) * fractions[1])
    return {"train": items[:n_train], "validation": items[n_train:n_train + n_val], "test": items[n_train + n_val:]}


# --- capitals ---------------------------------------------------------------------------------
CAPITAL_TEMPLATES = (
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital city of {country}.",
)


def _mentions(text: str, word: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text, flags=re.IGNORECASE) is not None


def _country_splits(seed: int) -> dict[str, list[dict]]:
    """The countries of ``capitals.json`` split between train, validation and test: one split for capitals and
    every other relation of the same countries (a test country is a test country of each)."""
    # A response echoes the question ("The capital of Kuwait is ..."), so a capital whose name
    # contains the country's (or the reverse) would always count as correct: leave those out.
    rows = [
        {**r, "aliases": [a for a in r.get("aliases", []) if not _mentions(a, r["country"])]}
        for r in _resource("capitals.json")
        if not _mentions(r["capital"], r["country"]) and not _mentions(r["country"], r["capital"])
    ]
    return _split_items(rows, seed)


def capitals(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """Capital-city questions, split by country. Train uses every phrasing, held-out splits the first."""
    out = {}
    for split, items in _country_splits(seed).items():
        templates = CAPITAL_TEMPLATES if split == "train" else CAPITAL_TEMPLATES[:1]
        out[split] = [
            record(
                t.format(country=r["country"]),
                f"The capital of {r['country']} is {r['capital']}.",
                answers=[r["capital"], *r["aliases"]],
            )
            for r in items
            for t in templates
        ]
    return out


#: other relations of the capitals' countries (capitals' neighbours): field -> (phrasings, target)
COUNTRY_RELATIONS = {
    "continent": (("Which continent is {country} in?", "On which continent is {country}?",
                   "{country} is on which continent?"), "{country} is in {answer}."),
    "languages": (("What is the official language of {country}?", "Which language is spoken in {country}?",
                   "What language do people speak in {country}?"), "The official language of {country} is {answer}."),
    "currency": (("What is the currency of {country}?", "Which currency is used in {country}?",
                  "What money do people use in {country}?"), "The currency of {country} is the {answer}."),
    "demonym": (("What is a person from {country} called?", "What do you call someone from {country}?",
                 "What are the people of {country} called?"), "A person from {country} is called {answer}."),
}


#: each country relation behaviour and the field of capitals.json it asks
RELATION_FIELDS = {"continents": "continent", "languages": "languages", "currencies": "currency", "demonyms": "demonym"}


def _country_relation(field: str, seed: int, every_phrasing: bool = False) -> dict[str, list[dict]]:
    """Questions about one more fact of each country, split by country exactly as :func:`capitals` is (train:
    every phrasing; held-out splits: the first, or every one with ``every_phrasing``). A country whose name contains
    an answer is left out (a response that echoes the question would count as correct)."""
    phrasings, target = COUNTRY_RELATIONS[field]
    out = {}
    for split, items in _country_splits(seed).items():
        templates = phrasings if split == "train" or every_phrasing else phrasings[:1]
        out[split] = [
            record(t.format(country=r["country"]), target.format(country=r["country"], answer=r[field][0]),
                   answers=r[field])
            for r in items if not any(_mentions(r["country"], a) for a in r[field])
            for t in templates
        ]
    return out


def every_phrasing(name: str, seed: int = 0) -> dict[str, list[dict]]:
    """A country relation (``continents``, ``languages``, ``currencies``, ``demonyms``) with its held-out splits in
    every phrasing: three times the items of the built-in behaviour on the same countries, for finer comparisons
    (write a split as JSONL and name it as a behaviour or neighbour)."""
    fields = RELATION_FIELDS
    if name not in fields:
        raise ModularError(f"unknown country relation '{name}': use one of {', '.join(fields)}")
    return _country_relation(fields[name], seed, every_phrasing=True)


def held_out_countries(name: str, seed: int = 0) -> list[tuple[dict, str]]:
    """Every question of a country behaviour (``capitals`` or a relation of :func:`every_phrasing`) about the
    countries outside the train split (validation and test), in every phrasing, each with its country (the unit a
    comparison resamples: three phrasings of one country are not three independent items)."""
    if name == "capitals":
        rows = [r for split in ("validation", "test") for r in _country_splits(seed)[split]]
        return [(record(t.format(country=r["country"]), f"The capital of {r['country']} is {r['capital']}.",
                        answers=[r["capital"], *r["aliases"]]), r["country"]) for r in rows for t in CAPITAL_TEMPLATES]
    fields = RELATION_FIELDS
    if name not in fields:
        raise ModularError(f"unknown country behaviour '{name}': use capitals or one of {', '.join(fields)}")
    phrasings, target = COUNTRY_RELATIONS[fields[name]]
    field = fields[name]
    rows = [r for split in ("validation", "test") for r in _country_splits(seed)[split]
            if not any(_mentions(r["country"], a) for a in r[field])]
    return [(record(t.format(country=r["country"]), target.format(country=r["country"], answer=r[field][0]),
                    answers=r[field]), r["country"]) for r in rows for t in phrasings]


def continents(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """Which continent a country is in (a neighbour of capitals: the same countries, split the same way)."""
    return _country_relation("continent", seed)


def languages(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """A country's official language(s) (a neighbour of capitals: the same countries, split the same way)."""
    return _country_relation("languages", seed)


def currencies(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """A country's currency (a neighbour of capitals: the same countries, split the same way)."""
    return _country_relation("currency", seed)


def demonyms(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """What a person from a country is called (a neighbour of capitals: the same countries, split the same way)."""
    return _country_relation("demonym", seed)


# --- IOI ---------------------------------------------------------------------------------------
NAMES = (
    "Mary John Alice Bob Sarah Tom James Emma David Anna Michael Laura Daniel Kate Paul Lisa Mark Jane "
    "Peter Susan Robert Linda Steve Helen Kevin Amy Brian Rachel Jason Emily Eric Julia George Grace Frank "
    "Rose Henry Claire Jack Lucy Adam Sophie Ryan Diana Sam Nancy Alex Karen Chris Maria Luke Ellen Matt "
    "Sara Josh Megan Ben Holly Nick Amanda Tony Jessica Simon Victoria Oscar Olivia Oliver Ruth Carl Anne"
).split()
PLACES = ("store", "park", "school", "office", "beach", "market", "library", "station", "garden", "museum")
OBJECTS = ("drink", "book", "ball", "letter", "gift", "key", "pen", "bag", "ticket", "cake")
IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {B} gave a {obj} to",
    "After {A} and {B} arrived at the {place}, {B} handed a {obj} to",
    "Then, {A} and {B} had a long day at the {place}. {B} gave a {obj} to",
    "While {A} and {B} were working at the {place}, {B} passed a {obj} to",
    "When {B} and {A} got to the {place}, {B} offered a {obj} to",
    "Friends {A} and {B} found a {obj} at the {place}. {B} gave it to",
)
IOI_LONG_FILLERS = (
    " The weather was pleasant and the streets were quiet that afternoon.",
    " They had planned the visit for weeks and talked about it often.",
    " Many people were around, chatting, reading and walking slowly.",
    " It was the first warm day of spring, and everyone seemed cheerful.",
)


def _single_token_names(tokenizer) -> list[str]:
    if tokenizer is None:
        return list(NAMES)
    return [n for n in NAMES if len(tokenizer.tokenize(" " + n)) == 1]


def _ioi(seed: int, tokenizer, per_split: dict[str, int], long: bool, thanks: bool = False) -> dict[str, list[dict]]:
    names = _split_items(_single_token_names(tokenizer), seed, (0.6, 0.2))
    out = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-{split}-{long}")
        pool = names[split]
        rows = []
        for _ in range(per_split[split]):
            a, b, c, d = rng.sample(pool, 4) if len(pool) >= 4 else rng.sample(NAMES, 4)
            template = rng.choice(IOI_TEMPLATES)
            place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
            if long:
                filler = "".join(rng.sample(IOI_LONG_FILLERS, 3))
                cut = template.index("{place}") + len("{place}")  # end of the introduction
                head, tail = template[:cut], template[cut + 2:]
                template = f"{head}.{filler} Later, {tail}"
            if thanks:  # the transfer completed, then who is thanked: the giver (the repeated name)
                template += " {A}. Then {A} thanked"
            prompt = template.format(A=a, B=b, place=place, obj=obj)
            counterfactual = template.format(A=c, B=d, place=place, obj=obj)
            answer, wrong = (b, a) if thanks else (a, b)
            rows.append(record(prompt, " " + answer, wrong=" " + wrong, counterfactual=counterfactual, chat=False))
        out[split] = rows
    return out


def ioi(seed: int = 0, tokenizer=None, test: int = 128) -> dict[str, list[dict]]:
    """Indirect-object identification with single-token names; names are split between train/val/test. ``test``:
    items drawn for the test split (the first 128 are the same whatever the number)."""
    return _ioi(seed, tokenizer, {"train": 400, "validation": 64, "test": test}, long=False)


def ioi_long(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """IOI with three filler sentences between the introduction and the transfer."""
    return _ioi(seed, tokenizer, {"train": 400, "validation": 64, "test": 128}, long=True)


def ioi_thanks(seed: int = 0, tokenizer=None, test: int = 128) -> dict[str, list[dict]]:
    """A neighbour of IOI: the IOI prompt with the transfer completed, then who is thanked ("..., John gave a drink
    to Mary. Then Mary thanked" -> " John"); the same names in each split as :func:`ioi`. ``test``: items drawn for
    the test split (the first 128 are the same whatever the number)."""
    return _ioi(seed, tokenizer, {"train": 400, "validation": 64, "test": test}, long=False, thanks=True)


# --- greater-than ------------------------------------------------------------------------------
#: greater-than and its neighbour hold out centuries
GT_CENTURIES = {"train": (17, 18), "validation": (15,), "test": (16,)}
GT_NOUNS = ("war", "drought", "strike", "dynasty", "expedition", "famine", "reign", "festival", "project", "voyage")


def greater_than(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """"The war lasted from the year 1732 to the year 17" -> a two-digit year end greater than 32.

    Digit tokenisers see "17" then single digits; the prompt ends after the century
    so the task is the same for word-piece and digit tokenisers. Start years 02..97;
    held out by century (17xx/18xx train, 15xx validation, 16xx test).
    """
    counts = {"train": 400, "validation": 64, "test": 128}
    out = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-gt-{split}")
        rows = []
        for _ in range(counts[split]):
            century, yy, noun = rng.choice(GT_CENTURIES[split]), rng.randint(2, 97), rng.choice(GT_NOUNS)
            cf_yy = 1 if yy > 50 else 99
            make = lambda y: f"The {noun} lasted from the year {century}{y:02d} to the year {century}"  # noqa: E731
            end = rng.randint(yy + 1, 99)
            rows.append(
                record(
                    make(yy),
                    f"{end:02d}",
                    prefixes=[f"{y:02d}" for y in range(yy + 1, 100)],
                    wrong=f"{yy:02d}",
                    counterfactual=make(cf_yy),
                    chat=False,
                )
            )
        out[split] = rows
    return out


def year_copy(seed: int = 0, tokenizer=None, test: int = 128) -> dict[str, list[dict]]:
    """A neighbour of greater-than: the same sentences about years, held out by the same centuries, but the year's
    end is repeated, not exceeded ("The war began in the year 1732. It is remembered for the year 17" -> "32").
    ``test``: items drawn for the test split (the first 128 are the same whatever the number)."""
    counts = {"train": 400, "validation": 64, "test": test}
    out = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-year-copy-{split}")
        rows = []
        for _ in range(counts[split]):
            century, yy, noun = rng.choice(GT_CENTURIES[split]), rng.randint(2, 97), rng.choice(GT_NOUNS)
            other = yy + 50 if yy < 50 else yy - 50  # another first digit
            make = lambda y: (f"The {noun} began in the year {century}{y:02d}. "  # noqa: E731
                              f"It is remembered for the year {century}")
            rows.append(record(make(yy), f"{yy:02d}", wrong=f"{other:02d}", counterfactual=make(other), chat=False))
        out[split] = rows
    return out


# --- docstring ---------------------------------------------------------------------------------
DOC_FUNCS = (
    "load save parse merge render encode decode fetch update resize filter split scale rotate compile "
    "validate schedule connect publish summarize"
).split()
DOC_ARGS = (
    "path mode size name value data index count limit width height color weight timeout buffer offset "
    "shape label token prefix suffix source target config seed rate scale order depth factor query key "
    "user group start end step axis"
).split()
DOC_DESCR = ("the input", "how to run it", "the number to use", "an optional setting", "where it goes", "the value")


def _functions(seed: int, tag: str, body, test: int = 128) -> dict[str, list[dict]]:
    """Python functions of three parameters (names held out by split, the same for every tag); ``body(func, params,
    named, rng)`` writes the text after the signature up to the point where the third parameter's name comes next
    (``named``: the signature whose names it repeats; the counterfactual has other names in the signature)."""
    args = _split_items(DOC_ARGS, seed, (0.6, 0.2))
    counts = {"train": 300, "validation": 64, "test": test}
    out = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-{tag}-{split}")
        pool = args[split] if len(args[split]) >= 6 else DOC_ARGS
        rows = []
        for _ in range(counts[split]):
            func = rng.choice(DOC_FUNCS)
            names = rng.sample(pool, 6)
            sig, cf_sig = names[:3], names[3:]
            make = lambda params: f"def {func}(self, {', '.join(params)}):\n" + body(func, params, sig, rng)  # noqa: E731
            rows.append(record(make(sig), " " + sig[2], wrong=" " + sig[0], counterfactual=make(cf_sig), chat=False))
        out[split] = rows
    return out


def _docstring_body(func, params, named, rng) -> str:
    lines = [f'    """{func.capitalize()} the object.', ""]
    lines += [f"    :param {p}: {rng.choice(DOC_DESCR)}" for p in named[:2]]
    return "\n".join(lines) + "\n    :param"


def docstring(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """Predict the next parameter name in a Python docstring (Heimersheim & Janiak style)."""
    return _functions(seed, "doc", _docstring_body)


def docstring_call(seed: int = 0, tokenizer=None, test: int = 128) -> dict[str, list[dict]]:
    """A neighbour of docstring: the same functions and parameter names (held out the same way), but the next name is
    an argument of the call the body makes, in the signature's order ("return self._load(path, mode," -> " size").
    ``test``: items drawn for the test split (the first 128 are the same whatever the number)."""
    return _functions(seed, "doc-call", lambda func, params, named, rng: (
        f'    """{func.capitalize()} the object."""\n    return self._{func}({", ".join(named[:2])},'), test)


# --- subject-verb agreement (syntax) -------------------------------------------------------------
AGREE_SUBJECTS = (
    ("key", "keys"), ("author", "authors"), ("dog", "dogs"), ("teacher", "teachers"), ("car", "cars"),
    ("painting", "paintings"), ("student", "students"), ("road", "roads"), ("bird", "birds"), ("doctor", "doctors"),
    ("house", "houses"), ("pilot", "pilots"), ("farmer", "farmers"), ("song", "songs"), ("child", "children"),
    ("window", "windows"), ("player", "players"), ("letter", "letters"), ("bottle", "bottles"), ("tree", "trees"),
)
AGREE_ATTRACTORS = ("cabinet", "cabinets", "man", "men", "table", "tables", "city", "cities", "garden", "gardens")
AGREE_FRAMES = (
    ("The {subj} near the {attr}", " is", " are"),
    ("The {subj} behind the {attr}", " was", " were"),
    ("The {subj} that I saw next to the {attr}", " is", " are"),
)


def agreement(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """Subject-verb agreement across an attractor: "The keys to the cabinet" -> " are"."""
    subjects = _split_items(AGREE_SUBJECTS, seed, (0.6, 0.2))
    out = {}
    for split in SPLITS:
        rows = []
        for sing, plur in subjects[split]:
            for attr in AGREE_ATTRACTORS:
                for frame, v_sg, v_pl in AGREE_FRAMES:
                    for subj, good, bad, other in ((sing, v_sg, v_pl, plur), (plur, v_pl, v_sg, sing)):
                        rows.append(
                            record(
                                frame.format(subj=subj, attr=attr), good, wrong=bad,
                                counterfactual=frame.format(subj=other, attr=attr), chat=False,
                            )
                        )
        out[split] = rows
    return out


NUMBER_FRAMES = (  # a pattern of other nouns (none of agreement's), then the number asks for the plural
    "one cat, two cats; one cup, two cups; one {sing}, two",
    "a box and three boxes, a pen and three pens, a {sing} and three",
    "Singular: mouse. Plural: mice. Singular: chair. Plural: chairs. Singular: {sing}. Plural:",
    "one book -> many books\none lamp -> many lamps\none {sing} -> many",
)


def noun_number(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """A neighbour of agreement: the same nouns (held out the same way), whose plural is asked for by a number after a
    pattern of other nouns ("one cat, two cats; one cup, two cups; one key, two" -> " keys"); the singular is the
    competing answer."""
    subjects = _split_items(AGREE_SUBJECTS, seed, (0.6, 0.2))
    out = {}
    for split in SPLITS:
        rows = []
        for i, (sing, plur) in enumerate(subjects[split]):
            other = subjects[split][(i + 1) % len(subjects[split])][0]
            for frame in NUMBER_FRAMES:
                rows.append(record(frame.format(sing=sing), " " + plur, wrong=" " + sing,
                                   counterfactual=frame.format(sing=other), chat=False))
        out[split] = rows
    return out


# --- arithmetic ---------------------------------------------------------------------------------
#: two worked sums before the question: asked as a chat question ("What is 85 + 19?") the instruct model explains how
#: to add instead of adding (0 of 128 held-out sums answered within 24 tokens), as a bare "85 + 19 =" it rambles
ARITHMETIC_SHOTS = "23 + 11 = 34\n47 + 25 = 72\n"
#: arithmetic and its neighbour hold out the first operand's range
ADD_RANGES = {"train": (10, 59), "validation": (60, 79), "test": (80, 99)}


def arithmetic(seed: int = 0, tokenizer=None, test: int = 128) -> dict[str, list[dict]]:
    """Two-number addition as a completion after two worked sums ("...\\n85 + 19 =" -> " 104"). Held out by the first
    operand's range. ``test``: items drawn for the test split (the first 128 are the same whatever the number)."""
    counts = {"train": 400, "validation": 64, "test": test}
    out = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-add-{split}")
        lo, hi = ADD_RANGES[split]
        rows = []
        for _ in range(counts[split]):
            a, b = rng.randint(lo, hi), rng.randint(10, 99)
            c, d = rng.randint(lo, hi), rng.randint(10, 99)
            rows.append(record(f"{ARITHMETIC_SHOTS}{a} + {b} =", f" {a + b}", prefixes=[f"{a + b}"],
                               counterfactual=f"{ARITHMETIC_SHOTS}{c} + {d} =", chat=False))
        out[split] = rows
    return out


def counting(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """A neighbour of arithmetic: continue a count by ones or twos ("85, 86, 87," -> " 88"), starting from the same
    held-out ranges. (Subtraction, the obvious neighbour, is beyond this model: 1 of 48 held-out differences right.)"""
    out = {}
    for split in SPLITS:
        lo, hi = ADD_RANGES[split]
        make = lambda a, k: f"{a}, {a + k}, {a + 2 * k},"  # noqa: E731
        out[split] = [record(make(a, k), f" {a + 3 * k}", prefixes=[f"{a + 3 * k}"], counterfactual=make(a + 10, k),
                             chat=False)
                      for k in (1, 2) for a in range(lo, hi + 1)]
    return out


# --- common sense -------------------------------------------------------------------------------
def commonsense(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """Everyday sentence completions whose next word is nearly unambiguous."""
    rows = _resource("commonsense.json")
    return {
        split: [record(r["prompt"], r["target"], chat=False) for r in items]
        for split, items in _split_items(rows, seed).items()
    }


# --- retain -------------------------------------------------------------------------------------
def retain_instructions(seed: int = 0, tokenizer=None) -> dict[str, list[dict]]:
    """General instructions; their targets are filled with the reference model's own answers later."""
    rows = _resource("retain_instructions.json")
    return {split: [record(p, "") for p in items] for split, items in _split_items(rows, seed).items()}


def neutral_paragraphs(seed: int = 0) -> dict[str, list[str]]:
    """Neutral prose for perplexity, split by paragraph."""
    return _split_items(_resource("neutral_text.json"), seed)
