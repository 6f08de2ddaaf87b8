"""Inference pipelines under test (the golden tests in max_tests/ run them)."""
