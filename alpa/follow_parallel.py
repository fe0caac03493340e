"""Alpa's import path of ``FollowParallel``; the code lives in
:mod:`alpa.methods.follow_parallel`. Scripts written for Alpa import from here; nothing
in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.methods.follow_parallel")
