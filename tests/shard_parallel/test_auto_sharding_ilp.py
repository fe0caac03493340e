"""The auto-sharding ILP judged by closed-form objectives (oracles: docs/design.md).

An MLP train step (``L`` dense layers with bias, mean squared error, SGD update) is planned
on 1-D and 2-D logical meshes. Each expected objective is derived here from the same
``LogicalDeviceMesh`` cost functions the planner uses, as communication plus compute:

* data parallel: the gradients (and the scalar loss) are independent reductions, which XLA
  combines into one all-reduce per mesh axis: one latency and the bytes of all of them;
* Megatron (first kernel split by columns, second by rows): one forward all-reduce of the
  ``batch x hidden`` activations; the backward pass needs none (the input's gradient is
  not computed);
* 2-D: data parallel over mesh axis 0 (gradients of split kernels are 1/n1 of the size)
  and Megatron over axis 1 (activations are 1/n0 of the batch);
* compute: the step's matmuls, ``L`` forward, ``L`` kernel gradients and ``L - 1`` input
  gradients of ``2 * batch * hidden**2`` FLOPs each, split over every device by all three
  plans, at the mesh's ``device_flops``. These meshes turn the memory term off
  (``memory_bandwidth=inf``); :func:`test_memory_term_in_closed_form` prices it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from alpa.device_mesh import LogicalDeviceMesh
from alpa.shard_parallel.auto_sharding import AutoShardingOption, solve_jaxpr
from alpa.shard_parallel.ilp.ilp_solver import (
    InfeasibleMemoryBudgetError,
    peak_memory,
    smallest_peak_memory,
)
from alpa.util import count_communication_primitives

F32 = 4


def mlp_step_jaxpr(batch: int, hidden: int, num_layers: int = 2):
    def step(params, x, y):
        def loss_fn(p):
            h = x
            for i in range(num_layers):
                h = h @ p[f"w{i}"] + p[f"b{i}"]
                if i < num_layers - 1:
                    h = jnp.maximum(h, 0.0)  # jax.nn.relu is a custom_jvp call
            return jnp.mean((h - y) ** 2)

        grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    params = {}
    for i in range(num_layers):
        params[f"w{i}"] = jax.ShapeDtypeStruct((hidden, hidden), jnp.float32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((hidden,), jnp.float32)
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    closed = jax.make_jaxpr(step)(params, x, x)
    num_params = 2 * num_layers
    return closed, (False,) * num_params + (True, True)


def solve_mlp(closed, mesh, option=None, batch_invars=()):
    """Solve with the updated parameters tied to the parameters (train-state pairs)."""
    num_params = len(closed.jaxpr.outvars)
    pairs = tuple((i, i) for i in range(num_params))
    return solve_jaxpr(closed, mesh, option, batch_invars=batch_invars, state_pairs=pairs)


def cost_mesh(shape, alpha=(1, 1), beta=(1, 1)) -> LogicalDeviceMesh:
    """A mesh whose memory term is off: objectives are communication plus matmul FLOPs."""
    return LogicalDeviceMesh(shape, alpha, beta, memory_bandwidth=math.inf)


def data_parallel_cost(mesh, hidden, num_layers, axes):
    """One combined all-reduce per axis of every gradient (the step returns no loss: its
    reduction is dead code, which neither XLA nor the plan computes)."""
    total = (hidden * hidden * F32 + hidden * F32) * num_layers
    return sum(mesh.all_reduce_cost(total, a) for a in axes)


def megatron_cost(mesh, batch, hidden, num_layers, axis):
    return (num_layers - 1) * mesh.all_reduce_cost(batch * hidden * F32, axis)


def matmul_cost(mesh, batch, hidden, num_layers, shards):
    """The step's ``3L - 1`` matmuls of ``2 * batch * hidden**2`` FLOPs, ``shards`` ways."""
    return (3 * num_layers - 1) * 2 * batch * hidden**2 / shards / mesh.device_flops


MESHES_1D = [(1, 4), (1, 8), (4, 1), (8, 1)]
ALPHA_BETA = [((1, 1), (1, 1)), ((1, 1), (1, 0.1))]


@pytest.mark.parametrize("shape", MESHES_1D)
@pytest.mark.parametrize("alpha,beta", ALPHA_BETA)
def test_large_batch_small_hidden_is_data_parallel(shape, alpha, beta):
    mesh = cost_mesh(shape, alpha, beta)
    axis = 0 if shape[0] > 1 else 1
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    compute = matmul_cost(mesh, 1024, 16, 2, mesh.num_devices)
    assert solution.objective == pytest.approx(data_parallel_cost(mesh, 16, 2, [axis]) + compute)
    plan = solution.to_sharding_plan()
    name = mesh.axis_names[axis]
    assert plan.in_specs[:4] == (P(),) * 4  # parameters replicated
    assert plan.in_specs[4] == P(name) and plan.data_axes == (name,)


