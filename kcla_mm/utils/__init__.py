"""Utilities: safe checkpoint loading."""
