"""Tracing: a user's step function and its arguments become a flat ``ClosedJaxpr``.

``trace_step`` is the first pass of the compiler. It flattens the dynamic arguments into
leaves, traces the function on abstract values, and inlines call-like primitives (``jit``,
``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``) so that every later pass sees one
flat list of equations. The result, a :class:`TracedStep`, also records which leaves are
batch leaves and which are donated, and a readable name for every leaf, for error messages.

Two facts about how the step differentiates are recorded for diagnostics, since a mistake
there otherwise surfaces far from its cause:

* ``grad_invars``: the leaves that ``alpa.grad`` differentiates with respect to as they
  are (the step passes an input leaf itself, as in ``alpa.grad(loss)(state.params)``).
  ``alpa.grad`` reports its differentiated values through :func:`note_grad_inputs`; a leaf
  matches when it is the very tracer of that input.
* ``has_backward_pass``: whether reverse-mode AD ran inside the step, with ``alpa.grad`` or
  not. JAX records the transforms an equation was produced under in its name stack, and
  the backward pass is ``transpose(jvp(...))``. The jaxpr is searched before inlining, so
  that ``jax.grad(jax.jit(f))``, whose transposed equation is the ``jit`` call itself, is
  seen too.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    jaxprs_in_params,
    new_jaxpr_eqn,
)

from alpa.jax_internals import (
    ShapedArray,
    call_body,
    cond_branches,
    cond_params,
    is_cond,
    is_remat,
    is_scan,
    is_while,
    open_jaxpr,
    remat_body,
    remat_params,
    scan_params,
    scan_parts,
    while_params,
    while_parts,
)
from alpa.tracing.jaxpr_util import is_grad_marker
from alpa.tracing.primitive_def import pipeline_p


@dataclass(frozen=True)
class StepJaxpr:
    """A flat program and the role of each of its inputs: what the intra-op planner
    (``alpa.shard_parallel.auto_sharding.plan_auto_sharding``) plans and
    ``shard_parallel``'s lowering compiles. A user's step (:class:`TracedStep`) is one; a
    pipeline stage's computations, cut out of the step's jaxpr, are another, with no
    call structure of their own: flat inputs and outputs, no retrace.

    Attributes:
      closed_jaxpr: the program; ``invars`` are its inputs in order.
      in_avals: abstract value of each input.
      batch_invars: per input, whether it belongs to the batch (its dimension 0 is the
        batch's rows).
      donated_invars: per input, whether its buffer may be reused for an output.
      leaf_names: per input, e.g. ``"argument 1['x']"``, for messages; an optimizer-state
        input is one whose name says ``opt_state`` (``data_parallel.is_opt_state``).
      name: the program's name, for messages.
      grad_invars: per input, whether ``alpa.grad`` differentiates with respect to it as
        it is (a parameter; module docstring); empty when unknown.
      has_backward_pass: whether reverse-mode AD (``alpa.grad`` or ``jax.grad``) ran
        inside the step (module docstring).
      retrace: ``retrace(d)`` traces the same step again with every batch input's dim 0
        divided by ``d`` (set by ``parallelize``; used for per-device micro-batches);
        ``d`` may be a ``fractions.Fraction`` (``Fraction(1, 2)`` doubles the batch).
        ``parallelize``'s retraces are kept: a second call with the same ``d`` returns
        the first one's trace. ``None`` where the program cannot be traced again (a
        stage's computations).
    """

    closed_jaxpr: ClosedJaxpr
    in_avals: tuple[Any, ...]
    batch_invars: tuple[bool, ...]
    donated_invars: tuple[bool, ...]
    leaf_names: tuple[str, ...]
    name: str
    grad_invars: tuple[bool, ...] = ()
    has_backward_pass: bool = False
    retrace: Callable[[int], TracedStep] | None = field(default=None, compare=False, repr=False)

    @property
    def jaxpr(self) -> Jaxpr:
        return self.closed_jaxpr.jaxpr

    def grad_marker(self) -> JaxprEqn | None:
        """The equation of the ``alpa.grad`` marker, if the step has one."""
        markers = [e for e in self.jaxpr.eqns if is_grad_marker(e)]
        if len(markers) > 1:
            raise ValueError(
                f"{self.name} calls alpa.grad / alpa.value_and_grad {len(markers)} times; "
                "a training step may compute its gradients only once"
            )
        return markers[0] if markers else None

    def trees(self) -> tuple[Any, Any]:
        """``(in_tree, out_tree)``: how the compiled program takes its inputs and returns
        its outputs; flat tuples here."""
        ins, outs = len(self.jaxpr.invars), len(self.jaxpr.outvars)
        return jax.tree.structure(tuple(range(ins))), jax.tree.structure(tuple(range(outs)))

    def output_names(self) -> list[str]:
        """Per output, a name for messages (``output[i]`` here)."""
        return [f"output[{i}]" for i in range(len(self.jaxpr.outvars))]


@dataclass(frozen=True, kw_only=True)
class TracedStep(StepJaxpr):
    """A user's traced step: a :class:`StepJaxpr` whose inputs are the dynamic leaves of
    the call, with the call's structure.

    Attributes (besides :class:`StepJaxpr`'s):
      in_tree: treedef of the tuple of dynamic arguments.
      out_tree: treedef of the function's output.
      dynamic_argnums: positions of the dynamic arguments in the original call.
    """

    in_tree: Any
    out_tree: Any
    dynamic_argnums: tuple[int, ...]

    def trees(self) -> tuple[Any, Any]:
        """``(in_tree, out_tree)``: the user's argument and output pytrees."""
        return self.in_tree, self.out_tree

    def output_names(self) -> list[str]:
        """Per output leaf, its path in the step's output, e.g. ``output[0]['w']``."""
        n = len(self.jaxpr.outvars)
        dummy = jax.tree.unflatten(self.out_tree, list(range(n)))
        return [
            "output" + jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]
        ]


def mark_outputs_as_gradients(traced: TracedStep) -> TracedStep:
    """``traced`` (differentiated with ``jax.grad``, no ``alpa.grad``) with the
    ``alpa.grad`` marker on the outputs its equations compute, as if it returned
    ``alpa.grad``'s gradients: Alpa's pipelines accept such a step (its tests return
    ``jax.grad``'s gradients), all of it the compute part, with no apply part.
    ``traced.retrace`` is kept as it is: ``parallelize`` marks each retrace itself (the
    method's ``finish_trace``). A step already marked is returned as it is."""
    if traced.grad_marker() is not None:
        return traced
    jaxpr = traced.jaxpr
    produced = {v for e in jaxpr.eqns for v in e.outvars}
    marked = list(dict.fromkeys(v for v in jaxpr.outvars if isinstance(v, Var) and v in produced))
    if not marked:
        return traced
    return insert_grad_marker(traced, marked, len(jaxpr.eqns))


def insert_grad_marker(traced: TracedStep, values: Sequence[Var], cut: int) -> TracedStep:
    """``traced`` with an ``alpa.grad`` marker on ``values`` after its first ``cut``
    equations: every equation after it, and the step's outputs, read the marked values
    in their place (an equation before it keeps reading the unmarked one)."""
    jaxpr = traced.jaxpr
    renamed = {v: Var(v.aval) for v in values}
    marker = new_jaxpr_eqn(
        list(values),
        [renamed[v] for v in values],
        pipeline_p,
        {"name": "grad", "mark_type": "grad"},
        set(),
    )

    def reads_marked(eqn):
        invars = [renamed.get(v, v) if isinstance(v, Var) else v for v in eqn.invars]
        return eqn.replace(invars=invars) if invars != list(eqn.invars) else eqn

    eqns = [*jaxpr.eqns[:cut], marker, *(reads_marked(e) for e in jaxpr.eqns[cut:])]
    outvars = [renamed.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    closed = ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), traced.closed_jaxpr.consts)
    return dataclasses.replace(traced, closed_jaxpr=closed)


