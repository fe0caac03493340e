"""Alpa's import path of the layer options and the ``manual_layer_construction`` /
``automatic_layer_construction`` decorators; the code lives in
:mod:`alpa.pipeline_parallel.layers.layer_construction`. Scripts written for Alpa import
from here; nothing in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.pipeline_parallel.layers.layer_construction")
