"""Alpa's import path of ``CreateStateParallel``; the code lives in
:mod:`alpa.methods.create_state_parallel`. Scripts written for Alpa import from here;
nothing in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.methods.create_state_parallel")