def trace_step(
    fun: Callable,
    args: Sequence[Any],
    static_argnums: Sequence[int],
    batch_argnums: Sequence[int],
    donate_argnums: Sequence[int],
    leaf_names: Sequence[str],
) -> TracedStep:
    """Trace ``fun(*args)`` with the dynamic arguments abstract and inline its calls.

    ``args`` may hold arrays or ``jax.ShapeDtypeStruct`` leaves: only shapes and dtypes
    are read.
    """
    static = set(static_argnums)
    dynamic_argnums = tuple(i for i in range(len(args)) if i not in static)
    dynamic_args = tuple(args[i] for i in dynamic_argnums)
    leaves, in_tree = jax.tree.flatten(dynamic_args)
    in_avals = tuple(abstractify(x) for x in leaves)

    out_tree_box = []
    name = getattr(fun, "__name__", repr(fun))
    watch = _GradWatch()

    def flat_fun(*flat_leaves):
        dyn = jax.tree.unflatten(in_tree, flat_leaves)
        full = list(args)
        for pos, value in zip(dynamic_argnums, dyn, strict=True):
            full[pos] = value
        watch.index = {id(x): i for i, x in enumerate(flat_leaves)}
        token = _grad_watch.set(watch)
        try:
            out = fun(*full)
        finally:
            _grad_watch.reset(token)
        _check_outputs(out, name)
        out_leaves, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fun)(*in_avals)
    has_backward_pass = any(_is_transposed(e) for e in _all_eqns(closed.jaxpr))
    closed = inline_calls(closed)

    batch_invars, donated_invars = [], []
    for pos, arg in zip(dynamic_argnums, dynamic_args, strict=True):
        n = len(jax.tree.leaves(arg))
        batch_invars += [pos in batch_argnums] * n
        donated_invars += [pos in donate_argnums] * n
    return TracedStep(
        closed_jaxpr=closed,
        in_tree=in_tree,
        out_tree=out_tree_box[-1],
        in_avals=in_avals,
        batch_invars=tuple(batch_invars),
        donated_invars=tuple(donated_invars),
        leaf_names=tuple(leaf_names),
        dynamic_argnums=dynamic_argnums,
        name=name,
        grad_invars=tuple(i in watch.differentiated for i in range(len(leaves))),
        has_backward_pass=has_backward_pass,
    )


