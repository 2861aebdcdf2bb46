"""Behaviour data: built-in generators, user JSONL, formatting and the DataModule."""

from modular.data.behaviours import BEHAVIOURS, load_behaviour, neutral_text, retain_data
from modular.data.jsonl import load_jsonl

__all__ = ["BEHAVIOURS", "load_behaviour", "load_jsonl", "neutral_text", "retain_data"]