@pytest.mark.parametrize("shape", MESHES_1D)
@pytest.mark.parametrize("alpha,beta", ALPHA_BETA)
def test_small_batch_large_hidden_is_megatron(shape, alpha, beta):
    mesh = cost_mesh(shape, alpha, beta)
    axis = 0 if shape[0] > 1 else 1
    closed, batch = mlp_step_jaxpr(batch=16, hidden=512)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    compute = matmul_cost(mesh, 16, 512, 2, mesh.num_devices)
    assert solution.objective == pytest.approx(megatron_cost(mesh, 16, 512, 2, axis) + compute)
    plan = solution.to_sharding_plan()
    name = mesh.axis_names[axis]
    # in order b0, b1, w0, w1 (pytree order): column then row.
    assert plan.in_specs[2] == P(None, name)
    assert plan.in_specs[3] == P(name)


def test_fixed_input_specs_are_planned_around():
    """Large batch, small hidden: free, the plan is data parallel. With the batch ``x``
    fixed to arrive split by features, the cheapest plan turns it into a batch split with
    an all-to-all and is data parallel from there: the ILP prices the fixed spec instead of
    choosing another. ``x`` has two readers (the first layer's matmul and its kernel
    gradient) that read it in one spec: one all-to-all, shared (``shared_resharding``), as
    the program reshards it once."""
    mesh = cost_mesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16)
    free = solve_mlp(closed, mesh, batch_invars=batch)
    dp = data_parallel_cost(mesh, 16, 2, (1,)) + matmul_cost(mesh, 1024, 16, 2, 4)
    assert free.objective == pytest.approx(dp)
    # in order b0, b1, w0, w1, x, y.
    fixed = (None,) * 4 + (P(None, "y"), None)
    pairs = tuple((i, i) for i in range(4))
    pinned = solve_jaxpr(closed, mesh, batch_invars=batch, state_pairs=pairs, fixed_in_specs=fixed)
    x_bytes = 1024 * 16 * F32
    assert pinned.objective == pytest.approx(dp + mesh.all_to_all_cost(x_bytes, 1))
    assert pinned.to_sharding_plan().in_specs[4] == P(None, "y")
    assert free.to_sharding_plan().in_specs[4] == P("y")


def test_bad_fixed_input_specs():
    mesh = LogicalDeviceMesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=16, hidden=16)
    with pytest.raises(ValueError, match="fixed_in_specs has 1 entries but the jaxpr has 6"):
        solve_jaxpr(closed, mesh, batch_invars=batch, fixed_in_specs=(P(),))
    bad = (P("model"),) + (None,) * 5
    with pytest.raises(
        ValueError, match=r"names mesh axis 'model'; the mesh's axes are \('x', 'y'\)"
    ):
        solve_jaxpr(closed, mesh, batch_invars=batch, fixed_in_specs=bad)


def test_four_layer_megatron_has_three_all_reduces():
    mesh = cost_mesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=16, hidden=512, num_layers=4)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    compute = matmul_cost(mesh, 16, 512, 4, 4)
    assert solution.objective == pytest.approx(megatron_cost(mesh, 16, 512, 4, 1) + compute)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2)])
def test_2d_mesh_large_batch_is_data_parallel_on_both_axes(shape):
    # Splitting the batch over both axes is the mixed mesh shape (one dimension, two axes).
    mesh = cost_mesh(shape, (1, 1), (1, 0.1))
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16)
    option = AutoShardingOption(allow_mixed_mesh_shape=True)
    solution = solve_mlp(closed, mesh, option, batch_invars=batch)
    compute = matmul_cost(mesh, 1024, 16, 2, mesh.num_devices)
    assert solution.objective == pytest.approx(data_parallel_cost(mesh, 16, 2, [0, 1]) + compute)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2)])