# ----------------------------------------------------------------------------- diagnostics


class _GradWatch:
    """The input leaves of a trace (by tracer identity) and those ``alpa.grad``
    differentiated with respect to."""

    def __init__(self):
        self.index: dict[int, int] = {}
        self.differentiated: set[int] = set()


_grad_watch: contextvars.ContextVar[_GradWatch | None] = contextvars.ContextVar(
    "alpa_grad_watch", default=None
)


def note_grad_inputs(values) -> None:
    """Called by ``alpa.grad`` with the values it differentiates with respect to: those
    that are input leaves of the step being traced are recorded (``grad_invars``)."""
    watch = _grad_watch.get()
    if watch is None:
        return
    for x in jax.tree.leaves(values):
        i = watch.index.get(id(x))
        if i is not None:
            watch.differentiated.add(i)


def _check_outputs(out, name: str) -> None:
    """The step's outputs are pytrees of arrays (Python scalars pass, as under jax.jit);
    name the first other leaf by its path, in the user's terms."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        # A tracer is a jax.Array.
        if isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
            continue
        raise TypeError(
            f"{name} returned a value of type {type(leaf).__name__} at "
            f"output{jax.tree_util.keystr(path)}: outputs must be pytrees of arrays"
        )


def _all_eqns(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def _is_transposed(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` belongs to a backward pass (its name stack has ``transpose``)."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return any(getattr(entry, "name", None) == "transpose" for entry in stack)


def abstractify(x) -> jax.ShapeDtypeStruct:
    """The abstract value ``jax.jit`` sees for a leaf: shape, canonical dtype and weak type.

    A Python scalar is weakly typed (``0`` is ``~int32[]``, as is ``step + 1`` computed from
    it), so ``TrainState.create(...)``'s ``step=0`` and the array a step returns for it key
    and trace alike, and the step compiles once, as under ``jax.jit``.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return (
            x
            if x.sharding is None
            else jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
        )
    if (
        getattr(x, "is_distributed_array", False)
        or getattr(x, "is_stacked_rows", False)
        or isinstance(x, ShapedArray)
    ):
        # a value on Ray mesh workers, rows on several meshes (a pipeline's StackedRows),
        # or an abstract value (jax.typeof of an array)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def leaf_signature(x) -> tuple:
    """The part of a leaf that an executable is compiled for (a cache-key entry)."""
    if isinstance(x, jax.Array) and not getattr(x, "is_distributed_array", False):
        aval = x.aval  # what abstractify reads, without building a ShapeDtypeStruct per call
    else:
        aval = abstractify(x)
    dtype = aval.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # a typed PRNG key stays as is
        dtype = np.dtype(dtype)
    return (tuple(aval.shape), dtype, bool(aval.weak_type))


# ----------------------------------------------------------------------------- inlining


