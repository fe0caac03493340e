"""ZeRO's gradient synchronisation written out as packed collectives
(``shard_parallel/gradients/gradient_sync.py``) for steps differentiated with plain ``jax.grad``
(``shard_parallel/gradients/grad_marking.py``): judged by numerics against ``jax.jit``, by the
collectives counted in the compiled HLO and by the closed-form alpha-beta objective."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import alpa
from alpa.device_mesh import LocalPhysicalDeviceMesh, make_jax_mesh
from alpa.shard_parallel.gradients.grad_marking import gradient_vars, mark_gradients
from alpa.shard_parallel.gradients.packed_collectives import (
    packed_all_gather,
    packed_reduce_scatter,
)
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints
from alpa.testing import assert_allclose
from alpa.tracing.trace import trace_step
from alpa.util import collective_shapes, count_communication_primitives

N = 4  # devices of the logical mesh the methods run on
SIZES = (24, 32, 32, 16)  # input, two hidden layers, output


def _init(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:], strict=False)):
        params[f"w{i}"] = jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    tx = optax.adam(1e-2)
    batch = {
        "x": jnp.asarray(rng.standard_normal((64, SIZES[0])), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((64, SIZES[-1])), jnp.float32),
    }
    return {"params": params, "opt_state": tx.init(params)}, batch, tx


def _loss(params, batch):
    h = batch["x"]
    for i in range(len(SIZES) - 1):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < len(SIZES) - 2:
            h = jnp.tanh(h)
    return jnp.mean((h - batch["y"]) ** 2)


def _step_for(tx, loss=_loss):
    def train_step(state, batch):
        grads = jax.grad(loss)(state["params"], batch)  # plain jax.grad, as Alpa's users
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    return train_step


def _logical_mesh():
    devices = LocalPhysicalDeviceMesh(jax.devices()[:N])
    return devices.get_logical_mesh((N, 1), [1, 1], [1, 1])


def _param_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state["params"]))


def _backward_kernels(state) -> int:
    """Elements per device of the kernels the backward pass reads (all but ``w0``, whose
    input has no gradient), split over ``N`` devices."""
    params = state["params"]
    return sum(params[f"w{i}"].size for i in range(1, len(SIZES) - 1)) // N


@pytest.mark.parametrize(
    "method",
    [
        lambda mesh: alpa.Zero2Parallel(devices=mesh),
        lambda mesh: alpa.Zero3Parallel(devices=mesh),
        lambda mesh: alpa.ShardParallel(
            devices=mesh,
            auto_sharding_option=alpa.AutoShardingOption(
                force_data_parallel=True, prefer_reduce_scatter=True
            ),
        ),
    ],
    ids=["Zero2Parallel", "Zero3Parallel", "ShardParallel-force_data_parallel-reduce_scatter"],
)
def test_zero_with_jax_grad_packs_one_reduce_scatter_and_one_all_gather(method):
    """ZeRO-2 (and ZeRO-3) of a step written with ``jax.grad``: the gradients of all 6
    parameter tensors are reduce-scattered in one collective, the updated parameters
    (ZeRO-3: the parameters before their use in the forward pass) all-gathered in one,
    nothing all-reduced; two steps equal ``jax.jit``'s; the objective is that of those two
    collectives. ZeRO-3 gathers the kernels the backward pass reads again (``w1``, ``w2``)
    once more, packed, with one element more per device (``param_gathers``: the forward
    pass of a ``jax.grad`` step ends at the last parameter's first use); Alpa's objective
    did not count that gather, nor does this one."""
    state, batch, tx = _init()
    step = _step_for(tx)
    expected = jax.jit(step)(jax.jit(step)(state, batch), batch)
    mesh = _logical_mesh()
    p_step = alpa.parallelize(step, method=method(mesh), donate_argnums=())
    got = p_step(p_step(state, batch), batch)
    assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    executable = p_step.get_last_executable()
    hlo = executable.get_hlo_text()
    counts = count_communication_primitives(hlo, ignore_scalar_all_reduce=True)
    zero3 = isinstance(executable.plan.gather_bound, int)
    assert counts == ((3, 0, 2, 1, 0) if zero3 else (2, 0, 1, 1, 0)), counts
    shard = _param_bytes(state) // 4 // N
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{shard}]"]
    again = [f"f32[{N},{_backward_kernels(state) + 1}]"] if zero3 else []
    assert collective_shapes(hlo, "all-gather") == [f"f32[{N},{shard}]", *again]
    # Closed form (alpha = beta = 1): one reduce-scatter and one all-gather of every
    # parameter's bytes, i.e. data parallelism's one all-reduce of them plus one latency.
    param_bytes = _param_bytes(state)
    closed_form = mesh.reduce_scatter_cost(param_bytes, 0) + mesh.all_gather_cost(param_bytes, 0)
    assert executable.auto_sharding_objective == pytest.approx(closed_form, rel=1e-9)


def test_data_parallel_objective_is_one_all_reduce_less_one_latency_than_zero2():
    """DataParallel keeps XLA's combined all-reduce (no marker is added) and is priced as
    one all-reduce of the parameters' bytes: ZeRO-2's objective less one latency."""
    state, batch, tx = _init()
    step = _step_for(tx)
    mesh = _logical_mesh()
    p_step = alpa.parallelize(step, method=alpa.DataParallel(devices=mesh), donate_argnums=())
    assert_allclose(p_step(state, batch), jax.jit(step)(state, batch), rtol=1e-5, atol=1e-5)
    executable = p_step.get_last_executable()
    counts = count_communication_primitives(
        executable.get_hlo_text(), ignore_scalar_all_reduce=True
    )
    assert counts == (1, 1, 0, 0, 0), counts
    closed_form = mesh.all_reduce_cost(_param_bytes(state), 0)
    assert executable.auto_sharding_objective == pytest.approx(closed_form, rel=1e-9)


def test_zero3_gathers_parameters_not_optimizer_state():
    """ZeRO-3's packed gathers hold the parameters only (all of them for the forward
    pass, the kernels that the backward pass reads again): Adam's moments stay split, and
    so do the updated parameters."""
    state, batch, tx = _init()
    step = _step_for(tx)
    p_step = alpa.parallelize(
        step, method=alpa.Zero3Parallel(devices=_logical_mesh()), donate_argnums=()
    )
    out = p_step(state, batch)
    for leaf in jax.tree.leaves(out["params"]) + jax.tree.leaves(out["opt_state"]):
        if leaf.ndim:
            assert leaf.sharding.spec == P("x"), leaf.sharding
    hlo = p_step.get_last_executable().get_hlo_text()
    assert collective_shapes(hlo, "all-gather") == [
        f"f32[{N},{_param_bytes(state) // 4 // N}]",
        f"f32[{N},{_backward_kernels(state) + 1}]",
    ]


def test_zero_with_jax_grad_and_micro_batches_still_asks_for_alpa_grad():
    state, batch, tx = _init()
    p_step = alpa.parallelize(
        _step_for(tx), method=alpa.Zero2Parallel(num_micro_batches=2), donate_argnums=()
    )
    with pytest.raises(ValueError, match="Replace jax.grad / jax.value_and_grad by alpa.grad"):
        p_step(state, batch)


def _trace(fun, args):
    names = [f"leaf {i}" for i in range(len(jax.tree.leaves(args)))]
    return trace_step(fun, args, (), (1,), (), names)


def test_mark_gradients_marks_what_jax_grad_returns():
    """The marker's operands are the 6 gradients, in the shapes of the parameters, and
    the marked step computes what the unmarked one does."""
    state, batch, tx = _init()
    traced = _trace(_step_for(tx), (state, batch))
    grads = gradient_vars(traced)
    shapes = sorted(tuple(v.aval.shape) for v in grads)
    assert shapes == sorted(x.shape for x in jax.tree.leaves(state["params"]))
    marked = mark_gradients(traced)
    assert list(marked.grad_marker().invars) == grads
    assert mark_gradients(marked) is marked
    flat = jax.tree.leaves((state, batch))

    def run(closed):
        return jax.jit(
            lambda *xs: eval_jaxpr_with_constraints(closed.jaxpr, closed.consts, xs, {})
        )(*flat)

    assert_allclose(run(marked.closed_jaxpr), run(traced.closed_jaxpr))


def _embedding_loss(params, batch):
    """A token embedding looked up by ``jnp.take`` (a function JAX jits, so its transpose,
    the scatter-add of the table's gradient, is one call equation in the backward pass)
    and a dense head."""
    h = jnp.take(params["embedding"], batch["ids"], axis=0).mean(axis=1)
    return jnp.mean((h @ params["w"] - batch["y"]) ** 2)


def test_jax_grad_marker_follows_gradients_made_inside_inlined_calls():
    """The embedding's gradient is made inside the transposed ``take`` call; once inlined,
    its equations keep the call's ``transpose`` name (``trace.inline_calls``), so the
    marker's operands are the parameters' gradients, the table's included, and not the
    per-example cotangent it was scattered from. ZeRO-2 then reduce-scatters all of them
    in one collective: 1 reduce-scatter, 1 all-gather, nothing all-reduced, numbers equal
    to ``jax.jit``'s."""
    rng = np.random.default_rng(0)
    params = {
        "embedding": jnp.asarray(rng.standard_normal((64, 16)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
    }
    tx = optax.adam(1e-2)
    state = {"params": params, "opt_state": tx.init(params)}
    batch = {
        "ids": jnp.asarray(rng.integers(0, 64, (32, 4)), jnp.int32),
        "y": jnp.asarray(rng.standard_normal((32, 8)), jnp.float32),
    }
    step = _step_for(tx, _embedding_loss)
    traced = _trace(step, (state, batch))
    shapes = sorted(tuple(v.aval.shape) for v in gradient_vars(traced))
    assert shapes == [(16, 8), (64, 16)]

    p_step = alpa.parallelize(step, method=alpa.Zero2Parallel(devices=_logical_mesh()),
                              donate_argnums=())  # fmt: skip
    assert_allclose(p_step(state, batch), jax.jit(step)(state, batch), rtol=1e-5, atol=1e-5)
    hlo = p_step.get_last_executable().get_hlo_text()
    counts = count_communication_primitives(hlo, ignore_scalar_all_reduce=True)
    assert counts == (2, 0, 1, 1, 0), counts


def test_mark_gradients_leaves_a_step_without_backward_pass():
    traced = _trace(lambda params, batch: _loss(params, batch), (_init()[0]["params"], _init()[1]))
    assert not traced.has_backward_pass
    assert mark_gradients(traced) is traced


@pytest.mark.parametrize(
    "shapes, specs",
    [
        ([(16, 24), (4, 8, 6), (40,)], [P("x"), P(None, "x"), P("x")]),
        ([(3, 8)], [P(None, "x")]),
    ],
)
def test_packed_collectives_are_the_unpacked_ones(shapes, specs):
    """One reduce-scatter of per-device partial sums split at different dimensions gives
    each device its block of every sum; one all-gather gives back every tensor whole."""
    n = 8
    mesh = make_jax_mesh(jax.devices()[:n], (n,), ("x",))
    rng = np.random.default_rng(1)
    partials = [rng.standard_normal((n, *s)).astype(np.float32) for s in shapes]
    placed = [jax.device_put(p, NamedSharding(mesh, P("x"))) for p in partials]

    def both(*ps):
        sums = packed_reduce_scatter(ps, specs, mesh, ("x",))
        return sums, packed_all_gather(sums, specs, mesh, ("x",))

    compiled = jax.jit(both).lower(*placed).compile()
    sums, whole = compiled(*placed)
    for p, s, w, spec in zip(partials, sums, whole, specs, strict=True):
        np.testing.assert_allclose(np.asarray(s), p.sum(0), rtol=1e-5, atol=1e-5)
        assert s.sharding.spec == spec
        np.testing.assert_allclose(np.asarray(w), p.sum(0), rtol=1e-5, atol=1e-5)
        assert w.sharding.is_fully_replicated
    counts = count_communication_primitives(compiled.as_text())
    assert (counts.reduce_scatter, counts.all_gather, counts.all_reduce) == (1, 1, 0), counts


def test_packed_collectives_keep_what_the_other_axis_splits():
    """On a (4, 2) mesh, sums split over the model axis ``y`` and reduced over the data
    axis ``x``: each device reduce-scatters its ``y`` block, ``x`` added as the minor axis
    of one dimension (a column-split kernel's rows, a row-split kernel's columns, a split
    bias's blocks split further). One reduce-scatter and one all-gather, and nothing else:
    no value is gathered over ``y``."""
    mesh = make_jax_mesh(jax.devices()[:8], (4, 2), ("x", "y"))
    shapes = [(16, 24), (24, 16), (24,)]
    specs = [P("x", "y"), P("y", "x"), P(("y", "x"))]
    rng = np.random.default_rng(2)
    partials = [rng.standard_normal((4, *s)).astype(np.float32) for s in shapes]
    partial_specs = [P("x", None, "y"), P("x", "y"), P("x", "y")]
    placed = [
        jax.device_put(p, NamedSharding(mesh, s))
        for p, s in zip(partials, partial_specs, strict=True)
    ]

    def both(*ps):
        sums = packed_reduce_scatter(ps, specs, mesh, ("x",))
        return sums, packed_all_gather(sums, specs, mesh, ("x",))

    compiled = jax.jit(both).lower(*placed).compile()
    sums, whole = compiled(*placed)
    for p, s, w, spec, whole_spec in zip(
        partials, sums, whole, specs, [P(None, "y"), P("y"), P("y")], strict=True
    ):
        np.testing.assert_allclose(np.asarray(s), p.sum(0), rtol=1e-5, atol=1e-5)
        assert s.sharding.spec == spec
        np.testing.assert_allclose(np.asarray(w), p.sum(0), rtol=1e-5, atol=1e-5)
        assert w.sharding.spec == whole_spec
    counts = count_communication_primitives(compiled.as_text())
    assert (counts.reduce_scatter, counts.all_gather, counts.total) == (1, 1, 2), counts


@pytest.mark.parametrize("num_micro_batches", [None, 2])
def test_a_returned_loss_rides_in_the_packed_reduce_scatter(num_micro_batches):
    """ZeRO-2 of a step that returns its loss (``alpa.value_and_grad``): the loss's
    per-device partial sum is reduced in the gradients' packed reduce-scatter, a copy in
    each device's row, not by an all-reduce of its own. One reduce-scatter (one element
    per device longer) and one all-gather, no all-reduce even of a scalar; with
    micro-batches, Alpa's accumulate-grad module holds the one reduce-scatter and
    apply-grad the one all-gather. The loss and the state equal ``jax.jit``'s; the
    objective is the closed form of those two collectives."""
    state, batch, tx = _init()

    def step(state, batch):
        loss, grads = alpa.value_and_grad(_loss)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        return new, loss

    expected = jax.jit(step)(state, batch)
    mesh = _logical_mesh()
    method = alpa.Zero2Parallel(devices=mesh, num_micro_batches=num_micro_batches)
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    got = p_step(state, batch)
    assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    executable = p_step.get_last_executable()
    hlo = executable.get_hlo_text()
    shard = _param_bytes(state) // 4 // N
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{shard + 1}]"]
    if num_micro_batches is None:
        assert count_communication_primitives(hlo) == (2, 0, 1, 1, 0)
        param_bytes = _param_bytes(state)
        closed_form = mesh.reduce_scatter_cost(param_bytes + 4 * N, 0) + mesh.all_gather_cost(
            param_bytes, 0
        )
        assert executable.auto_sharding_objective == pytest.approx(closed_form, rel=1e-9)
    else:
        _, accumulate_grad, apply_grad = hlo.split("HloModule")
        assert count_communication_primitives(accumulate_grad) == (1, 0, 0, 1, 0)
        assert count_communication_primitives(apply_grad) == (1, 0, 1, 0, 0)


def test_a_carried_contraction_runs_on_blocks_only_where_they_make_its_block():
    """A weight gradient ``x^T dy`` carried to the marker over ``x`` runs on each device's
    blocks over every axis (``row_sums._manual_dot_specs``) where that gives each device
    its block of the result: the batch contracted over ``x`` alone, ``y`` on one kept
    dimension. Not where ``y`` splits both kept dimensions (each device would hold one
    block of each operand, not the pairs the result needs), nor where it splits a
    contracted one (the block would be a partial sum over ``y`` too)."""
    from alpa.shard_parallel.gradients.row_sums import _manual_dot_specs

    a, b = jnp.zeros((8, 4)), jnp.zeros((8, 6))
    contract_rows = (((0,), (0,)), ((), ()))
    eqn = jax.make_jaxpr(lambda a, b: jax.lax.dot_general(a, b, contract_rows))(a, b).jaxpr.eqns[-1]
    assert eqn.primitive.name == "dot_general"
    dims = {v: (0,) for v in eqn.invars}
    got = _manual_dot_specs(eqn, [P("x"), P("x", "y")], dims, ("x",))
    assert got == ((P("x", None), P("x", "y")), (None, "y"))
    assert _manual_dot_specs(eqn, [P("x", "y"), P("x", "y")], dims, ("x",)) is None
    assert _manual_dot_specs(eqn, [P(("x", "y")), P(("x", "y"))], dims, ("x",)) is None
    assert _manual_dot_specs(eqn, [P("x"), None], dims, ("x",)) is None
