"""The user's shardings are constraints of the ILP.

A ``jax.lax.with_sharding_constraint`` (a ``NamedSharding``, or a ``PartitionSpec`` under
``jax.set_mesh``) on a mesh that is the plan's logical mesh under other names pins that
value's spec in the strategy graph (its transpose in the backward pass too), and the
lowering pins it on alpa's mesh; arguments the caller placed with a ``NamedSharding`` on
such a mesh keep their placement (``fixed_in_specs``). Oracles, on 8 virtual CPU devices
as a 2 x 4 mesh whose axes the user calls ``a`` and ``b`` (alpa's ``x`` and ``y``):

* the plan holds the constraint (the value's spec, and the result's when it is returned),
  the numbers equal ``jax.jit``'s, and an inference step's program has no collective the
  plan did not price (passed through unplanned, the constraint cost two or three
  collectives more than without it, none of them priced) and at most two more than
  without the constraint: a resharding into its spec and one out of it (a batch split over
  both axes, ``P(('a', 'b'), None)``, between two Megatron matmuls: two all-to-alls);
* a constraint or an argument on another mesh is named in a warning;
* an argument placed by the caller arrives in its own spec, not the one the ILP picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import alpa
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.ilp import ilp_solver
from alpa.testing import assert_allclose
from alpa.testing import run_auto_sharded as _compile
from alpa.testing import unit_cost_mesh as _mesh
from alpa.tracing.trace import trace_step
from alpa.util import count_communication_primitives

H, B = 256, 64

#: Alpa's axis names for the user's, by position.
ALPA_NAMES = {"a": "x", "b": "y"}


def _user_mesh(n: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), ("a", "b"))


def _in_alpa_names(spec: P) -> P:
    def rename(entry):
        if entry is None:
            return None
        if isinstance(entry, str):
            return ALPA_NAMES[entry]
        return tuple(ALPA_NAMES[n] for n in entry)

    entries = [rename(e) for e in spec]
    while entries and entries[-1] is None:  # as alpa writes its specs
        entries.pop()
    return P(*entries)


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    w = {
        "a": jax.random.normal(k[0], (H, 4 * H)) * 0.1,
        "b": jax.random.normal(k[1], (4 * H, H)) * 0.1,
    }
    batch = {"x": jax.random.normal(k[2], (B, H)), "y": jax.random.normal(k[3], (B, H))}
    return w, batch


def _forward(constrain):
    def forward(w, batch):
        h = constrain(jnp.tanh(batch["x"] @ w["a"]))
        return h @ w["b"], h

    return forward


SPECS = [P("a", None), P(None, "b"), P("a", "b"), P(None, ("a", "b")), P(("a", "b"), None)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_constraint_is_what_the_program_has(spec):
    mesh = _user_mesh()

    def constrain(h):
        return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec))

    w, batch = _inputs()
    constrained = _forward(constrain)
    out, executable = _compile(constrained, w, batch, (2, 4))
    assert_allclose(out, jax.jit(constrained)(w, batch), rtol=1e-4, atol=1e-4)
    plan = executable.plan
    assert plan.out_specs[1] == _in_alpa_names(spec)  # the constrained value, returned
    pinned = [s for v, s in plan.var_specs.items() if v in _constraint_outvars(executable)]
    assert pinned == [_in_alpa_names(spec)]
    _, free = _compile(_forward(lambda h: h), w, batch, (2, 4))
    with_constraint = count_communication_primitives(executable.get_hlo_text()).total
    without = count_communication_primitives(free.get_hlo_text()).total
    # No collective the plan did not price (XLA may do two priced ones in one): the
    # resharding into the constraint's spec, and out of it where the next reader splits
    # otherwise.
    solution = solve_auto_sharding(executable.traced, plan.logical_mesh)
    priced = ilp_solver.collectives(solution.graph, solution.solution.choice)
    assert with_constraint <= len(priced), (with_constraint, priced)
    assert with_constraint <= without + 2, (with_constraint, without)
    # The ILP priced the constraint: never below the unconstrained optimum.
    assert plan.objective >= free.plan.objective - 1e-6


def _constraint_outvars(executable) -> set:
    return {
        e.outvars[0]
        for e in executable.traced.jaxpr.eqns
        if e.primitive.name == "sharding_constraint"
    }


def test_a_partition_spec_under_set_mesh_and_its_transpose_are_pinned():
    """A ``PartitionSpec`` under ``jax.set_mesh`` (an abstract mesh in the jaxpr) in a
    train step: the forward value and its cotangent (the transposed constraint) are
    pinned, and the step equals ``jax.jit``'s."""
    mesh = _user_mesh()

    def step(w, batch):
        def loss(w):
            h = jax.lax.with_sharding_constraint(jnp.tanh(batch["x"] @ w["a"]), P("a", None))
            return jnp.mean((h @ w["b"] - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(w)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), value

    w, batch = _inputs()
    with jax.set_mesh(mesh):
        out, executable = _compile(step, w, batch, (2, 4))
        expected = jax.jit(step)(w, batch)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    outvars = _constraint_outvars(executable)
    assert len(outvars) == 2  # forward and transposed
    assert {executable.plan.var_specs[v] for v in outvars} == {P("x")}


def test_a_constraint_on_another_mesh_is_named():
    small = _user_mesh(4)

    def forward(w, batch):
        h = jnp.tanh(batch["x"] @ w["a"])
        return jax.lax.with_sharding_constraint(h, NamedSharding(small, P("a")))

    w, batch = _inputs()
    traced = trace_step(forward, (w, batch), (), (1,), (), ("w", "batch"))
    with pytest.warns(UserWarning, match=r"1 with_sharding_constraint\(s\) name another mesh"):
        solve_auto_sharding(traced, _mesh((2, 4)))


def test_arguments_placed_by_the_caller_keep_their_placement():
    """``w['a']`` placed row-split over the user's ``b`` axis (the ILP alone splits its
    columns): the plan takes it as it arrives. An argument on a 4-device mesh is
    re-placed, with a warning that names it."""
    w, batch = _inputs()
    forward = _forward(lambda h: h)
    _, free = _compile(forward, w, batch, (2, 4))
    assert free.plan.in_specs[0] != P("y")
    placed = dict(w, a=jax.device_put(w["a"], NamedSharding(_user_mesh(), P("b", None))))
    out, executable = _compile(forward, placed, batch, (2, 4))
    assert executable.plan.in_specs[0] == P("y")
    assert_allclose(out, jax.jit(forward)(w, batch), rtol=1e-4, atol=1e-4)

    elsewhere = dict(w, b=jax.device_put(w["b"], NamedSharding(_user_mesh(4), P("b"))))
    method = alpa.ShardParallel(devices=_mesh((2, 4)))
    p_forward = alpa.parallelize(forward, method=method, donate_argnums=())
    with pytest.warns(UserWarning, match=r"1 argument leaves are placed on another mesh.*\['b'\]"):
        out = p_forward(elsewhere, batch)
    assert_allclose(out, jax.jit(forward)(w, batch), rtol=1e-4, atol=1e-4)


def test_a_batch_placed_by_the_caller_keeps_its_placement():
    """A batch argument's leaf placed by the caller (``x`` split by features over the
    user's ``b`` axis) arrives as placed, as any other argument's: it was re-placed, split
    by rows, because the batch was handed to the planner without its sharding."""
    w, batch = _inputs()
    forward = _forward(lambda h: h)
    _, free = _compile(forward, w, batch, (2, 4))
    x = len(free.plan.in_specs) - 2  # the batch's leaves come last: x, y
    assert free.plan.in_specs[x] != P(None, "y")
    placed = dict(batch, x=jax.device_put(batch["x"], NamedSharding(_user_mesh(), P(None, "b"))))
    out, executable = _compile(forward, w, placed, (2, 4))
    assert executable.plan.in_specs[x] == P(None, "y")
    assert_allclose(out, jax.jit(forward)(w, batch), rtol=1e-4, atol=1e-4)