def inline_calls(closed: ClosedJaxpr, primitives: Collection[str] | None = None) -> ClosedJaxpr:
    """Inline every call-like equation, recursively, keeping the program's meaning.

    ``remat2`` (checkpoint), ``scan``, ``while`` and ``cond`` stay as they are: their bodies
    have semantics (rematerialization, loops, branches) that inlining would lose. Equations
    copied out of a body get fresh output variables, since one body may be inlined twice.
    ``primitives`` restricts the inlined calls to those names (default: every call-like
    primitive). A function still to be differentiated must keep its ``custom_jvp_call`` /
    ``custom_vjp_call`` equations, whose derivative rules are not those of their bodies.

    A ``remat2``, ``scan``, ``cond`` or ``while`` equation keeps its place, but its bodies are
    rewritten the same way (calls inlined) with fresh variables of their own: JAX may hand
    two equations one body object, and the auto-sharding pass plans each body's values
    (its variables must name one value each). A constant of a call inlined into a body, or
    of a closed body, enters the body as an extra operand: the last of a ``remat2`` or a
    ``cond``, one more of the leading constants of a ``scan`` or of a ``while``'s
    condition or body.
    """
    inliner = _Inliner(closed, primitives)
    eqns: list[JaxprEqn] = []
    env: dict = {}
    inliner.emit(closed.jaxpr, env, True, eqns, inliner.top_const)
    outvars = [v if isinstance(v, Literal) else env.get(v, v) for v in closed.jaxpr.outvars]
    jaxpr = new_jaxpr(closed.jaxpr, inliner.constvars, closed.jaxpr.invars, outvars, eqns)
    return ClosedJaxpr(jaxpr, inliner.consts)


