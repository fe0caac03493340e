"""FLOPs of jaxpr equations: the work estimate layer clustering and stage costs share.

* ``dot_general``: ``2 * batch * M * N * K`` (one multiply and one add per term);
* ``conv_general_dilated``: ``2 * output elements * kernel elements per output``;
* equations with a sub-jaxpr (``pjit``, ``checkpoint``/``remat``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``closed_call``, ``cond`` (its most expensive branch), ``while``
  (one trip), ``scan`` (``length`` trips)): the FLOPs of the body;
* anything else: one FLOP per element of its largest operand or result (elementwise ops,
  reductions, copies).

These are estimates of arithmetic, not of time: memory-bound equations count little,
matching what dominates a model's step on an accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from alpa.jax_internals import is_cond, is_scan, open_jaxpr, scan_parts


def _size(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape))


def _sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    out = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, ClosedJaxpr | Jaxpr):
                out.append(open_jaxpr(item)[0])
    return out


def eqn_flops(eqn: JaxprEqn) -> float:
    """The FLOPs of one equation (module docstring)."""
    name = eqn.primitive.name
    if name == "dot_general":
        lhs = eqn.invars[0].aval
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        contract = math.prod(lhs.shape[d] for d in lhs_contract)
        return 2.0 * _size(eqn.outvars[0].aval) * contract
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        dn = eqn.params["dimension_numbers"]
        out_feature = dn.rhs_spec[0] if dn is not None else 0
        per_output = _size(rhs) // max(rhs.shape[out_feature], 1)
        groups = eqn.params.get("batch_group_count", 1)
        return 2.0 * _size(eqn.outvars[0].aval) * per_output / max(groups, 1)
    subs = _sub_jaxprs(eqn)
    if subs:
        costs = [jaxpr_flops(j.eqns) for j in subs]
        if is_cond(eqn):
            return max(costs)
        if is_scan(eqn):
            return scan_parts(eqn).length * sum(costs)
        return float(sum(costs))
    sizes = [_size(v.aval) for v in (*eqn.invars, *eqn.outvars)]
    return float(max(sizes, default=0))


def jaxpr_flops(eqns: Iterable[JaxprEqn]) -> float:
    """The FLOPs of a list of equations."""
    return float(sum(eqn_flops(e) for e in eqns))
