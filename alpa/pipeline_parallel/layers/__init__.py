"""Layers: the traced step cut into layers, the unit the stage DP assigns to stages.

Entry point: :func:`alpa.pipeline_parallel.layers.layer_construction.construct_layers`
(manual markers or ``AutoLayerOption``'s clustering). The modules:
``layer_construction`` (Alpa's ``AutoLayerOption`` / ``ManualLayerOption`` and
``alpa.grad``'s rewrite), ``layer_clustering``, ``segments``, ``layer_scans`` (a scan
over identical layers kept as rows), ``stacked_rows``, ``remat``.

Imports none of the other sub-packages.
"""
