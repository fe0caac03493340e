"""The programs of a pipeline plan's stage computations, as ``jax.jit`` functions.

:class:`StagePrograms` turns each stage computation of a ``PipeshardPlan`` into the
function a ``RUN`` calls on its submesh (the computation's equations lowered with its
stage's plan: shardings, reshardings and partial sums, as ``ShardParallel`` lowers its
one plan; the running sums of the gradients it accumulates, the reductions and
gathers of the deferred gradients), and the small programs around them (zeros for the
accumulators, relayouts between two stages on one mesh). The local driver
(``executables/pipeshard.py``) compiles them on its meshes; the Ray driver
(``executables/pipeshard_ray.py``) exports them for its workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.computation import StageComputation
from alpa.pipeline_parallel.program.deferred_sums import splits_over
from alpa.runtime.instructions import Kernel
from alpa.runtime.placement import PlacementSpec
from alpa.shard_parallel.gradients.packed_collectives import gather_packed, reduce_partials
from alpa.shard_parallel.gradients.row_sums import deferred_rules
from alpa.shard_parallel.lowering.compile import full_batch_avals
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints
from alpa.shard_parallel.lowering.plan_pins import plan_pins
from alpa.shard_parallel.strategies.data_parallel import zero_spec
from alpa.tracing import new_jaxpr
from alpa.tracing.jaxpr_util import backward_slice, is_var, nested_eqns
from alpa.tracing.primitive_def import pipeline_p


def _sub_jaxpr(template, eqns, invars, outvars):
    """``eqns`` of the step's jaxpr ``template`` as a jaxpr of its own (the step's
    constants as its constvars; markers that only order the program, with no outputs,
    left out), to be evaluated by ``shard_parallel``'s lowering."""
    eqns = [e for e in eqns if not (e.primitive is pipeline_p and not e.outvars)]
    return new_jaxpr(template, template.constvars, invars, outvars, eqns)