def test_2d_mesh_is_data_parallel_plus_megatron(shape):
    batch_size, hidden = 512, 128
    mesh = cost_mesh(shape, (1, 1), (1, 0.1))
    n0, n1 = shape
    closed, batch = mlp_step_jaxpr(batch_size, hidden)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    gradients = (
        2 * hidden * hidden * F32 / n1  # split kernels' gradients
        + hidden * F32 / n1  # first bias, split by columns
        + hidden * F32  # second bias, whole (the loss is not returned: dead code)
    )
    expected = (
        mesh.all_reduce_cost(gradients, 0)  # combined: one latency
        + megatron_cost(mesh, batch_size // n0, hidden, 2, 1)
        + matmul_cost(mesh, batch_size, hidden, 2, n0 * n1)
    )
    assert solution.objective == pytest.approx(expected)
    plan = solution.to_sharding_plan()
    assert plan.data_axes == ("x",)
    assert plan.in_specs[2] == P(None, "y") and plan.in_specs[3] == P("y")


def test_plan_is_deterministic():
    mesh = LogicalDeviceMesh((2, 4), (1, 1), (1, 0.1))
    closed, batch = mlp_step_jaxpr(128, 128)
    first = solve_mlp(closed, mesh, batch_invars=batch)
    second = solve_mlp(closed, mesh, batch_invars=batch)
    assert first.solution.choice == second.solution.choice
    assert first.to_sharding_plan().in_specs == second.to_sharding_plan().in_specs


def test_force_batch_dim_to_mesh_dim():
    mesh = LogicalDeviceMesh((2, 4), (1, 1), (1, 0.1))
    closed, batch = mlp_step_jaxpr(batch=16, hidden=512)
    option = AutoShardingOption(force_batch_dim_to_mesh_dim=1)
    plan = solve_mlp(closed, mesh, option, batch_invars=batch).to_sharding_plan()
    assert plan.data_axes == ("y",)
    assert plan.in_specs[4][0] == "y" and plan.in_specs[5][0] == "y"


def test_force_data_parallel_flattens_the_mesh():
    mesh = cost_mesh((2, 4))
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16)
    option = AutoShardingOption(force_data_parallel=True)
    solution = solve_mlp(closed, mesh, option, batch_invars=batch)
    plan = solution.to_sharding_plan()
    assert plan.logical_mesh.shape == (1, 8)
    assert plan.in_specs[:4] == (P(),) * 4
    assert plan.data_axes == ("y",)
    flat = mesh.one_axis()
    compute = matmul_cost(flat, 1024, 16, 2, 8)
    assert solution.objective == pytest.approx(data_parallel_cost(flat, 16, 2, [1]) + compute)


def test_no_replicated_parameters():
    mesh = LogicalDeviceMesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16)
    option = AutoShardingOption(allow_replicated_parameters=False)
    plan = solve_mlp(closed, mesh, option, batch_invars=batch).to_sharding_plan()
    assert all(spec != P() for spec in plan.in_specs[:4])


def test_memory_budget_changes_the_plan():
    mesh = LogicalDeviceMesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=512, hidden=128)
    free = solve_mlp(closed, mesh, batch_invars=batch)
    free_peak = peak_memory(free.graph, free.solution.choice)
    smallest = smallest_peak_memory(free.graph, time_limit=30)
    assert smallest < free_peak
    budget = (smallest + free_peak) / 2
    option = AutoShardingOption(memory_budget_per_device=budget)
    tight = solve_mlp(closed, mesh, option, batch_invars=batch)
    assert tight.solution.peak_memory <= budget
    assert tight.objective > free.objective
    assert tight.to_sharding_plan().in_specs != free.to_sharding_plan().in_specs


def test_impossible_memory_budget_names_the_budget():
    mesh = LogicalDeviceMesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=64, hidden=64)
    option = AutoShardingOption(memory_budget_per_device=1000)
    with pytest.raises(InfeasibleMemoryBudgetError, match=r"memory_budget_per_device=1000 bytes"):
        solve_mlp(closed, mesh, option, batch_invars=batch)
    with pytest.raises(InfeasibleMemoryBudgetError, match=r"smallest plan found needs \d+ bytes"):
        solve_mlp(closed, mesh, option, batch_invars=batch)


def test_unknown_primitive_runs_replicated_with_one_warning():
    prim = jax.extend.core.Primitive("my_custom_op")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: x)

    def f(x, w):
        y = prim.bind(x @ w)
        return prim.bind(y) @ w

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    closed = jax.make_jaxpr(f)(x, x)
    with pytest.warns(UserWarning, match="no strategy rule for my_custom_op") as record:
        solution = solve_jaxpr(closed, LogicalDeviceMesh((1, 4)), batch_invars=(True, False))
    assert len(record) == 1
    rows = {row[0]: row for row in solution.rows()}
    assert rows["eqn 1 my_custom_op"][3] == "RR"


