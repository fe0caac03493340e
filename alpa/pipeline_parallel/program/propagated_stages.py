"""Stages left to XLA's sharding propagation: ``AutoShardingOption(enable_auto_sharding=False)``.

As in Alpa, a pipeline stage whose option turns auto-sharding off is not planned: its
values take the shardings XLA's propagation derives from the user's pins
(``ManualShardingOption``, ``pipeline_intermediate_axes``). A value with no pin enters the
stage replicated; with no pin at all the stage runs replicated on every device of its
submesh. Its gradients are whole where the backward writes them (XLA all-reduces each
over the axes that split the micro-batch, inside the backward), so nothing is deferred
(``deferred_sums``).

A stage's record (``stage_sharding.StagePins``) names every value that crosses a
computation, so here they are read
off XLA: the stage's forward and backward are compiled once as one program (the merged
step the ILP would plan), with each input in its pin or replicated and every output left
to XLA; each apply-grad computation is then compiled the same way, with the specs so
found for its inputs. Compiling needs as many devices as the stage's submesh has
(any of this process's devices: propagation does not depend on which).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa.device_mesh import MESH_AXIS_NAMES, LogicalDeviceMesh
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints
from alpa.tracing import StepJaxpr
from alpa.tracing.jaxpr_util import is_var


def propagates(option: AutoShardingOption, num_devices: int) -> bool:
    """Whether a stage with ``option`` on ``num_devices`` devices is left to XLA's
    propagation (auto-sharding off; ``force_data_parallel`` makes it data parallel
    instead)."""
    return num_devices > 1 and not option.enable_auto_sharding and not option.force_data_parallel


def propagate_into(
    specs: dict,
    s: int,
    sub: StepJaxpr,
    produced: set,
    mesh: LogicalDeviceMesh,
) -> None:
    """Record in ``specs`` (stage ``s``'s ``value -> PartitionSpec``) the specs XLA gives
    the inputs and outputs of ``sub`` (one or several computations of stage ``s`` merged,
    ``stage_sharding.merged_step``; ``produced``: the values its equations compute) when
    compiled on ``mesh``'s shape with each input in its ``specs`` entry, else replicated;
    entries already there are kept."""
    jax_mesh = _local_mesh(s, mesh)
    invars, outvars = sub.jaxpr.invars, sub.jaxpr.outvars
    in_specs = [specs.get(v) or PartitionSpec() for v in invars]
    in_shardings = [NamedSharding(jax_mesh, spec) for spec in in_specs]
    consts = sub.closed_jaxpr.consts

    def fn(*args):
        return eval_jaxpr_with_constraints(sub.jaxpr, consts, list(args), {})

    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    compiled = jax.jit(fn, in_shardings=in_shardings).lower(*structs).compile()
    for v, spec in zip(invars, in_specs, strict=True):
        specs.setdefault(v, spec)
    for v, sharding in zip(outvars, compiled.output_shardings, strict=True):
        if is_var(v) and v in produced:
            specs.setdefault(v, _spec_of(sharding, v.aval.ndim))


def _local_mesh(s: int, mesh: LogicalDeviceMesh) -> Mesh:
    n = mesh.num_devices
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(
            f"stage {s} has AutoShardingOption(enable_auto_sharding=False), so its shardings "
            f"are XLA's propagation from the pins, read off a compile on {n} devices; this "
            f"process has {len(devices)}. Plan it where {n} devices exist, or leave "
            "auto-sharding on"
        )
    return Mesh(np.array(devices[:n]).reshape(tuple(mesh.shape)), MESH_AXIS_NAMES)


def _spec_of(sharding, ndim: int) -> PartitionSpec:
    """``sharding`` as a spec over alpa's axis names (replicated where XLA's sharding is
    not one a ``PartitionSpec`` names)."""
    if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == MESH_AXIS_NAMES:
        entries = tuple(sharding.spec)[:ndim]
        while entries and entries[-1] is None:
            entries = entries[:-1]
        return PartitionSpec(*entries)
    return PartitionSpec()
