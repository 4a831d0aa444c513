"""Drafters: each proposes ``DraftTree`` objects for the shared speculative loop."""
