"""Attention-head measures and learned head masks."""
