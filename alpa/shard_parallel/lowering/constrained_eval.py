"""A jaxpr evaluated under a plan's sharding constraints.

The jaxpr is re-evaluated equation by equation (under ``jax.jit``, by the callers); every
value the plan pins gets ``jax.lax.with_sharding_constraint`` and XLA's SPMD partitioner
does the rest (``docs/auto_sharding.md``, Lowering). Bodies (checkpoint, scan, while, cond)
are evaluated with the same constraints and bound again, so loops stay loops. The one-mesh
step functions (``lowering/step_function.py``) and the pipeline's stages
(``executables/stage_programs.py``) are built on it.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var
from jax.sharding import NamedSharding, PartitionSpec

from alpa.jax_internals import (
    bind_params,
    cond_branches,
    cond_params,
    eqn_context,
    is_remat,
    open_jaxpr,
    remat_body,
    remat_params,
    scan_params,
    scan_parts,
    while_params,
    while_parts,
)
from alpa.shard_parallel.gradients.row_sums import DeferredBody
from alpa.shard_parallel.strategies.strategy_graph import USER_SHARDINGS
from alpa.tracing import new_jaxpr
from alpa.tracing.trace import branch_extra_invars


def eval_jaxpr_with_constraints(
    jaxpr: Jaxpr,
    consts,
    args,
    constraints: dict,
    operand_constraints: dict | None = None,
    overrides: dict | None = None,
    rebinds: dict | None = None,
) -> list:
    """Evaluate ``jaxpr``, pinning every var in ``constraints`` to its sharding.

    ``operand_constraints[eqn][j]`` (a sharding or ``None``) reshards operand ``j`` of
    ``eqn`` just before ``eqn`` reads it: the plan's resharding edges. Without it XLA's
    partitioner would decide how to feed the consumer from the producer's sharding, and it
    may all-gather where the plan priced an all-to-all.

    A ``remat2`` (checkpoint) equation is bound again around its body evaluated with the
    same constraints (:func:`_checkpoint_with_constraints`): the plan pins the body's values,
    and the recomputation stays in the program. So are a ``scan``, a ``while`` and a
    ``cond`` (:func:`_scan_with_constraints`, :func:`_while_with_constraints`,
    :func:`_cond_with_constraints`): loops stay loops, branches branches. The user's own
    ``with_sharding_constraint`` (or ``reshard``) of a value the plan pins is replaced by
    the plan's constraint, the same sharding on alpa's mesh.

    ``overrides[eqn]``, where given, computes ``eqn``'s outputs from its operands as read,
    and they are stored as returned, unconstrained: gradient accumulation's deferred row
    sums (``row_sums.deferred_rules``), whose values have a shape of their own.

    ``rebinds[eqn](read)``, where given, runs before ``eqn`` and returns new values of
    some vars (stored as returned, unconstrained), which ``eqn`` and the equations after it
    read: ZeRO-3's parameters gathered before their first use in each pass and split
    again after (``param_gathers``).
    """
    env: dict[Var, Any] = {}
    resharded: dict[tuple[Var, Any], Any] = {}
    operand_constraints = operand_constraints or {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def read_as(v, sharding):
        if sharding is None or isinstance(v, Literal):
            return read(v)
        key = (v, sharding)
        if key not in resharded:  # one resharding per value and spec, shared by readers
            resharded[key] = jax.lax.with_sharding_constraint(env[v], sharding)
        return resharded[key]

    def write(v, value):
        sharding = constraints.get(v)
        if sharding is not None:
            value = jax.lax.with_sharding_constraint(value, sharding)
        env[v] = value

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        write(v, a)
    overrides, rebinds = overrides or {}, rebinds or {}
    for eqn in jaxpr.eqns:
        if eqn in rebinds:
            new = rebinds[eqn](read)
            env.update(new)
            for key in [k for k in resharded if k[0] in new]:
                del resharded[key]
        override = overrides.get(eqn)
        if override is not None and not isinstance(override, DeferredBody):
            outs = override([read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))
            continue
        params = bind_params(eqn)
        needs = operand_constraints.get(eqn) or (None,) * len(eqn.invars)
        operands = [read_as(v, n) for v, n in zip(eqn.invars, needs, strict=True)]
        if eqn.primitive.name in USER_SHARDINGS and eqn.outvars[0] in constraints:
            # The user's sharding, which the plan pins on its own mesh: the same sharding.
            write(eqn.outvars[0], operands[0])
            continue
        # Bodies are evaluated again with the plan's constraints, and with the overrides
        # of their own equations (a scan's row sums deferred through its stacked outputs).
        inner = (constraints, operand_constraints, overrides)
        rewrite = bool(constraints or operand_constraints or override is not None)
        if is_remat(eqn) and rewrite:
            params, extra = _checkpoint_with_constraints(params, *inner)
            operands += extra
        elif eqn.primitive is lax.scan_p and rewrite:
            params, operands = _scan_with_constraints(params, operands, *inner)
        elif eqn.primitive is lax.while_p and rewrite:
            params, operands = _while_with_constraints(params, operands, *inner)
        elif eqn.primitive is lax.cond_p and rewrite:
            results = [constraints.get(v) for v in eqn.outvars]
            params, operands = _cond_with_constraints(params, operands, results, *inner)
        with eqn_context(eqn):
            outs = eqn.primitive.bind(*operands, **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        if override is not None:  # partial sums among the outputs: stored as they are
            outs = override.finish(outs)
            for i in override.positions:
                env[eqn.outvars[i]] = outs[i]
        for i, (v, value) in enumerate(zip(eqn.outvars, outs, strict=True)):
            if override is None or i not in override.positions:
                write(v, value)
    return [read(v) for v in jaxpr.outvars]


def _checkpoint_with_constraints(
    params: dict, constraints: dict, operand_constraints: dict, overrides: dict | None = None
) -> tuple[dict, list]:
    """The parameters that bind a ``remat2`` equation (of parameters ``params``) with its
    body's values pinned as ``constraints`` and ``operand_constraints`` say, and the
    operands to append to its own (the constants of the constrained body, which a
    checkpoint body may not close over).

    ``jax.checkpoint`` would not do: its equation is not ``differentiated``, and only a
    differentiated checkpoint is lowered behind an optimization barrier that stops XLA from
    merging the recomputed forward with the original one. So the body is traced with its
    constraints and bound with the equation's own parameters (``prevent_cse``,
    ``differentiated``, ``policy``).
    """
    body = remat_body(params)

    def constrained(*args):
        return eval_jaxpr_with_constraints(
            body, (), args, constraints, operand_constraints, overrides
        )

    new_body, consts = _retrace(body, constrained, consts_first=False)
    return remat_params(params, new_body, len(consts)), consts


def _scan_with_constraints(
    params: dict,
    operands: list,
    constraints: dict,
    operand_constraints: dict,
    overrides: dict | None = None,
) -> tuple[dict, list]:
    """The parameters and operands that bind a ``scan`` (of parameters ``params`` and
    operands ``operands``) with its body's values pinned as the plan says.

    The plan pins each carry and each row of a stacked input inside the body (the body's
    inputs in ``constraints``): the initial carries are resharded to the carries' specs
    before the loop, the stacked inputs to their rows' specs (the scanned axis whole), and
    each iteration's new carries back to the carries' specs, so that the loop's state has
    one sharding throughout. The loop stays a loop: the body is traced once, with its
    constraints, and bound with the scan's own parameters.
    """
    parts = scan_parts(params)
    body, body_consts = open_jaxpr(parts.body)
    n_consts, n_carry = parts.num_consts, parts.num_carry
    carry_specs = [constraints.get(v) for v in body.invars[n_consts : n_consts + n_carry]]

    def constrained(*args):
        outs = eval_jaxpr_with_constraints(
            body, body_consts, args, constraints, operand_constraints, overrides
        )
        carries = [pinned(x, s) for x, s in zip(outs[:n_carry], carry_specs, strict=True)]
        return carries + outs[n_carry:]

    new_body, consts = _retrace(body, constrained)
    operands = list(operands)
    for j, v in enumerate(body.invars[n_consts:], start=n_consts):
        sharding = constraints.get(v)
        if j >= n_consts + n_carry and sharding is not None:  # a row: the whole stack
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        operands[j] = pinned(operands[j], sharding)
    params = scan_params(params, body=ClosedJaxpr(new_body, ()), num_new_consts=len(consts))
    return params, [*consts, *operands]


def _while_with_constraints(
    params: dict,
    operands: list,
    constraints: dict,
    operand_constraints: dict,
    overrides: dict | None = None,
) -> tuple[dict, list]:
    """The parameters and operands that bind a ``while`` with its condition's and body's
    values pinned, the initial carries resharded to the carries' specs and each
    iteration's new carries back to them (as :func:`_scan_with_constraints`)."""
    parts = while_parts(params)
    (cond, cond_consts), (body, body_consts) = open_jaxpr(parts.cond), open_jaxpr(parts.body)
    n_cond, n_body = parts.cond_nconsts, parts.body_nconsts
    carry_specs = [constraints.get(v) for v in body.invars[n_body:]]

    def run_cond(*args):
        return eval_jaxpr_with_constraints(
            cond, cond_consts, args, constraints, operand_constraints, overrides
        )

    def run_body(*args):
        outs = eval_jaxpr_with_constraints(
            body, body_consts, args, constraints, operand_constraints, overrides
        )
        return [pinned(x, s) for x, s in zip(outs, carry_specs, strict=True)]

    new_cond, cond_extra = _retrace(cond, run_cond)
    new_body, body_extra = _retrace(body, run_body)
    new_params = while_params(
        params,
        ClosedJaxpr(new_cond, ()),
        ClosedJaxpr(new_body, ()),
        len(cond_extra),
        len(body_extra),
    )
    inits = [pinned(x, s) for x, s in zip(operands[n_cond + n_body :], carry_specs, strict=True)]
    operands = [
        *cond_extra,
        *operands[:n_cond],
        *body_extra,
        *operands[n_cond : n_cond + n_body],
        *inits,
    ]
    return new_params, operands


