"""What the stage cost model reads of each layer: its FLOPs, state and activations.

A program split with one stage per layer (``stage_problem.StageProblem.program``) gives each
layer ``l`` its forward and backward computations. :func:`compute_layer_facts` reads off
them what the analytic model (``stage_cost``) needs: the FLOPs of both (``tracing.flops``)
and of the forward alone (recomputed under remat); the bytes of the state it holds
(parameters, optimizer state, gradient sums); per micro-batch, the activations its
forward keeps for its backward, the values entering it from earlier layers and the batch
arguments it reads; the row sums that make its parameters' gradients, which
``deferred_sums`` carries as partial sums; and its apply-grad equations (priced with a
cluster profile, ``stage_work``). :func:`temporary_bytes` is the liveness of the
values a layer computes and frees again, the figure the model adds once per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.pipeline_parallel.program.computation import PipelineProgram
from alpa.shard_parallel.gradients.row_sums import bodies_passing_row_sums
from alpa.shard_parallel.strategies.strategy_rules import ELEMENTWISE, REDUCTIONS
from alpa.tracing import StepJaxpr
from alpa.tracing.flops import jaxpr_flops
from alpa.tracing.jaxpr_util import is_var, nbytes, nested_eqns
from alpa.tracing.primitive_def import passes_through


@dataclass(frozen=True)
class LayerFacts:
    """What the stage cost model reads of one layer (stage ``l`` of a program split
    with one stage per layer), per micro-batch where it says so."""

    flops: float  # forward and backward
    forward_flops: float
    state_bytes: float  # parameters, optimizer state and gradient sums of the layer
    param_bytes: float  # the parameters its forward/backward read
    activation_bytes: float  # per micro-batch: batch values its forward keeps for its backward
    entering_bytes: float  # per micro-batch: what it reads from earlier layers
    batch_arg_bytes: float  # per micro-batch: the step's batch arguments its forward reads
    kept: tuple  # the values counted in activation_bytes
    entering: tuple  # the values counted in entering_bytes
    batch_args: tuple  # the values counted in batch_arg_bytes
    gradients: dict  # the row sums that make its parameters' gradients -> those gradients
    apply_eqns: tuple = ()  # its apply-grad equations (the update of its parameters)


#: Primitives through which a row sum reaches the gradient marker unchanged in kind: a
#: reduction of their result is a reduction of the row sum (``micro_batches``' linear set,
#: restricted to what the split leaves between a row sum and the marker).
_PASS_TO_GRADIENT = frozenset(
    {
        "add",
        "add_any",
        "transpose",
        "convert_element_type",
        "reshape",
        "copy",
        "squeeze",
        "expand_dims",
        "pipeline_marker",
        "mul",
        "neg",
    }
)
_ROW_SUM_PRIMITIVES = frozenset(
    {"dot_general", "reduce_sum", "scatter-add", "conv_general_dilated"}
)


def _gradient_row_sums(program: PipelineProgram, comps) -> dict:
    """The values of ``comps`` that are row sums making a gradient ``alpa.grad`` marks,
    each with the marked operands it makes: found from each marked operand back through
    :data:`_PASS_TO_GRADIENT` equations, and into the bodies that return row sums as they
    are (a checkpoint's outputs, a scan's stacked outputs:
    ``row_sums.bodies_passing_row_sums``), as ``deferred_sums`` defers them."""
    eqns = nested_eqns([e for c in comps for e in c.eqns])
    producer = {v: e for e in eqns for v in e.outvars}
    bodies = bodies_passing_row_sums(eqns)
    sums_of: dict = {}  # value -> the row sums it is made of, each value walked once

    def row_sums(start) -> frozenset:
        stack = [start]
        while stack:
            v = stack[-1]
            if v in sums_of:
                stack.pop()
                continue
            eqn = producer.get(v)
            name = eqn.primitive.name if eqn is not None else None
            passes = name in _PASS_TO_GRADIENT or _sums_nothing(eqn)
            if eqn in bodies and eqn.outvars.index(v) >= bodies[eqn][1]:
                inner = bodies[eqn][0].outvars[eqn.outvars.index(v)]
                if not is_var(inner):
                    sums_of[v] = frozenset()
                elif inner not in sums_of:
                    stack.append(inner)
                    continue
                else:
                    sums_of[v] = sums_of[inner]
            elif name in _ROW_SUM_PRIMITIVES and not passes:
                sums_of[v] = frozenset((v,))
            elif not passes:
                sums_of[v] = frozenset()
            else:
                # A marker's output is its operand of the same position, not the others.
                operands = eqn.invars
                if passes_through(eqn):
                    operands = [eqn.invars[eqn.outvars.index(v)]]
                operands = [x for x in operands if is_var(x)]
                pending = [x for x in operands if x not in sums_of]
                if pending:  # their sums first (a jaxpr has no cycles)
                    stack.extend(pending)
                    continue
                sums_of[v] = frozenset().union(*(sums_of[x] for x in operands))
            stack.pop()
        return sums_of[start]

    found: dict = {}
    for operand in program.accumulated.values():
        for v in row_sums(operand):
            found[v] = (*found.get(v, ()), operand)
    return found


def _sums_nothing(eqn) -> bool:
    """A ``reduce_sum`` over dimensions of size 1 only (a broadcast bias's transpose after
    its row sum): a reshape, not the row sum."""
    return (
        eqn is not None
        and eqn.primitive.name == "reduce_sum"
        and all(eqn.invars[0].aval.shape[a] == 1 for a in eqn.params["axes"])
    )


def compute_layer_facts(program: PipelineProgram, layer: int) -> LayerFacts:
    """Layer ``layer``'s :class:`LayerFacts`."""
    invars = set(program.closed_jaxpr.jaxpr.invars)
    comps = layer_comps(program, [layer])
    forward = program.computation(layer, "forward")
    backward = program.computation(layer, "backward")
    flops = jaxpr_flops(e for c in comps for e in c.eqns)
    forward_flops = jaxpr_flops(forward.eqns) if forward is not None else 0.0
    read = {v for c in comps for v in c.invars}
    params = [v for v in read if v in invars and v not in program.batch_dependent]
    param_bytes = float(sum(nbytes(v) for v in params))
    state = [
        v
        for v in invars
        if v not in program.batch_dependent and layer in program.input_stages.get(v, ())
    ]
    state_bytes = float(sum(nbytes(v) for v in state)) + param_bytes  # + gradient sums
    kept: set = set()
    if forward is not None and backward is not None:
        # Per micro-batch: what depends on the batch. Weights the forward hands on to the
        # backward (a marker passes them along) are the parameters' own buffers, in state.
        kept = set(forward.outvars) & set(backward.invars) & program.batch_dependent
    entering: list = []
    batch_args: list = []
    if forward is not None:
        for v in forward.invars:
            if not is_var(v) or v not in program.batch_dependent:
                continue
            if v in invars:
                batch_args.append(v)
            elif program.home.get(v, layer) < layer:
                entering.append(v)
    total = lambda vs: float(sum(nbytes(v) for v in vs))  # noqa: E731
    apply_eqns = tuple(
        e for c in program.computations if c.stage == layer and c.kind == "apply" for e in c.eqns
    )
    return LayerFacts(
        flops=flops,
        forward_flops=forward_flops,
        state_bytes=state_bytes,
        param_bytes=param_bytes,
        activation_bytes=total(kept),
        entering_bytes=total(entering),
        batch_arg_bytes=total(batch_args),
        kept=tuple(kept),
        entering=tuple(entering),
        batch_args=tuple(batch_args),
        gradients=_gradient_row_sums(program, comps),
        apply_eqns=apply_eqns,
    )