def test_format_table_lists_every_value():
    mesh = LogicalDeviceMesh((1, 4))
    closed, batch = mlp_step_jaxpr(batch=16, hidden=512)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    table = solution.format_table()
    assert "dot_general" in table and "objective" in table
    assert len(table.splitlines()) == len(solution.graph.nodes) + 2
    communication = solution.objective - solution.compute
    assert f"communication {communication:.6g}, compute {solution.compute:.6g}" in table
    assert "communication first minimized" in table  # the matmuls split 4 ways


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(force_batch_dim_to_mesh_dim=2), "force_batch_dim_to_mesh_dim"),
        (dict(memory_budget_per_device=-1), "memory_budget_per_device"),
        (dict(logical_mesh_shape=(2, 0)), "logical_mesh_shape"),
        (dict(mesh_beta=(1,)), "mesh_beta"),
        (dict(prefer_reduce_scatter=1), "prefer_reduce_scatter must be a bool"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AutoShardingOption(**kwargs)


def test_resharding_costs_follow_the_mesh_cost_functions():
    from alpa.shard_parallel.strategies.sharding_spec import resharding_cost

    mesh = LogicalDeviceMesh((2, 4), (1, 1), (1, 0.1))
    size = 1024.0
    assert resharding_cost(((), ()), ((0,), (1,)), size, mesh) == 0.0  # slicing is free
    assert resharding_cost(((1,), ()), ((), ()), size, mesh) == mesh.all_gather_cost(size, 1)
    # An all-to-all is priced on the tensor the axis's 4 devices exchange: the whole value.
    assert resharding_cost(((1,), ()), ((), (1,)), size, mesh) == mesh.all_to_all_cost(size, 1)
    no_a2a = resharding_cost(((1,), ()), ((), (1,)), size, mesh, allow_all_to_all=False)
    assert no_a2a == mesh.all_gather_cost(size, 1)
    assert np.isclose(
        resharding_cost(((0,), (1,)), ((), ()), size, mesh),
        mesh.all_gather_cost(size / 4, 0) + mesh.all_gather_cost(size, 1),
    )


@pytest.mark.parametrize(
    "src, dst, kinds",
    [
        (((), (0, 1)), ((), (0,)), ["all-gather"]),  # the minor axis is gathered
        (((0, 1), ()), ((0,), ()), ["all-gather"]),
        (((0,), ()), ((0, 1), ()), []),  # a slice
        (((0,), ()), ((), (0,)), ["all-to-all"]),
        (((0,), (1,)), ((), ()), ["all-gather", "all-gather"]),
        (((0, 1), ()), ((0,), (1,)), ["all-to-all"]),  # the minor axis moves
        (((), (0, 1)), ((1,), (0,)), ["all-to-all"]),
    ],
)
def test_resharding_collectives_are_those_xla_writes(src, dst, kinds):
    """The collectives ``resharding_collectives`` prices for ``src -> dst`` on a (2, 2)
    mesh are those XLA compiles for the same resharding (oracle: the collectives counted
    in the HLO of a ``with_sharding_constraint`` from ``src`` to ``dst``), with the values
    unchanged. Gathering the minor axis of a dimension that both axes split (Alpa's mixed
    mesh shape) is one all-gather over it; it was priced as two, one over each axis. Moving
    that minor axis to become the minor axis of another dimension is one all-to-all; it
    was priced as an all-gather."""
    from jax.sharding import Mesh, NamedSharding

    from alpa.shard_parallel.strategies.sharding_spec import (
        resharding_collectives,
        to_partition_spec,
    )

    mesh = LogicalDeviceMesh((2, 2), (1, 1), (1, 1))
    priced = [c.kind for c in resharding_collectives(src, dst, 16 * 32 * 4.0, mesh)]
    assert priced == kinds
    jax_mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    x = jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32)
    x = jax.device_put(x, NamedSharding(jax_mesh, to_partition_spec(src, mesh)))
    target = NamedSharding(jax_mesh, to_partition_spec(dst, mesh))
    f = jax.jit(lambda a: jax.lax.with_sharding_constraint(a, target))
    counts = count_communication_primitives(f.lower(x).compile().as_text())
    written = {
        "all-gather": counts.all_gather, "all-to-all": counts.all_to_all,
        "all-reduce": counts.all_reduce, "reduce-scatter": counts.reduce_scatter,
    }  # fmt: skip
    assert written == {k: kinds.count(k) for k in written}
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))


# ----------------------------------------------------------------------------- work terms