class StagePrograms:
    """The jitted functions of a plan's stage computations on given meshes: concrete
    ``jax.sharding.Mesh`` es (compiled here) or ``AbstractMesh`` es (exported for Ray
    workers). Both runtimes build their programs from it."""

    def __init__(self, plan: PipeshardPlan, meshes: Sequence[Any]):
        self.plan = plan
        self.program = plan.program
        self.meshes = list(meshes)
        self.var_of = {name: v for v, name in plan.names.items()}

    def const_outputs(self, names) -> dict:
        """The step outputs ``names`` that depend on no input, computed here once."""
        if not names:
            return {}
        closed = self.plan.traced.closed_jaxpr
        outvars = [self.var_of[n] for n in names]
        makes_constant = self.program.const_eqns
        constant = [e for e in closed.jaxpr.eqns if any(o in makes_constant for o in e.outvars)]
        eqns = backward_slice(constant, outvars)
        sub = _sub_jaxpr(closed.jaxpr, eqns, [], outvars)
        values = eval_jaxpr_with_constraints(sub, closed.consts, [], {})
        return dict(zip(names, values, strict=True))

    def sharding(self, var, mesh: int) -> NamedSharding:
        return NamedSharding(self.meshes[mesh], self.plan.spec_of(var, mesh))

    def _deferred_rules(self, comp: StageComputation) -> dict:
        """The equations of ``comp`` that compute deferred row sums (``deferred_sums``),
        as ``_eval_eqns`` overrides."""
        deferred = self.program.deferred
        if deferred is None or comp.kind == "apply":
            return {}
        # Those inside bodies too (a checkpoint's, a scan's).
        values = {v for e in nested_eqns(comp.eqns) for v in e.outvars if v in deferred.values}
        if not values:
            return {}
        s = comp.stage
        return deferred_rules(
            comp.eqns,
            deferred.row_dims,
            values,
            self.meshes[s],
            deferred.stage_axes[s],
            self.plan.program_pins[s].var_specs,
        )

    def key_sharding(self, key) -> NamedSharding:
        """The sharding the plan recorded for buffer ``key``."""
        return NamedSharding(self.meshes[key[2]], self.plan.buffer_specs[(key[0], key[2])])

    def zeros(self, keys):
        """``jax.jit`` of a function returning zeros for the buffers ``keys``."""
        avals = [self.var_of[key[0]].aval for key in keys]
        shardings = tuple(self.key_sharding(key) for key in keys)

        def zeros():
            return tuple(jax.numpy.zeros(a.shape, a.dtype) for a in avals)

        return jax.jit(zeros, out_shardings=shardings)

    def relayout(self, src, dst):
        """``jax.jit`` of the copy of buffer ``src`` into ``dst``'s sharding, for two stages
        on one mesh (interleaved 1F1B, DualPipeV): ``(jitted, input structs, output shardings)``."""
        aval = self.var_of[src[0]].aval
        out = self.key_sharding(dst)
        struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=self.key_sharding(src))
        return jax.jit(lambda x: (x,), out_shardings=(out,)), [struct], [out]

    def kernel(self, kernel: Kernel, donate: Sequence[int] = ()):
        """What a ``RUN`` of ``kernel`` calls: the stage computation, its kept outputs,
        then each accumulated value (``sum + scale * value``, the sums donated); returns
        ``(jitted, input structs, output shardings)``. ``donate``: positions of further
        arguments whose buffers it may reuse (``instructions.donated_inputs``)."""
        comp = self.program.computations[kernel.computation]
        sums = [a for a in kernel.accumulate if a.reads_sum]
        return self.computation(comp, kernel, sums, donate)

    def _gathered_outputs(self, comp: StageComputation, kept) -> dict:
        """ZeRO-2's updated parameters in an apply computation of a stage whose deferred
        gradients are reduce-scattered over its data axes (split over them in the stage's
        record: ``deferred_sums.zero2_specs``): each kept output that the stage returns whole,
        computed from a value split over them (a scattered gradient, the split optimizer
        state), by position in ``kept``, as ``(split spec, data axes)``: computed on each
        device's shard and all-gathered in one packed all-gather
        (``packed_collectives.gather_packed``), instead of XLA gathering each update."""
        deferred, s = self.program.deferred, comp.stage
        data_axes = () if deferred is None else tuple(deferred.stage_axes.get(s, ()))
        grads = [v for v in deferred.partials if self.program.home.get(v) == s] if data_axes else []
        if comp.kind != "apply" or not any(
            splits_over(self.sharding(v, s).spec, data_axes) for v in grads
        ):
            return {}
        n = int(np.prod([self.meshes[s].shape[a] for a in data_axes]))
        reached = {v for v in comp.invars if splits_over(self.sharding(v, s).spec, data_axes)}
        for eqn in comp.eqns:
            if any(is_var(v) and v in reached for v in eqn.invars):
                reached.update(eqn.outvars)
        gathers = {}
        for k, i in enumerate(kept):
            v = comp.outvars[i]
            if not is_var(v) or v not in reached or any(self.sharding(v, s).spec):
                continue
            spec = zero_spec(v.aval.shape, n, data_axes)
            if any(spec):
                gathers[k] = (spec, data_axes)
        return gathers

    def computation(self, comp: StageComputation, kernel: Kernel | None = None, sums=(), donate=()):
        closed = self.plan.traced.closed_jaxpr
        sub = _sub_jaxpr(closed.jaxpr, comp.eqns, comp.invars, comp.outvars)
        mesh = self.meshes[comp.stage]
        # The stage's plan lowered as ShardParallel lowers its one plan: the values it
        # names pinned to their sharding (the computation's inputs arrive in theirs), the
        # operands it reads in another spec resharded to it, its partial sums added on each
        # device and reduced once; the deferred row sums' overrides come first.
        pins = plan_pins(self.plan.program_pins[comp.stage], mesh, unpinned=comp.invars)
        constraints, operand_constraints = dict(pins.constraints), pins.operand_constraints
        overrides = self._deferred_rules(comp)
        overrides |= pins.overrides(sub, skip=overrides)
        kept = list(range(len(comp.outvars))) if kernel is None else list(kernel.kept)
        accumulate = () if kernel is None else kernel.accumulate
        reduces = () if kernel is None else kernel.reduces
        publishes = () if kernel is None else kernel.publishes
        reduced_specs = {i: self.sharding(comp.invars[i], comp.stage) for i in reduces}
        data_axes = self.program.deferred.stage_axes[comp.stage] if reduces else ()
        gathers = self._gathered_outputs(comp, kept)
        for k, (spec, _) in gathers.items():  # computed on each device's shard
            constraints[comp.outvars[kept[k]]] = NamedSharding(mesh, spec)

        num_sums = len(sums)

        def fn(*args):
            inputs = list(args[num_sums:])
            # The step's one gradient reduction: reduce-scatters packed into one
            # (ZeRO-2's), the rest all-reduced (packed_collectives.reduce_partials).
            order = list(reduced_specs)
            totals = reduce_partials(
                [inputs[i] for i in order], [True] * len(order),
                [reduced_specs[i].spec for i in order], mesh, data_axes,
            )  # fmt: skip
            for i, total in zip(order, totals, strict=True):
                inputs[i] = jax.lax.with_sharding_constraint(total, reduced_specs[i])
            results = eval_jaxpr_with_constraints(
                sub, closed.consts, inputs, constraints, operand_constraints, overrides
            )
            outs = gather_packed([results[i] for i in kept], gathers, mesh)
            outs += [inputs[i] for i in publishes]
            running = iter(args[:num_sums])
            for a in accumulate:
                value = results[a.outvar_index]
                if a.scale is not None:
                    value = value * np.asarray(a.scale, value.dtype)
                outs.append(next(running) + value if a.reads_sum else value)
            return outs

        fn.__name__ = comp.name
        partials = self.program.deferred.partials if reduces else {}
        # The running sums first, as Alpa's backward took its donated accumulators.
        in_vars = [a.marker_out for a in sums]
        in_vars += [partials[v] if i in reduces else v for i, v in enumerate(comp.invars)]
        out_vars = [comp.outvars[i] for i in kept] + [comp.invars[i] for i in publishes]
        out_vars += [a.marker_out for a in accumulate]
        in_shardings = [self.sharding(v, comp.stage) for v in in_vars]
        out_shardings = [self.sharding(v, comp.stage) for v in out_vars]
        structs = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s, weak_type=v.aval.weak_type)
            for v, s in zip(in_vars, in_shardings, strict=True)
        ]
        jitted = jax.jit(
            fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=tuple(sorted({*range(num_sums), *donate})),
        )
        return jitted, structs, out_shardings


def hlo_order(program) -> list[int]:
    """The indices of ``program``'s computations in Alpa's order of stage programs: the
    forwards by stage, the backwards (and weight-gradient parts) from the last stage to the
    first, then apply-grad by stage."""
    rank = {"forward": 0, "backward": 1, "weight": 1, "apply": 2}
    comps = program.computations

    def key(i):
        c = comps[i]
        r = rank.get(c.kind, 3)
        return (r, -c.stage if r == 1 else c.stage, c.kind == "weight", i)

    return sorted(range(len(comps)), key=key)


def input_placement_specs(
    traced: Any,
    input_stages: dict,
    num_micro_batches: int,
    placement: Callable[[Any, Sequence[int]], PlacementSpec],
) -> list[PlacementSpec]:
    """Per input leaf of a pipelined step, ``placement(var, meshes)`` on the meshes of the
    stages that read it, with the aval the caller passes (a batch leaf's whole batch; the
    step was traced at micro-batch size). Shared by the local and the Ray executable."""
    full = full_batch_avals(traced, num_micro_batches)
    return [
        dataclasses.replace(placement(v, input_stages[v]), aval=aval)
        for v, aval in zip(traced.closed_jaxpr.jaxpr.invars, full, strict=True)
    ]
