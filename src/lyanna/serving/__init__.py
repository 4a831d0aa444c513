"""Serving: the OpenAI-compatible HTTP server around one ``Decoder``, and a load test for it."""
