"""Drafters: each proposes ``DraftTree`` objects for the shared speculative loop (``base``), and the
registry makes them methods. Importing the package registers the built-in ones."""
from . import eagle, lyanna, suffix  # noqa: F401 (registers them)
