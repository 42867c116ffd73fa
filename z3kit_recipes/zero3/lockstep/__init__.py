"""Calls that run every rank in lockstep (a feature: given an ``EngineCore``, never the facade).

- ``join``: ``engine.join()``, ranks with different numbers of batches;
- ``generate``: ``engine.generate(..., rank=r)``, Hugging Face generation on every rank.
"""
