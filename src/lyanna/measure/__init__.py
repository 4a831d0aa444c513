"""Measurement: ``lyanna bench`` (every method on the same prompts, one timer), the peers it
compares against (Hugging Face ``generate()``, llama.cpp), and ``lyanna report``."""
