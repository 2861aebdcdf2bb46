"""Gating: fine-tune a model so that behaviours work only while their directions are present."""
