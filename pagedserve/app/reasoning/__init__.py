"""Reasoning output (``--reasoning-parser``): a reply's ``<think>...</think>`` part apart from its answer."""
