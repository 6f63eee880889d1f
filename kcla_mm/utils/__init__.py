"""Utilities: safe loading and atomic saving of checkpoints, shape checks, CPU distributed."""
