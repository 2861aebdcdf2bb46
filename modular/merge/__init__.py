"""Merge gain: activation communication, weight merging and activation-space similarity."""