class _Inliner:
    """:func:`inline_calls`'s walk: the step's constants (new ones appended) and how each
    equation is copied. ``add_const(aval, value)`` turns a constant met inside a body
    into a variable of the jaxpr being written (a new top-level constant, or a new operand
    of the body being copied)."""

    def __init__(self, closed: ClosedJaxpr, primitives: Collection[str] | None):
        self.primitives = primitives
        self.constvars: list[Var] = list(closed.jaxpr.constvars)
        self.consts: list[Any] = list(closed.consts)

    def top_const(self, aval, value) -> Var:
        var = Var(aval)
        self.constvars.append(var)
        self.consts.append(value)
        return var

    def emit(self, jaxpr: Jaxpr, env: dict, top: bool, eqns: list, add_const, outer=None) -> None:
        """Append ``jaxpr``'s equations to ``eqns``, its calls inlined, reading its
        variables through ``env`` (and, below the top, writing fresh ones into it).
        ``outer``: the name stack of the call being inlined, put before each equation's
        own, as JAX does when it inlines: an equation of ``jax.grad(jax.jit(f))``'s
        backward pass keeps ``transpose`` in its name (``grad_marking``)."""

        def read(v):
            return v if isinstance(v, Literal) else env.get(v, v)

        for eqn in jaxpr.eqns:
            body = call_body(eqn, self.primitives)
            if outer is not None:
                info = eqn.source_info
                eqn = eqn.replace(source_info=info.replace(name_stack=outer + info.name_stack))
            if body is not None:
                self._inline(eqn, body, read, env, eqns, add_const)
                continue
            if is_remat(eqn) and not remat_body(eqn).constvars:
                eqn = self.copy_remat(eqn, add_const)
            elif is_scan(eqn):
                eqn = self.copy_scan(eqn, add_const)
            elif is_cond(eqn):
                eqn = self.copy_cond(eqn, add_const)
            elif is_while(eqn):
                eqn = self.copy_while(eqn, add_const)
            outvars = list(eqn.outvars)
            if not top:
                outvars = [v if isinstance(v, DropVar) else Var(v.aval) for v in outvars]
                env.update(zip(eqn.outvars, outvars, strict=True))
            eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars], outvars=outvars))

    def _inline(self, eqn: JaxprEqn, body, read, env: dict, eqns: list, add_const) -> None:
        inner, inner_consts = open_jaxpr(body)
        inner_env: dict = {}
        for cv, c in zip(inner.constvars, inner_consts, strict=True):
            inner_env[cv] = add_const(cv.aval, c)
        for iv, arg in zip(inner.invars, eqn.invars, strict=True):
            inner_env[iv] = read(arg)
        self.emit(inner, inner_env, False, eqns, add_const, eqn.source_info.name_stack)
        for ov, inner_out in zip(eqn.outvars, inner.outvars, strict=True):
            env[ov] = (
                inner_out if isinstance(inner_out, Literal) else inner_env.get(inner_out, inner_out)
            )

    def copy_body(self, body: Jaxpr, body_consts, add_const):
        """``body`` with its calls inlined and every variable fresh, its constants (those
        of ``body_consts`` and of the calls inlined) turned into extra operands: the new
        body, its extra invars, and the outer values that feed them."""
        extra_inner: list[Var] = []
        extra_outer: list[Var] = []

        def body_const(aval, value) -> Var:
            extra_outer.append(add_const(aval, value))
            extra_inner.append(Var(aval))
            return extra_inner[-1]

        invars = [Var(v.aval) for v in body.invars]
        body_env: dict = dict(zip(body.invars, invars, strict=True))
        for cv, c in zip(body.constvars, body_consts, strict=True):
            body_env[cv] = body_const(cv.aval, c)
        body_eqns: list[JaxprEqn] = []
        self.emit(body, body_env, False, body_eqns, body_const)
        outvars = [v if isinstance(v, Literal) else body_env.get(v, v) for v in body.outvars]
        return (invars, outvars, body_eqns), extra_inner, extra_outer

    def copy_remat(self, eqn: JaxprEqn, add_const) -> JaxprEqn:
        """``eqn`` with its body's calls inlined and every body variable fresh."""
        body = remat_body(eqn)
        (invars, outvars, eqns), extra_inner, extra_outer = self.copy_body(body, (), add_const)
        new_body = new_jaxpr(body, [], [*invars, *extra_inner], outvars, eqns)
        return eqn.replace(
            invars=[*eqn.invars, *extra_outer],
            params=remat_params(eqn.params, new_body, len(extra_outer)),
        )

    def copy_scan(self, eqn: JaxprEqn, add_const) -> JaxprEqn:
        """The same for a ``scan``: new constants lead its operands."""
        body, consts = open_jaxpr(scan_parts(eqn).body)
        (invars, outvars, eqns), extra_inner, extra_outer = self.copy_body(body, consts, add_const)
        new_body = new_jaxpr(body, [], [*extra_inner, *invars], outvars, eqns)
        params = scan_params(
            eqn.params, body=ClosedJaxpr(new_body, []), num_new_consts=len(extra_outer)
        )
        return eqn.replace(invars=[*extra_outer, *eqn.invars], params=params)

    def copy_cond(self, eqn: JaxprEqn, add_const) -> JaxprEqn:
        """The same for each branch of a ``cond``: the branches' new constants are extra
        last operands, each branch reading its own."""
        bodies = [open_jaxpr(b) for b in cond_branches(eqn)]
        copies = [self.copy_body(body, consts, add_const) for body, consts in bodies]
        branches = []
        for i, ((invars, outvars, eqns), _, _) in enumerate(copies):
            slots = branch_extra_invars(i, [c[1] for c in copies])
            body = bodies[i][0]
            branches.append(ClosedJaxpr(new_jaxpr(body, [], [*invars, *slots], outvars, eqns), []))
        outer = [v for c in copies for v in c[2]]
        return eqn.replace(invars=[*eqn.invars, *outer], params=cond_params(eqn.params, branches))

    def copy_while(self, eqn: JaxprEqn, add_const) -> JaxprEqn:
        """The same for a ``while``'s condition and body: the new constants of each lead
        its own constants."""
        parts, operands = while_parts(eqn), list(eqn.invars)
        n_cond = parts.cond_nconsts
        new, extra = [], []
        for closed in (parts.cond, parts.body):
            jaxpr, consts = open_jaxpr(closed)
            (invars, outvars, eqns), inner, outer = self.copy_body(jaxpr, consts, add_const)
            new.append(ClosedJaxpr(new_jaxpr(jaxpr, [], [*inner, *invars], outvars, eqns), []))
            extra.append(outer)
        (cond_extra, body_extra) = extra
        params = while_params(eqn.params, *new, len(cond_extra), len(body_extra))
        invars = [*cond_extra, *operands[:n_cond], *body_extra, *operands[n_cond:]]
        return eqn.replace(invars=invars, params=params)


def branch_extra_invars(i: int, extras: Sequence[Sequence[Var]]) -> list[Var]:
    """The extra inputs of branch ``i`` of a ``cond`` whose branches gained the inputs
    ``extras[j]`` (their captured constants), all passed to every branch in branch order:
    its own in its place, unused fresh variables in the other branches'."""
    return [v for j, vs in enumerate(extras) for v in (vs if j == i else [Var(u.aval) for u in vs])]


def new_jaxpr(template: Jaxpr, constvars, invars, outvars, eqns) -> Jaxpr:
    """A jaxpr cut from ``template`` (same effects and function name; argument and
    result names unknown, as their count may differ)."""
    debug_info = template.debug_info.with_unknown_names()
    return Jaxpr(
        list(constvars),
        list(invars),
        list(outvars),
        list(eqns),
        template.effects,
        debug_info=debug_info,
    )
