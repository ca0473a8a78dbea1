"""Hostile and broken checkpoints, generated from genuine ones: one module per family
(``pickles``, ``paths``, ``damage``), each a ``CASES`` table of generator functions."""