def per_device_bytes(aval, spec: PartitionSpec | None, mesh_shape, axis_names) -> float:
    total = float(np.prod(aval.shape, dtype=np.float64) * aval.dtype.itemsize)  # keys too
    if spec is None:
        return total
    split = 1
    for entry in spec:
        for axis in entry_names(entry):
            split *= mesh_shape[list(axis_names).index(axis)]
    return total / split


def layer_comps(program: PipelineProgram, layers: Sequence[int]) -> list:
    """The forward and backward computations of ``layers`` (stage ``l`` = layer ``l``) in
    program order: forwards in layer order, then backwards in reverse."""
    layers = list(layers)
    comps = []
    for kind, order in (("forward", layers), ("backward", layers[::-1])):
        for layer in order:
            comp = program.computation(layer, kind)
            if comp is not None and comp.eqns:
                comps.append(comp)
    return comps


# Equations whose results XLA's fusion can leave unmaterialised: elementwise arithmetic and
# the layout changes it folds into the reading kernel's indexing.
_FUSIBLE = frozenset(
    {p if isinstance(p, str) else p.name for p in ELEMENTWISE}
    | {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota"}
)
# Readers into which such a value fuses: the fusible equations and the reductions (XLA's
# input fusion computes a reduction's operand inside the reduction).
_FUSES_INTO = _FUSIBLE | {p.name for p in REDUCTIONS}
# What XLA fuses into its readers on every backend, the CPU's too: a broadcast (of a mask,
# of a constant to a tensor's shape) is computed inside the kernel that reads it.
_BROADCASTS = frozenset({"broadcast_in_dim", "iota"})


def temporary_bytes(jaxpr, held, bytes_of, fused: bool = True, written=frozenset()) -> float:
    """The most bytes per device of values ``jaxpr``'s equations compute and free again
    that are live at once: each from the equation that computes it to its last read
    (one never read: its own equation only), ``held`` values (inputs, outputs, what the
    forward keeps for the backward, counted elsewhere) excepted. XLA's buffer reuse is
    this liveness. With ``fused``, a value that XLA's fusion never writes to memory is
    left out: one computed by a fusible equation (elementwise, broadcast, reshape) and
    read only by fusible equations or reductions (``docs/pipeline.md`` compares the
    figure with XLA's on GPU: without fusion the cross-entropy of a 51200-word vocabulary
    counts three fp32 copies of the logits that XLA:GPU never writes), unless it is in
    ``written`` (counted written whatever fusion does). Without ``fused`` a broadcast
    read only by such equations is left out still: XLA's CPU compile, too, computes it
    inside its reader."""
    eqns = jaxpr.eqns
    if not eqns:
        return 0.0
    last: dict = {}
    fuses: dict = {}
    for t, eqn in enumerate(eqns):
        reader_fuses = eqn.primitive.name in _FUSES_INTO
        for v in eqn.invars:
            if is_var(v):
                last[v] = t
                fuses[v] = fuses.get(v, True) and reader_fuses
    change = np.zeros(len(eqns) + 1)
    for t, eqn in enumerate(eqns):
        computed_in_fusion = eqn.primitive.name in (_FUSIBLE if fused else _BROADCASTS)
        for v in eqn.outvars:
            if not is_var(v) or v in held:
                continue
            if computed_in_fusion and fuses.get(v, True) and v not in written:
                continue
            size = bytes_of(v)
            change[t] += size
            change[max(last.get(v, t), t) + 1] -= size
    return float(max(np.cumsum(change).max(), 0.0))


def held_values(step: StepJaxpr, facts: LayerFacts) -> set:
    """The values of a layer's ``step`` that :func:`temporary_bytes` does not count: its
    inputs, constants and outputs, and what its forward keeps for its backward."""
    jaxpr = step.closed_jaxpr.jaxpr
    return {*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars, *facts.kept}


def recomputed_bytes(step: StepJaxpr, facts: LayerFacts, bytes_of, fused: bool = True) -> float:
    """Under stage remat, the most bytes per device a layer's backward holds at once
    while it recomputes the layer's forward and runs: :func:`temporary_bytes` of its
    ``step`` (forward, then backward) with what the forward keeps for the backward
    counted as values it computes and frees again, each live from where the recomputed
    forward writes it to the backward's last read, not for the whole backward. Those
    values are counted written whatever the cluster's fusion does (XLA may recompute an
    elementwise one inside a backward kernel instead; the model does not count on it)."""
    jaxpr = step.closed_jaxpr.jaxpr
    kept = set(facts.kept)
    held = {*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars} - kept
    return temporary_bytes(jaxpr, held, bytes_of, fused=fused, written=kept)
