"""Behaviour data: built-in generators, user JSONL, formatting and the DataModule."""

from modular.data.behaviours import (
    BEHAVIOURS,
    behaviour_name,
    load_behaviour,
    neutral_text,
    parse_behaviour,
    retain_data,
)
from modular.data.jsonl import load_jsonl

__all__ = ["BEHAVIOURS", "behaviour_name", "load_behaviour", "load_jsonl", "neutral_text", "parse_behaviour",
           "retain_data"]
