"""Evaluation modules: behaviour accuracy, lock effect, heads, merge gain, analysis."""
