"""Helpers shared by the repository's tests (not tests themselves)."""