def _cond_with_constraints(
    params: dict,
    operands: list,
    results: list,
    constraints: dict,
    operand_constraints: dict,
    overrides: dict | None = None,
) -> tuple[dict, list]:
    """The parameters and operands that bind a ``cond`` with its branches' values pinned as
    the plan says and every branch's results pinned to ``results`` (the shardings of the
    ``cond``'s results), so that the branches agree. Each branch is traced once with its
    constraints; constants its trace captures become extra last operands."""
    branches, traced = [open_jaxpr(b) for b in cond_branches(params)], []
    for branch, branch_consts in branches:

        def constrained(*args, branch=branch, branch_consts=branch_consts):
            outs = eval_jaxpr_with_constraints(
                branch, branch_consts, args, constraints, operand_constraints, overrides
            )
            return [pinned(x, s) for x, s in zip(outs, results, strict=True)]

        traced.append(jax.make_jaxpr(constrained)(*_avals(branch.invars)))
    new_branches = []
    for i, closed in enumerate(traced):
        inner = closed.jaxpr
        slots = branch_extra_invars(i, [other.jaxpr.constvars for other in traced])
        invars = [*inner.invars, *slots]
        template = branches[i][0]
        new_branches.append(
            ClosedJaxpr(new_jaxpr(template, (), invars, inner.outvars, inner.eqns), ())
        )
    consts = [c for closed in traced for c in closed.consts]
    return cond_params(params, new_branches), [*operands, *consts]


def _retrace(template: Jaxpr, fun, consts_first: bool = True) -> tuple[Jaxpr, list]:
    """``fun``, which evaluates ``template`` with constraints, traced on ``template``'s
    input types: a jaxpr whose captured constants are extra inputs (leading, or after
    ``template``'s own), and those constants."""
    traced = jax.make_jaxpr(fun)(*_avals(template.invars))
    inner = traced.jaxpr
    invars = (
        [*inner.constvars, *inner.invars] if consts_first else [*inner.invars, *inner.constvars]
    )
    return new_jaxpr(template, (), invars, inner.outvars, inner.eqns), list(traced.consts)


def _avals(invars) -> list:
    return [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in invars
    ]


def pinned(x, sharding):
    """``x`` constrained to ``sharding`` (``None``: left as it is)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
