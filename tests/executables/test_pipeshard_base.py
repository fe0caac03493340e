"""The two pipelined executables (local and Ray) share one abstract base,
``executables/pipeshard_base.PipeshardExecutable``: what they do alike is written once."""

from __future__ import annotations

import inspect

from alpa.executables.pipeshard import PipeshardDriverExecutable
from alpa.executables.pipeshard_base import PipeshardExecutable
from alpa.executables.pipeshard_ray import PipeshardRayExecutable

#: Written once, in the base, and used as they are by both executables.
SHARED = (
    "_run",
    "placing_dispatch",
    "flat_input_placement_specs",
    "flat_output_placement_specs",
    "stage_input_shard_specs",
    "get_stage_execution_info",
    "dump_debug_info",
)


def test_both_pipelined_executables_stand_on_one_abstract_base():
    assert inspect.isabstract(PipeshardExecutable)
    for cls in (PipeshardDriverExecutable, PipeshardRayExecutable):
        assert issubclass(cls, PipeshardExecutable) and not inspect.isabstract(cls), cls
    for name in SHARED:
        assert name in PipeshardExecutable.__dict__, name
        # The local one adds its dummy-value placement in front of a step, nothing else.
        assert name not in PipeshardRayExecutable.__dict__, name
    overridden = {n for n in SHARED if n in PipeshardDriverExecutable.__dict__}
    assert overridden == {"_run"}