def test_memory_term_in_closed_form():
    """``y = 2 * x + 1`` writes two ``[batch, hidden]`` results. Split over the 4 devices,
    each device writes a quarter of each at the mesh's ``memory_bandwidth``; with ``x``
    arriving replicated, the elementwise ops follow it and every device writes all of both.
    """
    mesh = LogicalDeviceMesh((1, 4))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    closed = jax.make_jaxpr(lambda x: 2.0 * x + 1.0)(x)
    written = 64 * 32 * F32
    free = solve_jaxpr(closed, mesh)
    assert free.objective == pytest.approx(2 * written / 4 / mesh.memory_bandwidth)
    assert free.to_sharding_plan().out_specs[0] != P()
    pinned = solve_jaxpr(closed, mesh, fixed_in_specs=(P(),))
    assert pinned.objective == pytest.approx(2 * written / mesh.memory_bandwidth)


def test_dead_equations_are_not_planned():
    """An init function runs the model's forward pass and drops its result; XLA removes
    it. Priced, that pass would pick the kernel's sharding (batch-split matmuls read it
    whole); left out, the kernel is written sharded (a quarter per device) at no
    communication."""
    mesh = LogicalDeviceMesh((1, 4))

    def init(w, x):
        kernel = 2.0 * w
        _ = x @ kernel  # the dead forward pass
        return kernel

    closed = jax.make_jaxpr(init)(
        jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((8, 32), jnp.float32)
    )
    solution = solve_jaxpr(closed, mesh)
    assert solution.graph.jaxpr.eqns == [closed.jaxpr.eqns[0]]
    assert solution.objective == pytest.approx(32 * 32 * F32 / 4 / mesh.memory_bandwidth)
    assert solution.to_sharding_plan().out_specs[0] != P()


def test_replicated_matmul_is_priced():
    """With ``allow_recompute_heavy_op`` a matmul may run whole on every device. It used to
    cost nothing (no collective) and tie with the split plans; its FLOPs now cost the
    devices' time, so the plan splits it: ``2 * m * k * n`` FLOPs over 4 devices, no
    collective (the kernel's columns split, the input read whole)."""
    mesh = cost_mesh((1, 4))
    m, k, n = 16, 512, 512
    closed = jax.make_jaxpr(lambda x, w: x @ w)(
        jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32)
    )
    option = AutoShardingOption(allow_recompute_heavy_op=True)
    solution = solve_jaxpr(closed, mesh, option)
    assert solution.objective == pytest.approx(2 * m * k * n / 4 / mesh.device_flops)
    assert solution.to_sharding_plan().out_specs[0] != P()
    off = LogicalDeviceMesh((1, 4), device_flops=math.inf, memory_bandwidth=math.inf)
    assert solve_jaxpr(closed, off, option).objective == 0.0


def test_explicit_alpha_beta_keep_the_hardware_ratio():
    """A mesh's rates follow explicit alpha-beta into the caller's units: at beta = 1 per
    byte over a link of 10 GB/s, 50 GFLOP/s is 5 FLOPs per unit and 20 GB/s of memory is 2
    bytes per unit."""
    from alpa.device_mesh import ClusterSpec

    hardware = LogicalDeviceMesh(
        (1, 4), (1e-5, 1e-5), (1e-10, 1e-10), device_flops=5e10, memory_bandwidth=20e9
    )
    units = hardware.with_alpha_beta((1.0, 1.0), (1.0, 1.0))
    assert units.device_flops == pytest.approx(5.0)
    assert units.memory_bandwidth == pytest.approx(2.0)
    cpu = ClusterSpec.preset("cpu").get_virtual_physical_mesh().get_logical_mesh((2, 4))
    assert (cpu.device_flops, cpu.memory_bandwidth) == (5e10, 20e9)
    with pytest.raises(ValueError, match="device_flops must be positive, got 0"):
        LogicalDeviceMesh((1, 4), device_flops=0)


def test_combined_reductions_pay_one_latency():
    """Data parallelism's gradient reductions do not feed each other: XLA merges them into
    one all-reduce, so the objective holds one latency per mesh axis. Megatron's forward
    all-reduce feeds the next matmul and keeps its own."""
    mesh = cost_mesh((1, 4), alpha=(100.0, 100.0))
    closed, batch = mlp_step_jaxpr(batch=1024, hidden=16, num_layers=3)
    solution = solve_mlp(closed, mesh, batch_invars=batch)
    total = (16 * 16 * F32 + 16 * F32) * 3
    expected = mesh.all_reduce_cost(total, 1) + matmul_cost(mesh, 1024, 16, 3, 4)
    assert solution.objective == pytest.approx(expected)
    combined = [n for n in solution.graph.nodes if n.combined]
    reducing = [n for n in combined if n.strategies[solution.solution.choice[n.id]].reduce_axes]
    assert len(reducing) == 6  # 3 kernels, 3 biases (the loss is not returned)
