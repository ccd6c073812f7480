"""pytest fixtures of tests/python (the harness is harness.py)."""

from harness import served_factory  # noqa: F401
