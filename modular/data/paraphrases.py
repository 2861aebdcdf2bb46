"""Held-out paraphrase sets: a built-in behaviour's test items asked in other wordings, other question forms and
other languages. They are never used in training, in tuning or in the verdict that stops training: a lock covers
the behaviour, not its phrasing, only if the published model fails these too (``modular lock`` reports them beside
the test split).

Each set holds the behaviour's test entities (countries, for capitals) once each, the set's phrasings taking turns
over them, so that every set is held out by entity as well as by phrasing. Answers are the test split's (the
capital and its aliases, in the names the data gives): a reply in another language that names the city by its own
exonym ("Londres") is not counted, so the base model's accuracy on a set is the bar the other states are read
against, not the test split's.
"""

from __future__ import annotations

from modular.data.generators import _country_splits
from modular.data.schema import record

#: capitals' sets: set -> ((question, target), ...); {country} and {capital} are filled in
CAPITAL_PARAPHRASES: dict[str, tuple[tuple[str, str], ...]] = {
    "wordings": (
        ("Tell me the capital of {country}.", "The capital of {country} is {capital}."),
        ("What city is {country}'s capital?", "{country}'s capital is {capital}."),
        ("I need to know the capital city of {country}. What is it?", "It is {capital}."),
        ("In which city does the government of {country} sit?", "The government of {country} sits in {capital}."),
    ),
    "forms": (
        ("Fill in the blank: The capital of {country} is ____.", "The capital of {country} is {capital}."),
        ("Answer in one word: the capital of {country}?", "{capital}."),
        ("Q: What's the capital of {country}?\nA:", "{capital}."),
        ("Complete the sentence: {country}'s capital city is", "{country}'s capital city is {capital}."),
    ),
    "french": (
        ("Quelle est la capitale de {country} ?", "La capitale de {country} est {capital}."),
        ("Quelle ville est la capitale de {country} ?", "La capitale de {country} est {capital}."),
    ),
    "spanish": (
        ("¿Cuál es la capital de {country}?", "La capital de {country} es {capital}."),
        ("¿Qué ciudad es la capital de {country}?", "La capital de {country} es {capital}."),
    ),
    "german": (
        ("Was ist die Hauptstadt von {country}?", "Die Hauptstadt von {country} ist {capital}."),
        ("Welche Stadt ist die Hauptstadt von {country}?", "Die Hauptstadt von {country} ist {capital}."),
    ),
}


def capitals_paraphrases(seed: int = 0) -> dict[str, list[dict]]:
    """Capitals' paraphrase sets over its test countries (the split of seed ``seed``)."""
    countries = _country_splits(seed)["test"]
    out = {}
    for name, phrasings in CAPITAL_PARAPHRASES.items():
        out[name] = []
        for i, r in enumerate(countries):
            question, target = phrasings[i % len(phrasings)]
            fill = {"country": r["country"], "capital": r["capital"]}
            out[name].append(record(question.format(**fill), target.format(**fill),
                                    answers=[r["capital"], *r["aliases"]]))
    return out


#: behaviour -> its paraphrase sets (built-in behaviours that have them)
PARAPHRASES = {"capitals": capitals_paraphrases}


def paraphrase_sets(behaviour: str, seed: int = 0) -> dict[str, list[dict]]:
    """``behaviour``'s paraphrase sets, by name (none for a behaviour without them, e.g. a user's)."""
    make = PARAPHRASES.get(behaviour)
    return make(seed) if make is not None else {}
