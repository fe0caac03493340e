"""The Ray runtime on a local two-node Ray cluster (``ray.cluster_utils.Cluster``, each
node 4 virtual CPU devices, bound to 127.0.0.1): numerics against the serial step for
every method, cross-mesh resharding byte for byte, what the driver sends, what stays alive
on the workers, and a worker killed mid-step."""

import gc
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jax
import killed_save  # tests/ is on sys.path, as for conftest
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import alpa
from alpa.runtime.ray_launch import reshard_array
from alpa.runtime.worker_program import Layout
from alpa.testing import assert_allclose, get_mlp_train_state_and_step

pytestmark = [
    pytest.mark.ray,
    pytest.mark.xdist_group("ray"),  # one worker starts the cluster, once
    # Ray starts its node processes with fork + exec from this (jax-initialized) process;
    # the child execs at once, so jax's warning about threads after fork does not apply.
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
]

DEVICES_PER_NODE = 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # tests/conftest.py marks Ray clusters local-only, so nodes on 127.0.0.1 reach each other.
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    args = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=args)
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    alpa.shutdown()
    alpa.init("ray", num_devices_per_node=DEVICES_PER_NODE)
    yield cluster
    alpa.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def _fresh_alpa():
    """Unlike the other tests (tests/conftest.py), these share one alpa Ray cluster, whose
    mesh workers start once; the module's fixture shuts it down."""
    yield


def _serial(step, state, batch, num_steps):
    jitted = jax.jit(step)
    for _ in range(num_steps):
        state = jitted(state, batch)
    return state


def _run(method, num_steps=2, markers=False, batch_size=32, hidden=16, num_layers=4):
    state, batch, step = get_mlp_train_state_and_step(
        batch_size, hidden, num_layers=num_layers, add_manual_pipeline_marker=markers
    )
    expected = _serial(step, state, batch, num_steps)
    p_step = alpa.parallelize(step, method=method)
    for _ in range(num_steps):
        state = p_step(state, batch)
    return state, expected, p_step.get_last_executable()


# ----------------------------------------------------------------------------- cluster


def test_cluster_comes_from_ray_nodes(ray_cluster):
    cluster = alpa.get_global_cluster()
    assert isinstance(cluster, alpa.DeviceCluster)
    assert (cluster.num_hosts, cluster.num_devices_per_host) == (2, DEVICES_PER_NODE)
    assert cluster.num_devices == 2 * DEVICES_PER_NODE
    assert cluster.platform == "cpu"
    assert len({h["NodeID"] for h in cluster.host_info}) == 2
    assert cluster.get_virtual_physical_mesh().shape == (2, DEVICES_PER_NODE)
    mesh = alpa.get_global_physical_mesh()
    assert isinstance(mesh, alpa.DistributedPhysicalDeviceMesh)
    assert mesh.shape == (2, DEVICES_PER_NODE)
    # One worker per host, each on its own node, owning that node's devices.
    assert [info["node_id"] for info in mesh.worker_info] == [
        h["NodeID"] for h in cluster.host_info
    ]
    assert all(info["num_local_devices"] == DEVICES_PER_NODE for info in mesh.worker_info)
    assert all(info["num_devices"] == 2 * DEVICES_PER_NODE for info in mesh.worker_info)
    # Each worker compiles with the driver's XLA flags (tests/conftest.py's code
    # generation), its own device count in place of the driver's.
    import ray

    flags = ray.get(
        [w.__ray_call__.remote(lambda _: os.environ["XLA_FLAGS"]) for w in mesh.workers]
    )
    count = "--xla_force_host_platform_device_count"
    driver = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith(count)]
    assert driver and all(f.split() == [*driver, f"{count}={DEVICES_PER_NODE}"] for f in flags)


def test_bad_cluster_arguments(ray_cluster):
    from alpa.runtime.ray_mesh import DeviceCluster

    with pytest.raises(ValueError, match="num_nodes=3 but the Ray cluster has 2 alive nodes"):
        DeviceCluster(num_nodes=3)
    cluster = alpa.get_global_cluster()
    with pytest.raises(ValueError, match=r"host_ids must be in \[0, 2\), got \[2\]"):
        cluster.get_physical_mesh((2,), 1)
    with pytest.raises(ValueError, match=r"num_devices_per_host must be in \[1, 4\], got 5"):
        cluster.get_physical_mesh((0,), 5)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("method_name", ["DataParallel", "Zero2Parallel"])
def test_data_parallel_on_one_node(ray_cluster, method_name):
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), DEVICES_PER_NODE)
    state, expected, executable = _run(getattr(alpa, method_name)(devices=mesh))
    assert type(executable).__name__ == "DistributedMeshExecutable"
    assert all(isinstance(x, alpa.DistributedArray) for x in jax.tree.leaves(state.params))
    assert_allclose(state.params, expected.params)
    assert_allclose(state.opt_state, expected.opt_state)


def test_shard_parallel_auto_spans_both_nodes(ray_cluster):
    state, expected, executable = _run(alpa.ShardParallel())
    assert executable.mesh.shape == (2, DEVICES_PER_NODE)
    assert executable.plan.logical_mesh.shape == (2, DEVICES_PER_NODE)
    assert_allclose(state.params, expected.params)
    # The plan shards something: the step is not merely replicated.
    assert any(spec != P() for spec in executable.plan.in_specs if spec is not None)


def test_gradient_accumulation(ray_cluster):
    mesh = alpa.get_global_cluster().get_physical_mesh((1,), DEVICES_PER_NODE)
    state, expected, executable = _run(alpa.DataParallel(devices=mesh, num_micro_batches=4))
    assert_allclose(state.params, expected.params)
    # The workers' program reduces the gradients once, after the loop, under the scope
    # that names that reduction (as on the local runtime).
    ids = executable.grad_sync_channel_ids
    assert re.fullmatch(r"\.\d+\.", ids), ids
    hlo = executable.get_hlo_text()
    assert f"channel_id={ids[1:-1]}," in hlo[hlo.index("\nENTRY ") :]


def test_devices_resolve_to_the_global_cluster_or_its_chosen_hosts(ray_cluster):
    """``devices=alpa.get_global_cluster()``: a one-mesh method runs on the whole cluster's
    mesh. Under ``set_global_virtual_physical_mesh`` a pipeline plans on the chosen first
    host and runs there; a mesh of some workers is no pipeline's ``devices``."""
    cluster = alpa.get_global_cluster()
    state, expected, executable = _run(alpa.DataParallel(devices=cluster), num_steps=1)
    assert executable.mesh is alpa.get_global_physical_mesh()
    assert_allclose(state.params, expected.params)
    two_stages = alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 2)] * 2, [(1, 2)] * 2)
    alpa.set_global_virtual_physical_mesh(alpa.VirtualPhysicalMesh(1, DEVICES_PER_NODE))
    try:
        method = alpa.PipeshardParallel(
            num_micro_batches=2, layer_option="manual", stage_option=two_stages
        )
        state, expected, executable = _run(method, markers=True)
        assert (executable.plan.num_hosts, executable.plan.num_devices_per_host) == (1, 4)
        assert [(m.host_ids, m.first_device) for m in executable.meshes] == [((0,), 0), ((0,), 2)]
        assert_allclose(state.params, expected.params)
    finally:
        alpa.set_global_virtual_physical_mesh(None)
    part = alpa.PipeshardParallel(devices=cluster.get_physical_mesh((1,), DEVICES_PER_NODE))
    with pytest.raises(TypeError, match="a mesh of some of a Ray cluster's workers"):
        _run(part, markers=True)


def _two_stages_one_per_node(num_micro_batches, schedule):
    return alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        pipeline_schedule=schedule,
        layer_option="manual",
        stage_option=alpa.ManualStageOption(
            [[0, 1], [2, 3]], [(1, DEVICES_PER_NODE)] * 2, [(2, 2), (1, DEVICES_PER_NODE)]
        ),
    )


@pytest.mark.parametrize(
    "num_micro_batches, schedule",
    [(1, "gpipe"), (4, "gpipe"), (1, "1f1b"), (4, "1f1b"), (4, "zb-h1")],
)
def test_pipeshard_two_stages_one_per_node(ray_cluster, num_micro_batches, schedule):
    method = _two_stages_one_per_node(num_micro_batches, schedule)
    state, expected, executable = _run(method, markers=True)
    assert type(executable).__name__ == "PipeshardRayExecutable"
    nodes = [m.worker_info[0]["node_id"] for m in executable.meshes]
    assert nodes == [h["NodeID"] for h in alpa.get_global_cluster().host_info]
    assert_allclose(state.params, expected.params)
    assert_allclose(state.opt_state, expected.opt_state)
    # The workers held the schedule's micro-batches in flight, as they counted them.
    assert executable.peak_live_micro_batches() == executable.plan.schedule.max_in_flight()
    # Workers counted exactly what the tile plans say (two steps).
    counters = executable.worker_counters()
    sent = sum(c["bytes_sent"] for mesh in counters for c in mesh)
    received = sum(c["bytes_received"] for mesh in counters for c in mesh)
    for mesh in executable.meshes:
        mesh.call("reset_counters")
    assert sent == received == 2 * executable.get_resharded_bytes() > 0


def test_pipeshard_zero_bubble_four_stages(ray_cluster):
    """ZB-H1 on four stages, two per node: the backward split into B and W on the three
    stages that send a cotangent back; parameters and Adam's state equal serial; the mesh
    workers hold the schedule's min(S, M) micro-batches in flight."""
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        pipeline_schedule="zb-h1",
        layer_option="manual",
        stage_option=alpa.ManualStageOption([[0], [1], [2], [3]], [(1, 2)] * 4),
    )
    state, expected, executable = _run(method, markers=True)
    kinds = [(c.stage, c.kind) for c in executable.program.computations if c.kind == "weight"]
    assert kinds == [(1, "weight"), (2, "weight"), (3, "weight")]
    # The workers counted min(S, M) = 4 micro-batches in flight on every mesh.
    assert executable.peak_live_micro_batches() == [4] * 4
    assert_allclose(state.params, expected.params)
    assert_allclose(state.opt_state, expected.opt_state)


@pytest.mark.parametrize(
    "schedule, stages_per_node",
    [("interleaved-1f1b", 1), ("interleaved-1f1b", 2), ("dualpipev", 1)],
)
def test_pipeshard_stages_share_a_mesh(ray_cluster, schedule, stages_per_node):
    """Interleaved 1F1B and DualPipeV: four stages on two meshes (one per node, or two on
    node 0 with a mesh of two devices each), stage i on mesh i mod 2, or in a V (0, 1, 1,
    0): two Ray meshes whose workers each run two stages' instructions. Parameters and
    Adam's state equal serial (the global norm's partial sums move between stages, two
    of them on one mesh: a relayout on its workers); the workers held the schedule's
    in-flight bound per mesh; the only sends are between meshes."""
    import optax

    shape = (1, DEVICES_PER_NODE // stages_per_node)
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        pipeline_schedule=schedule,
        layer_option="manual",
        stage_option=alpa.ManualStageOption([[0], [1], [2], [3]], [shape] * 4),
    )
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    state, batch, step = get_mlp_train_state_and_step(32, 16, add_manual_pipeline_marker=True)
    state = state.replace(tx=tx, opt_state=tx.init(state.params))
    expected = _serial(step, state, batch, 2)
    p_step = alpa.parallelize(step, method=method)
    state = p_step(state, batch)
    executable = p_step.get_last_executable()
    for mesh in executable.meshes:  # count the second step's sends alone
        mesh.call("reset_counters")
    state = p_step(state, batch)
    assert len(executable.meshes) == 2
    placed = {"interleaved-1f1b": (0, 1, 0, 1), "dualpipev": (0, 1, 1, 0)}[schedule]
    assert executable.plan.stage_plan.stage_meshes == placed
    # The workers load a relayout function besides the stage programs (which alone are
    # what get_hlo_names lists, in Alpa's order).
    assert "relayout" in [fn.name for program in executable._programs for fn in program.fns]
    assert "relayout" not in executable.get_hlo_names()
    assert_allclose(state.params, expected.params)
    assert_allclose(state.opt_state, expected.opt_state)
    bound = executable.plan.schedule.max_in_flight_per_mesh()
    # interleaved: min(2 (p - d - 1) + (v - 1) p + 1, v M); DualPipeV: 2 p + 1 (p = 2)
    assert bound == {"interleaved-1f1b": [5, 3], "dualpipev": [5, 5]}[schedule]
    assert executable.peak_live_micro_batches() == bound
    counters = executable.worker_counters()
    sent = sum(c["bytes_sent"] for mesh in counters for c in mesh)
    received = sum(c["bytes_received"] for mesh in counters for c in mesh)
    assert sent == received == executable.get_resharded_bytes() > 0


def test_pipeshard_zero2_stages_reduce_once_per_step(ray_cluster):
    """Data-parallel stages with prefer_reduce_scatter on the workers: the backward (per
    micro-batch) has no collective, apply-grad reduce-scatters the gradients (shard_map
    exported on the stage's abstract mesh); numerics equal serial."""
    from alpa.util import count_communication_primitives

    option = alpa.AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True)
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        layer_option="manual",
        stage_option=alpa.ManualStageOption([[0, 1], [2, 3]], [(1, DEVICES_PER_NODE)] * 2),
        default_auto_sharding_option=option,
    )
    state, expected, executable = _run(method, markers=True)
    assert type(executable).__name__ == "PipeshardRayExecutable"
    assert_allclose(state.params, expected.params)
    assert_allclose(state.opt_state, expected.opt_state)
    names = executable.get_hlo_names()  # Alpa's order, the stage programs alone
    assert names[:4] == ["stage0_forward", "stage1_forward", "stage1_backward", "stage0_backward"]
    assert names[4:] and all(n.startswith(("stage0_apply", "stage1_apply")) for n in names[4:])
    hlo = dict(zip(names, executable.get_hlo_text(), strict=True))
    for stage in range(2):
        assert count_communication_primitives(hlo[f"stage{stage}_backward"], True).total == 0
        applies = [h for n, h in hlo.items() if n.startswith(f"stage{stage}_apply")]
        assert sum(count_communication_primitives(h).reduce_scatter for h in applies) > 0


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_pipeshard_automatic_stages(ray_cluster, num_micro_batches):
    method = alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="auto",
    )
    state, expected, executable = _run(method)
    assert type(executable).__name__ == "PipeshardRayExecutable"
    assert_allclose(state.params, expected.params)


def test_pipeshard_dropout_micro_batches_draw_the_full_batch_numbers(ray_cluster):
    """Each micro-batch's workers draw its rows of the full batch's dropout masks (the row
    ids are one more batch input the driver sends): equal to the serial step."""
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.standard_normal((8, 8), np.float32) / 3 for i in range(2)}
    batch = {k: rng.standard_normal((16, 8), np.float32) for k in ("x", "y")}

    def step(params, batch, key):
        def loss(p):
            h = batch["x"]
            for i in range(2):
                h = jax.numpy.tanh(h @ p[f"w{i}"])
                keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, h.shape)
                h = jax.numpy.where(keep, h * 2, 0.0)
                if i == 0:
                    alpa.mark_pipeline_boundary()
            return jax.numpy.mean((h - batch["y"]) ** 2)

        return alpa.value_and_grad(loss)(params)

    # A raw uint32 key: the driver sends arrays to the workers as numpy arrays, which a
    # typed key (jax.random.key) cannot become.
    key = jax.random.PRNGKey(3)
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        layer_option="manual",
        stage_option=alpa.ManualStageOption(
            [[0], [1]], [(1, DEVICES_PER_NODE)] * 2, [(2, 2), (1, DEVICES_PER_NODE)]
        ),
    )
    p_step = alpa.parallelize(step, method=method, batch_argnums=(1,), donate_argnums=())
    out = p_step(params, batch, key)
    assert type(p_step.get_last_executable()).__name__ == "PipeshardRayExecutable"
    assert_allclose(out, jax.jit(step)(params, batch, key), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- arrays


def test_distributed_array_fetch_and_feed_back(ray_cluster):
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), 2)
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = mesh.put(value, Layout((1, 2), ("x", "y"), P(None, "y")))
    assert (x.shape, x.dtype, x.ndim) == ((4, 6), np.float32, 2)
    np.testing.assert_array_equal(np.asarray(x), value)
    y = mesh.put(value + 1, Layout((2, 1), ("x", "y"), P("x")))
    alpa.prefetch([x, y, 3.0])
    np.testing.assert_array_equal(y._value, value + 1)
    # Any pytree (Alpa's scripts prefetch states and metric dicts); scalars as Python numbers.
    loss = mesh.put(np.float32(2.5), Layout((1, 2), ("x", "y"), P()))
    count = mesh.put(np.int32(7), Layout((1, 2), ("x", "y"), P()))
    w = mesh.put(value * 2, Layout((1, 2), ("x", "y"), P("y")))
    alpa.prefetch({"metrics": (loss, count), "params": {"w": w}, "step": 3})
    assert loss._fetched is not None and w._fetched is not None
    assert float(loss) == 2.5 and int(count) == 7
    assert "%.4f" % loss == "2.5000"  # noqa: UP031 (the form Alpa's scripts log with)
    assert f"{loss:.2f}" == "2.50"
    assert np.mean([loss, loss]) == 2.5
    with pytest.raises(TypeError, match=r"one element converts to float; this one has shape"):
        float(w)
    assert x.block_until_ready() is x
    # A value that spans both nodes is fetched shard by shard from its two workers.
    big = alpa.get_global_physical_mesh()
    z = big.put(value, Layout((2, DEVICES_PER_NODE), ("x", "y"), P("x")))
    np.testing.assert_array_equal(np.asarray(z), value)
    with pytest.raises(ValueError, match=r"layout mesh_shape \(1, 4\) has 4 devices, mesh"):
        mesh.put(value, Layout((1, 4), ("x", "y"), P()))


_LAYOUTS = {
    2: {
        "replicated": Layout((1, 2), ("x", "y"), P()),
        "row": Layout((1, 2), ("x", "y"), P("y")),
        "column": Layout((1, 2), ("x", "y"), P(None, "y")),
        "2-D": Layout((2, 1), ("x", "y"), P("x", "y")),
    },
    4: {
        "replicated": Layout((1, 4), ("x", "y"), P()),
        "row": Layout((1, 4), ("x", "y"), P("y")),
        "column": Layout((1, 4), ("x", "y"), P(None, "y")),
        "2-D": Layout((2, 2), ("x", "y"), P("x", "y")),
    },
}


def _distinct_tile_elements(layout: Layout, shape) -> int:
    """Elements a one-host destination must receive: each distinct tile once."""
    from alpa.runtime.resharding import MeshSharding

    sharding = MeshSharding.from_partition_spec(layout.mesh_shape, layout.spec, len(shape))
    boxes = set(sharding.device_boxes(shape))
    return sum(int(np.prod([b - a for a, b in box])) for box in boxes)


def test_resharding_between_actor_meshes_moves_exactly_the_planned_bytes(ray_cluster):
    cluster = alpa.get_global_cluster()
    meshes = {2: cluster.get_physical_mesh((0,), 2), 4: cluster.get_physical_mesh((1,), 4)}
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for src_n, dst_n in [(2, 4), (4, 2)]:
        src_mesh, dst_mesh = meshes[src_n], meshes[dst_n]
        for src_name, src_layout in _LAYOUTS[src_n].items():
            x = src_mesh.put(value, src_layout)
            for dst_name, dst_layout in _LAYOUTS[dst_n].items():
                for mesh in meshes.values():
                    mesh.call("reset_counters")
                y = reshard_array(x, dst_mesh, dst_layout)
                sent = sum(c["bytes_sent"] for c in src_mesh.call("counters"))
                received = sum(c["bytes_received"] for c in dst_mesh.call("counters"))
                expected = _distinct_tile_elements(dst_layout, value.shape) * 4
                where = f"{src_name} on {src_n} -> {dst_name} on {dst_n}"
                assert sent == received == expected, where
                np.testing.assert_array_equal(np.asarray(y), value, err_msg=where)
                # Every device holds exactly its tile: compare the device shards.
                shards = dst_mesh.call("fetch_shards", y.name)[0]
                for index, data in shards:
                    np.testing.assert_array_equal(data, value[index], err_msg=where)


# ----------------------------------------------------------------------------- driver, liveness


def test_driver_sends_inputs_and_a_small_message_per_worker(ray_cluster):
    method = _two_stages_one_per_node(2, "1f1b")
    state, batch, step = get_mlp_train_state_and_step(64, 256, add_manual_pipeline_marker=True)
    p_step = alpa.parallelize(step, method=method)
    state = p_step(state, batch)  # parameters now live on the workers
    state = p_step(state, batch)
    executable = p_step.get_last_executable()
    num_workers = sum(len(m.workers) for m in executable.meshes)
    input_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    sent = executable.bytes_sent_last_step
    assert input_bytes <= sent <= input_bytes + 4096 * num_workers
    assert sent < param_bytes  # the state never came back through the driver


def test_only_state_and_outputs_stay_alive_on_workers(ray_cluster):
    method = _two_stages_one_per_node(4, "1f1b")
    state, batch, step = get_mlp_train_state_and_step(32, 16, add_manual_pipeline_marker=True)
    p_step = alpa.parallelize(step, method=method)
    for _ in range(3):
        state = p_step(state, batch)
        gc.collect()
        executable = p_step.get_last_executable()
        for mesh in executable.meshes:
            mesh.flush_deletes(wait=True)
        # Every handle alive on the driver (earlier tests may still hold some).
        handles = [
            x
            for x in gc.get_objects()
            if isinstance(x, alpa.DistributedArray) and not x.is_deleted()
        ]
        for mesh, per_host in zip(executable.meshes, executable.live_buffers(), strict=True):
            held = {x.name for x in handles if x.mesh is mesh}
            mine = {
                x.name
                for x in jax.tree.leaves(state)
                if isinstance(x, alpa.DistributedArray) and x.mesh is mesh
            }
            assert mine, "each stage keeps part of the state"
            for worker in per_host:
                # The state is there, and nothing the driver no longer holds is.
                assert mine <= set(worker["names"]) == held
                assert (worker["unnamed_buffers"], worker["unnamed_bytes"]) == (0, 0)


def test_killed_worker_raises_within_30s_and_init_works_again(ray_cluster):
    import ray

    method = _two_stages_one_per_node(8, "1f1b")
    state, batch, step = get_mlp_train_state_and_step(256, 512, add_manual_pipeline_marker=True)
    p_step = alpa.parallelize(step, method=method)
    state = p_step(state, batch)
    executable = p_step.get_last_executable()
    victim = executable.meshes[1]
    errors: list[BaseException] = []
    running = threading.Event()

    def train():
        s = state
        try:
            while True:
                running.set()
                s = p_step(s, batch)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    running.wait(30)
    time.sleep(0.5)
    killed_at = time.monotonic()
    ray.kill(victim.workers[0])
    thread.join(timeout=30)
    assert not thread.is_alive(), "the step hung after its worker died"
    assert time.monotonic() - killed_at < 30
    message = str(errors[0])
    assert f"mesh {victim.mesh_id} host 0" in message and "worker died" in message, message

    alpa.shutdown()
    alpa.init("ray", num_devices_per_node=DEVICES_PER_NODE)
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), 2)
    state2, expected, _ = _run(alpa.DataParallel(devices=mesh), num_steps=1)
    assert_allclose(state2.params, expected.params)


def test_zero3_and_manual_sharding_on_one_node(ray_cluster):
    mesh = alpa.get_global_cluster().get_physical_mesh((1,), DEVICES_PER_NODE)
    state, expected, _ = _run(alpa.Zero3Parallel(devices=mesh))
    assert_allclose(state.params, expected.params)

    def forward(params, x):
        return jax.nn.relu(x @ params["w1"]) @ params["w2"]

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((16, 32), dtype=np.float32),
        "w2": rng.standard_normal((32, 8), dtype=np.float32),
    }
    x = rng.standard_normal((8, 16), dtype=np.float32)
    megatron = {"w1": P(None, "model"), "w2": P("model", None)}
    option = alpa.ManualShardingOption(
        ("data", "model"), in_axis_resources=(megatron, P()), out_axis_resources=P()
    )
    method = alpa.ShardParallel(devices=mesh, manual_sharding_option=option)
    p_forward = alpa.parallelize(forward, method=method, batch_argnums=(1,))
    out = p_forward(params, x)
    assert isinstance(out, alpa.DistributedArray)
    assert_allclose(np.asarray(out), forward(params, x), 1e-5, 1e-5)
    layouts = p_forward.get_last_executable().in_layouts
    assert [layout.spec for layout in layouts[:2]] == [P(None, "model"), P("model", None)]


def test_pipeshard_inference_schedule(ray_cluster):
    rng = np.random.default_rng(1)
    params = {f"w{i}": rng.standard_normal((16, 16), dtype=np.float32) for i in range(2)}
    x = rng.standard_normal((32, 16), dtype=np.float32)

    def infer(params, x):
        h = jax.numpy.tanh(x @ params["w0"])
        alpa.mark_pipeline_boundary()
        out = jax.numpy.tanh(h @ params["w1"])
        return out, jax.numpy.mean(out**2)  # a scalar: the mean over micro-batches

    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        pipeline_schedule="inference",
        stage_option=alpa.ManualStageOption([[0], [1]], [(1, DEVICES_PER_NODE)] * 2),
    )
    out, loss = alpa.parallelize(infer, method=method, batch_argnums=(1,))(params, x)
    assert isinstance(out, alpa.DistributedArray) and out.shape == (32, 16)
    assert loss.shape == ()
    assert_allclose((np.asarray(out), np.asarray(loss)), infer(params, x))


# ----------------------------------------------------------------------------- follow methods


def test_create_state_and_follow_on_a_ray_mesh(ray_cluster):
    import flax.linen as nn
    import optax
    from flax.training.train_state import TrainState

    mesh = alpa.get_global_cluster().get_physical_mesh((0,), DEVICES_PER_NODE)
    model = nn.Dense(16, use_bias=False)

    def create_state(rng):
        params = model.init(rng, np.ones((32, 16), np.float32))
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    def loss(params, batch):
        return ((model.apply(params, batch["x"]) - batch["y"]) ** 2).mean()

    def train_step(state, batch, grad=alpa.grad):
        return state.apply_gradients(grads=grad(loss)(state.params, batch))

    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((32, 16), dtype=np.float32) for k in ("x", "y")}
    p_train = alpa.parallelize(train_step, method=alpa.Zero3Parallel(devices=mesh))
    p_create = alpa.parallelize(create_state, method=alpa.CreateStateParallel(p_train, batch))
    p_eval = alpa.parallelize(  # an evaluation step keeps the state: nothing donated
        lambda s, b: loss(s.params, b), method=alpa.FollowParallel(p_train), donate_argnums=()
    )
    key = jax.random.PRNGKey(0)  # a raw uint32 key: typed keys do not cross to workers yet
    state = p_create(key)
    # Created on the train step's workers, in the layouts the train step reads.
    specs = p_train.get_last_executable().get_input_placement_specs()[0]
    for leaf, spec in zip(
        jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=_is_placement), strict=True
    ):
        assert isinstance(leaf, alpa.DistributedArray) and leaf.mesh is mesh
        assert leaf.layout == spec.placements[0][1]
    expected = jax.jit(create_state)(key)
    assert_allclose(state, expected)
    state = p_train(state, batch)
    expected = jax.jit(lambda s, b: train_step(s, b, jax.grad))(expected, batch)
    assert_allclose(state, expected)
    np.testing.assert_allclose(
        np.asarray(p_eval(state, batch)), loss(expected.params, batch), rtol=1e-5
    )
    # The train step's plan, through JSON, compiles the same program on the same workers.
    executable = p_train.get_last_executable()
    plan = alpa.ParallelPlan.from_json(executable.get_parallel_plan().to_json())
    assert (plan.cluster_info.num_hosts, plan.cluster_info.num_devices_per_host) == (1, 4)
    p_replay = alpa.parallelize(train_step, method=alpa.plan_to_method(plan, devices=mesh))
    replayed = p_replay.get_executable(state, batch)
    assert type(replayed).__name__ == "DistributedMeshExecutable"
    assert replayed.plan.in_specs == executable.plan.in_specs
    assert_allclose(
        p_replay(state, batch), jax.jit(lambda s, b: train_step(s, b, jax.grad))(expected, batch)
    )


def test_create_state_and_follow_a_pipeline_on_ray(ray_cluster):
    from alpa.model.mlp import MLPModel
    from alpa.testing import create_train_state, mlp_inference_step

    _, batch, train_step = get_mlp_train_state_and_step(
        32, 16, num_layers=4, add_manual_pipeline_marker=True
    )
    model = MLPModel(hidden_size=16, num_layers=4, add_manual_pipeline_markers=True)

    def create_state(rng):
        return create_train_state(rng, model, [batch["x"]])

    p_train = alpa.parallelize(train_step, method=_two_stages_one_per_node(2, "1f1b"))
    p_create = alpa.parallelize(create_state, method=alpa.CreateStateParallel(p_train, batch))
    p_eval = alpa.parallelize(
        lambda s, b: mlp_inference_step(s, b)[1],
        method=alpa.FollowParallel(p_train, num_micro_batches=2),
        donate_argnums=(),
    )
    key = jax.random.PRNGKey(1)
    state = p_create(key)
    expected = jax.jit(create_state)(key)
    assert_allclose(state, expected)
    # Each leaf created on the mesh and in the layout its stage reads it in: both meshes.
    train = p_train.get_last_executable()
    specs = jax.tree.leaves(train.get_input_placement_specs()[0], is_leaf=_is_placement)
    for leaf, spec in zip(jax.tree.leaves(state), specs, strict=True):
        mesh, layout = spec.placements[0]
        assert leaf.mesh is mesh and leaf.layout == layout
    assert {leaf.mesh.mesh_id for leaf in jax.tree.leaves(state.params)} == {
        m.mesh_id for m in train.meshes
    }
    state = p_train(state, batch)
    expected = jax.jit(train_step)(expected, batch)
    assert_allclose(state.params, expected.params)
    loss = p_eval(state, batch)
    np.testing.assert_allclose(np.asarray(loss), mlp_inference_step(expected, batch)[1], rtol=1e-5)
    evaluate = p_eval.get_last_executable()
    assert type(evaluate).__name__ == "PipeshardRayExecutable"
    assert [m.mesh_id for m in evaluate.meshes] == [m.mesh_id for m in train.meshes]
    read = jax.tree.leaves(evaluate.get_input_placement_specs()[0].params, is_leaf=_is_placement)
    for t, e in zip(
        jax.tree.leaves(train.get_input_placement_specs()[0].params, is_leaf=_is_placement),
        read,
        strict=True,
    ):
        assert (t.mesh_ids, t.sharding_specs) == (e.mesh_ids, e.sharding_specs)


def _is_placement(x):
    return isinstance(x, alpa.executables.base.PlacementSpec)


# ----------------------------------------------------------------------------- data loaders


def test_data_loaders_place_batches_on_the_mesh_workers(ray_cluster, tmp_path):
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    p_step = alpa.parallelize(step, method=alpa.DataParallel())
    specs = p_step.get_executable(state, batch).get_input_placement_specs()[1]
    rng = np.random.default_rng(2)
    data = {name: rng.standard_normal((3 * 32, 16), dtype=np.float32) for name in ("x", "y")}
    log = str(tmp_path / "reads")

    def input_iter_func(start, end, batch_size):
        # Runs on the mesh workers (each reads its host's rows): they log to a file.
        with open(log, "a") as f:
            f.write(f"{start} {end} {batch_size} {os.getpid()}\n")
        for i in range(start, end, batch_size):
            yield {name: rows[i : i + batch_size] for name, rows in data.items()}

    loader = alpa.MeshDriverDataLoader(32, 3 * 32, input_iter_func, specs)
    reads = loader.read_ranges
    assert reads == [(0, 48, 16), (48, 96, 16)]  # the batch is split over the two hosts
    from_hosts = list(loader)
    with open(log) as f:
        calls = [tuple(int(v) for v in line.split()) for line in f]
    assert sorted(c[:3] for c in calls) == reads  # each host's rows, read once
    worker_pids = {w["pid"] for w in alpa.get_global_physical_mesh().worker_info}
    assert {c[3] for c in calls} == worker_pids  # read by the two mesh workers
    assert os.getpid() not in worker_pids
    # Alpa's: each batch is the list of its leaves, in the order of the specs' leaves.
    assert all(isinstance(leaves, list) and len(leaves) == 2 for leaves in from_hosts)
    from_hosts = [jax.tree.unflatten(jax.tree.structure(specs), b) for b in from_hosts]
    # A bad host batch is an error of the worker that read it, at its batch.
    short = alpa.MeshDriverDataLoader(32, 4 * 32, input_iter_func, specs)  # 3 batches of data
    with pytest.raises(RuntimeError, match=r"host 1 .*\n?.*batch 2 of input_iter_func\(64, 128"):
        list(short)
    # Row r of batch k comes from the read of the host holding r (alpa.data_loader).
    expected_batches = [
        {
            name: np.concatenate([rows[s + k * w : s + (k + 1) * w] for s, _, w in reads])
            for name, rows in data.items()
        }
        for k in range(3)
    ]
    from_driver = list(alpa.DataLoader(iter(expected_batches), specs, prefetch_size=2))
    for loaded in (from_hosts, from_driver):
        for batch, expected_batch in zip(loaded, expected_batches, strict=True):
            for name in ("x", "y"):
                mesh, layout = specs[name].placements[0]
                x = batch[name]
                assert isinstance(x, alpa.DistributedArray)
                assert x.mesh is mesh and x.layout == layout
                np.testing.assert_array_equal(np.asarray(x), expected_batch[name])

    jitted = jax.jit(step)
    serial = state
    for expected_batch in expected_batches:
        serial = jitted(serial, expected_batch)
    for loaded in (from_hosts, from_driver):
        trained = state
        for batch in loaded:
            trained = p_step(trained, batch)
        assert_allclose(trained.params, serial.params)


def test_data_loader_with_alpas_placement_specs_on_ray(ray_cluster):
    """``PlacementSpec(aval, (mesh_id,), (sharding_spec,))`` as Alpa's programs write them,
    with jax-0.3 specs (``make_tile_spec``), on a mesh over both hosts; the workers read
    tuples of leaves."""
    from alpa.pxla_spec import Chunked, NoSharding, ShardedAxis, ShardingSpec
    from alpa.runtime.placement import PlacementSpec

    mesh = alpa.get_global_physical_mesh()
    data = np.arange(4 * 32 * 8, dtype=np.float32).reshape(4 * 32, 8)

    def input_iter_func(start, end, batch_size):
        for i in range(start, end, batch_size):
            yield data[i : i + batch_size], data[i : i + batch_size, 0].astype(np.int32)

    x_aval = jax.core.ShapedArray((32, 8), np.float32)
    y_spec = ShardingSpec((Chunked([2 * DEVICES_PER_NODE]),), (ShardedAxis(0),))
    specs = [
        PlacementSpec(
            x_aval,
            (mesh.mesh_id,),
            (mesh.get_logical_mesh().make_tile_spec(x_aval, [0, 1], [0, 1]),),
        ),  # fmt: skip
        PlacementSpec(jax.core.ShapedArray((32,), np.int32), (mesh.mesh_id,), (y_spec,)),
    ]
    loader = alpa.MeshDriverDataLoader(32, 4 * 32, input_iter_func, specs)
    assert loader.read_ranges == [(0, 64, 16), (64, 128, 16)]  # rows halved over the hosts
    batches = list(loader)
    assert len(batches) == 4
    for k, (x, y) in enumerate(batches):
        assert isinstance(x, alpa.DistributedArray) and x.mesh is mesh
        assert x.layout == Layout((2, DEVICES_PER_NODE), ("x", "y"), P("x", "y"))
        assert y.layout == Layout((2 * DEVICES_PER_NODE,), ("x",), P("x"))
        # Row r of batch k: the host of r reads rows [h * 64, (h + 1) * 64) 16 at a time.
        rows = np.concatenate([data[h * 64 + k * 16 : h * 64 + (k + 1) * 16] for h in (0, 1)])
        np.testing.assert_array_equal(np.asarray(x), rows)
        np.testing.assert_array_equal(np.asarray(y), rows[:, 0].astype(np.int32))
    assert NoSharding() == NoSharding()


def test_worker_env_gives_mesh_workers_the_drivers_import_path(ray_cluster, tmp_path, monkeypatch):
    """The cluster's ``worker_env`` reaches the mesh workers it starts: with this
    process's ``PYTHONPATH`` (what a Ray that ``alpa.init`` started gets), a data loader's
    ``input_iter_func`` from a module only this process's path holds runs on them."""
    from alpa.pxla_spec import Chunked, ShardedAxis, ShardingSpec
    from alpa.runtime.placement import PlacementSpec

    (tmp_path / "c64_rows.py").write_text(
        "import numpy as np\n"
        "def rows(start, end, batch_size):\n"
        "    for i in range(start, end, batch_size):\n"
        "        yield (np.arange(i, i + batch_size, dtype=np.float32),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import c64_rows

    cluster = alpa.get_global_cluster()
    spec = ShardingSpec((Chunked([1]),), (ShardedAxis(0),))
    aval = jax.core.ShapedArray((8,), np.float32)

    def load(mesh):
        specs = [PlacementSpec(aval, (mesh.mesh_id,), (spec,))]
        return [np.asarray(x) for (x,) in alpa.MeshDriverDataLoader(8, 16, c64_rows.rows, specs)]

    # The control: workers started without it cannot import the module.
    with pytest.raises(RuntimeError, match="No module named 'c64_rows'"):
        load(cluster.get_physical_mesh((1,), 1, first_device=3))
    monkeypatch.setattr(cluster, "worker_env", {"PYTHONPATH": str(tmp_path)})
    batches = load(cluster.get_physical_mesh((0,), 1, first_device=3))
    np.testing.assert_array_equal(np.concatenate(batches), np.arange(16, dtype=np.float32))


# ----------------------------------------------------------------------------- Alpa's arrays


def test_alpas_tile_specs_remote_buffers_save_and_load(ray_cluster, tmp_path):
    """Alpa's DistributedArray API on a (2, 2) view of one host's 4 devices: arrays placed
    by ``shard_args_to_arrays`` as ``make_tile_spec`` says, every device's block read
    back by ``get_remote_buffers``, one copy saved and loaded in another layout."""
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), DEVICES_PER_NODE)
    logical = mesh.get_logical_mesh([2, 2])
    data = np.arange(8, dtype=np.int32).reshape(4, 2)
    aval = jax.core.ShapedArray(data.shape, np.int32)
    spec = logical.make_tile_spec(data, [0, 1], [0, 1])
    indices = spec.indices(data.shape).flatten()
    (x,) = mesh.shard_args_to_arrays((aval,), (indices,), (spec,), (data,))
    assert isinstance(x, alpa.DistributedArray) and x.device_mesh is mesh
    assert x.layout == Layout((2, 2), ("x", "y"), P("x", "y"))
    blocks = mesh.get_remote_buffers(x.remote_ref, batching=True)
    assert np.array(blocks).tolist() == [[[0], [2]], [[1], [3]], [[4], [6]], [[5], [7]]]
    ((block,),) = mesh.get_remote_buffers([x.remote_ref], [[(0, 3)]])  # host 0, device 3
    np.testing.assert_array_equal(block, blocks[3])

    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    x.save(ckpt, cache)
    mesh.sync_move_workers()
    rows = logical.make_tile_spec(data, [0, 1], [0])  # as Alpa: the pairs of the shorter list
    y = alpa.DistributedArray.load(ckpt, aval, mesh, rows)
    assert y.layout == Layout((2, 2), ("x", "y"), P("x", None))
    half = [[[0, 1], [2, 3]]] * 2 + [[[4, 5], [6, 7]]] * 2
    assert np.array(mesh.get_remote_buffers(y.remote_ref)).tolist() == half
    np.testing.assert_array_equal(np.asarray(y), data)
    with pytest.raises(FileNotFoundError, match=r"no array saved there"):
        alpa.DistributedArray.load(str(tmp_path), aval, mesh, rows)


def test_alpas_live_buffer_uuids_see_every_freed_buffer(ray_cluster):
    """Alpa's memory-leak check: with ``delete_remote_arrays_threshold = 0`` every buffer
    the driver lets go of is gone from the workers by the next
    ``get_live_buffer_uuids``, which lists exactly the arrays the driver still holds.
    ``preshard_dynamic_args`` puts the arguments on the workers first."""
    import ray

    before = alpa.global_config.delete_remote_arrays_threshold
    alpa.global_config.delete_remote_arrays_threshold = 0
    try:
        for method, markers in [
            (alpa.ShardParallel(num_micro_batches=2), False),
            (_two_stages_one_per_node(2, "1f1b"), True),
        ]:
            state, batch, step = get_mlp_train_state_and_step(
                32, 16, add_manual_pipeline_marker=markers
            )
            p_step = alpa.parallelize(step, method=method)
            state, batch = p_step.preshard_dynamic_args(state, batch)
            executable = p_step.get_last_executable()
            leaves = jax.tree.leaves((state, batch))
            assert all(isinstance(x, alpa.DistributedArray) for x in leaves)
            placed = jax.tree.leaves(executable.get_input_placement_specs(), is_leaf=_is_placement)
            assert [(x.mesh, x.layout) for x in leaves] == [s.placements[0] for s in placed]
            for _ in range(2):
                state = p_step(state, batch)
            assert executable.bytes_sent_last_step < 4096 * 4  # the batch is on the workers
            del state, batch, leaves
            gc.collect()
            handles = [
                x
                for x in gc.get_objects()
                if isinstance(x, alpa.DistributedArray) and not x.is_deleted()
            ]
            meshes = getattr(executable, "meshes", None) or [executable.physical_mesh]
            for mesh in meshes:
                held = {x.name for x in handles if x.mesh is mesh}
                for worker in mesh.workers:
                    live = set(ray.get(worker.get_live_buffer_uuids.remote()))
                    assert live == held, (type(executable).__name__, mesh, live - held)
    finally:
        alpa.global_config.delete_remote_arrays_threshold = before


def test_collect_trace_on_ray_times_every_stage_computation(ray_cluster):
    method = _two_stages_one_per_node(2, "1f1b")
    state, batch, step = get_mlp_train_state_and_step(32, 16, add_manual_pipeline_marker=True)
    p_step = alpa.parallelize(step, method=method)
    state = p_step(state, batch)  # not traced
    executable = p_step.get_last_executable()
    assert all(runs == [] for runs in executable.get_stage_execution_info())
    alpa.global_config.collect_trace = True
    try:
        before = time.time()
        for _ in range(2):
            state = p_step(state, batch)
        after = time.time()
    finally:
        alpa.global_config.collect_trace = False
    state = p_step(state, batch)  # not traced: the workers stopped timing
    assert executable.sync_move_workers() is None  # Alpa's: saves here finish in place
    info = executable.get_stage_execution_info()
    computations = executable.program.computations
    assert len(info) == len(computations)
    for comp, runs in zip(computations, info, strict=True):
        # Per step: a forward and a backward per micro-batch, each apply-grad once.
        assert len(runs) == (2 if comp.kind == "apply" else 4), comp.name
        mesh = executable.meshes[comp.stage]
        for start, stop, hosts, devices in runs:
            assert before <= start <= stop <= after
            assert hosts == mesh.host_ids and devices == tuple(range(DEVICES_PER_NODE))
    # One mesh runs one computation at a time: its traced runs do not overlap.
    for stage in (0, 1):
        spans = sorted(
            run[:2] for c, runs in zip(computations, info, strict=True) if c.stage == stage
            for run in runs
        )  # fmt: skip
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_of_a_pipeline_on_ray_restores_onto_its_stage_meshes(ray_cluster, tmp_path):
    state, batch, step = get_mlp_train_state_and_step(
        32, 16, num_layers=4, add_manual_pipeline_marker=True
    )
    expected = _serial(step, state, batch, 4)
    p_step = alpa.parallelize(step, method=_two_stages_one_per_node(2, "1f1b"))
    for _ in range(2):
        state = p_step(state, batch)
    alpa.save_checkpoint(tmp_path, state, 2)
    # Each stage mesh's workers wrote their own leaves (a part per mesh), shard by shard:
    # every stored chunk of a leaf is one shard of its layout.
    import orbax.checkpoint as ocp

    with open(tmp_path / "checkpoint_2" / "alpa_parts.json") as f:
        parts = json.load(f)["parts"]
    kernel_meshes, sharded = set(), 0
    for name, layer in state.params.items():
        x = layer["kernel"]
        part = parts[f"params/{name}/kernel"]
        assert part == f"mesh_{x.mesh.mesh_id}"
        kernel_meshes.add(part)
        with ocp.PyTreeCheckpointer() as checkpointer:
            saved = checkpointer.metadata(tmp_path / "checkpoint_2" / part).item_metadata.tree
        sizes = dict(zip(x.layout.axis_names, x.layout.mesh_shape, strict=True))
        shard = [
            dim // int(np.prod([sizes[a] for a in ((e,) if isinstance(e, str) else e or ())]))
            for dim, e in zip(x.shape, tuple(x.layout.spec) + (None,) * x.ndim, strict=False)
        ]
        chunk = list(saved["params"][name]["kernel"].storage.chunk_shape)
        # orbax may split a replicated shard among its replicas; a leaf split over every
        # mesh axis has one chunk per shard.
        assert all(s % c == 0 for s, c in zip(shard, chunk, strict=True))
        if shard != list(x.shape):
            used = [a for e in x.layout.spec for a in ((e,) if isinstance(e, str) else e or ())]
            if {a for a, n in sizes.items() if n > 1} <= set(used):
                assert chunk == shard
            sharded += 1
    assert len(kernel_meshes) == 2 and sharded > 0

    specs = p_step.get_executable(state, batch).get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)
    assert type(restored) is type(state)
    for x, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(specs), strict=True):
        mesh, layout = spec.placements[0]
        assert isinstance(x, alpa.DistributedArray)
        assert x.mesh is mesh and x.layout == layout
    assert len({x.mesh.mesh_id for x in jax.tree.leaves(restored.params)}) == 2
    assert_allclose(alpa.restore_checkpoint(tmp_path, 2, None, target=state), state)
    for _ in range(2):
        restored = p_step(restored, batch)
    assert_allclose(restored.params, expected.params)
    assert_allclose(restored.opt_state, expected.opt_state)


def test_checkpoint_of_a_mesh_over_two_hosts(ray_cluster, tmp_path):
    # One mesh over both nodes: its two workers are one JAX program, and orbax has them
    # write one part together, each host its own shards.
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    expected = _serial(step, state, batch, 2)
    p_step = alpa.parallelize(step, method=alpa.ShardParallel())
    state = p_step(state, batch)
    executable = p_step.get_last_executable()
    assert executable.mesh.num_hosts == 2
    alpa.save_checkpoint(tmp_path, state, 1)
    saved_params = jax.tree.map(np.asarray, state.params)
    with open(tmp_path / "checkpoint_1" / "alpa_parts.json") as f:
        parts = set(json.load(f)["parts"].values())
    assert parts == {f"mesh_{executable.mesh.mesh_id}"}
    specs = executable.get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 1, specs)
    assert all(x.mesh is executable.mesh for x in jax.tree.leaves(restored))
    assert_allclose(p_step(restored, batch).params, expected.params)
    # A save that fails midway (a worker cannot write: its buffer is gone) leaves step 1
    # as it was and step 2 unlisted.
    broken = alpa.restore_checkpoint(tmp_path, 1, specs)
    leaf = broken.params["Dense_0"]["kernel"]
    leaf.mesh.call("delete", [leaf.name])
    with pytest.raises(RuntimeError, match=f"mesh {executable.mesh.mesh_id} host"):
        alpa.save_checkpoint(tmp_path, broken, 2)
    assert alpa.serialization.checkpoint_steps(tmp_path) == [1]
    with pytest.raises(FileNotFoundError, match=r"checkpoint_2\.alpa-tmp-\w+: a save that did not"):
        alpa.restore_checkpoint(tmp_path, 2, specs)
    assert_allclose(alpa.restore_checkpoint(tmp_path, 1, None)["params"], saved_params)


def _flip_bytes(path, count=64):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(count)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


# Kill points of a re-save on Ray, counted in the driver (tests/killed_save.py): after the
# driver's part (1), after the checksums (2), between the commit's renames (3), after the
# commit (4); and 0.02 s after the save started, while the mesh workers write their part.
_RAY_KILLS = [("op", 2, "old"), ("op", 3, "old"), ("op", 4, "new"), ("time", 0.02, "old")]


def test_a_ray_resave_killed_anywhere_leaves_the_old_or_the_new_step(ray_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), 2)
    layout = Layout((1, 2), ("x", "y"), P("y"))
    in_window = 0
    for seed, (mode, at, expected) in enumerate(_RAY_KILLS, start=1):
        base = killed_save.state(100 + seed)
        base["params"] = {k: mesh.put(v, layout) for k, v in base["params"].items()}
        alpa.save_checkpoint(ckpt, base, 1)  # a committed step 1 to re-save
        code = killed_save.run(ckpt, 1, seed, mode, at, "--ray", ray_cluster.address)
        assert code == -signal.SIGKILL, (mode, at)
        in_window += any(n != "checkpoint_1" for n in os.listdir(ckpt))
        assert alpa.serialization.checkpoint_steps(ckpt) == [1], (mode, at, os.listdir(ckpt))
        got = killed_save.restored_seed(ckpt, 1, {100 + seed, seed})
        assert got == (seed if expected == "new" else 100 + seed), (mode, at)
    assert in_window >= 3
    # A part's checksums are checked too: a flipped byte names the mesh's part.
    part = next(n for n in os.listdir(ckpt / "checkpoint_1") if n.startswith("mesh_"))
    sizes = {
        os.path.join(root, n): os.path.getsize(os.path.join(root, n))
        for root, _, names in os.walk(ckpt / "checkpoint_1" / part)
        for n in names
    }
    _flip_bytes(max(sizes, key=sizes.get))
    with pytest.raises(alpa.serialization.DamagedCheckpointError, match=rf"part '{part}', file"):
        alpa.restore_checkpoint(ckpt, 1)


def test_after_shutdown_a_save_a_stale_function_and_old_values_raise_at_once(ray_cluster, tmp_path):
    mesh = alpa.get_global_cluster().get_physical_mesh((0,), 2)
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    expected = _serial(step, state, batch, 2)
    p_step = alpa.parallelize(step, method=alpa.DataParallel(devices=mesh))
    state = p_step(state, batch)
    alpa.save_checkpoint(tmp_path, state, 1)
    old_specs = p_step.get_last_executable().get_input_placement_specs()[0]
    kernel = state.params["Dense_0"]["kernel"]
    fetched = state.params["Dense_1"]["kernel"]
    host_copy = np.asarray(fetched)  # fetched before the shutdown: stays readable
    alpa.shutdown()
    alpa.init("ray", num_devices_per_node=DEVICES_PER_NODE)

    gone = rf"mesh {mesh.mesh_id} \(1 hosts x 2 devices\) was shut down \(alpa.shutdown\(\)"
    value_gone = rf"a DistributedArray \([\d, ]*\) \w+ that lived on mesh {mesh.mesh_id} "
    remedy = r".*parallelize the function again.*restore them from a checkpoint"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=value_gone + "cannot be used: " + gone + remedy):
        alpa.save_checkpoint(tmp_path, state, 2, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1"]  # nothing written or deleted
    with pytest.raises(RuntimeError, match=r"this parallelized function \(compiled for it\) "):
        p_step(state, batch)
    other = alpa.get_global_cluster().get_physical_mesh((1,), 2)
    p_new = alpa.parallelize(step, method=alpa.DataParallel(devices=other))
    with pytest.raises(RuntimeError, match=value_gone):
        p_new(state, batch)  # hung in the resharding before
    # A step on this process's devices names the argument (it was JAX's "not a valid JAX
    # type"); the leaf fetched before the shutdown would be read from its host copy.
    local = alpa.DataParallel(devices=alpa.LocalPhysicalDeviceMesh())
    p_local = alpa.parallelize(step, method=local, donate_argnums=())
    with pytest.raises(RuntimeError, match=r"argument 0\.step of train_step: " + value_gone):
        p_local(state, batch)
    with pytest.raises(RuntimeError, match=value_gone):
        np.asarray(kernel)
    with pytest.raises(RuntimeError, match=gone):
        alpa.restore_checkpoint(tmp_path, 1, old_specs)
    # A hang waits ray_worker_timeout (3600 s); the block also starts a mesh and compiles
    # a step, which takes seconds, more on a loaded 2-core machine (10 s was exceeded).
    assert time.monotonic() - started < 120
    np.testing.assert_array_equal(np.asarray(fetched), host_copy)

    # The remedy: the state restored from the checkpoint onto the new cluster trains on.
    specs = p_new.get_executable(state, batch).get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 1, specs)
    assert_allclose(p_new(restored, batch).params, expected.params)


_UNREACHABLE = textwrap.dedent(
    """
    import socket, sys, time
    import alpa

    alpa.global_config.ray_connect_timeout = 2.0
    closed = socket.socket()  # bound, not listening: the connection is refused
    closed.bind(("127.0.0.1", 0))
    silent = socket.socket()  # listening, never answers: the connection hangs
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    for sock in (closed, silent):
        host, port = sock.getsockname()
        started = time.monotonic()
        try:
            alpa.init("ray", cluster_address=f"{host}:{port}")
        except ConnectionError as e:
            print(f"{time.monotonic() - started:.1f} {e}")
    alpa.init("ray", cluster_address=sys.argv[1], num_devices_per_node=4)  # the control
    print(alpa.get_global_cluster())
    """
)


def test_init_with_an_address_that_does_not_answer_raises_within_the_limit(ray_cluster):
    # A fresh interpreter: Ray must not be connected yet (this one is).
    result = subprocess.run(
        [sys.executable, "-c", _UNREACHABLE, ray_cluster.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 3, (result.stdout, result.stderr)
    assert lines.pop() == f"DeviceCluster(2 hosts x {DEVICES_PER_NODE} cpu devices)"
    for line in lines:
        seconds, message = line.split(" ", 1)
        assert float(seconds) < 2.0 + 1.0, line
        assert re.match(
            r"alpa.init\('ray', cluster_address='127.0.0.1:\d+'\): no Ray cluster answered "
            r"at 127.0.0.1:\d+ within 2 s \(global_config.ray_connect_timeout\)",
            message,
        ), line
    assert "ConnectionRefusedError" in lines[0] and "timed out" in lines[1], lines


def test_scanned_gpt_rows_stay_on_their_stage_meshes(ray_cluster, tmp_path):
    """A scanned GPT cut into two stages, one per node: each stacked parameter's rows
    live on the mesh of their blocks' stage (``stacked_rows``), the second step reads
    them there, numbers equal ``jax.jit``'s, and a checkpoint holds them all."""
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    config = GPTConfig(
        hidden_size=32, num_layers=4, num_heads=4, seq_len=8, vocab_size=64,
        scan_layers=True, remat_layers=True,
    )  # fmt: skip
    state, batch, step = get_gpt_train_state_and_step(
        config, 8, optimizer="sgd", grad_func=alpa.value_and_grad
    )
    stages = alpa.ManualStageOption(
        [[0], [1]], [(1, DEVICES_PER_NODE)] * 2, [(1, DEVICES_PER_NODE)] * 2, [{}, {}]
    )
    method = alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(2), stage_option=stages
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    jitted = jax.jit(step)
    got, expected = state, state
    for _ in range(2):
        got, loss = p_step(got, batch)
        expected, expected_loss = jitted(expected, batch)
        assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_allclose(got.params, expected.params, rtol=1e-4, atol=1e-6)
    rows = [row for leaf in jax.tree.leaves(got.params["blocks"]) for row in leaf.rows]
    per_mesh: dict = {}
    for row in rows:
        assert isinstance(row, alpa.DistributedArray)
        per_mesh[row.mesh.mesh_id] = per_mesh.get(row.mesh.mesh_id, 0) + row.nbytes
    assert len(per_mesh) == 2 and len(set(per_mesh.values())) == 1  # half each
    alpa.save_checkpoint(tmp_path, got, 2)
    assert_allclose(alpa.restore_checkpoint(tmp_path, 2)["params"], expected.params)
    # Restored with the step's placements: each row on its stage's mesh again.
    specs = p_step.get_executable(state, batch).get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)
    rows = [row for leaf in jax.tree.leaves(restored.params["blocks"]) for row in leaf.rows]
    assert {row.mesh.mesh_id for row in rows} == set(per_mesh)
    got, loss = p_step(restored, batch)
    expected, expected_loss = jitted(expected, batch)
    assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_allclose(got.params, expected.params, rtol=1e-4, atol=1e-6)


_STARTED_RAY_SOCKETS = textwrap.dedent(
    """
    import ipaddress, json, os, sys
    import psutil
    import alpa
    from alpa import cluster

    cluster._start_local_ray("sockets")  # what alpa.init("ray") does when no Ray answers
    alpa.init("ray", num_devices_per_node=2)
    alpa.get_global_cluster().get_physical_mesh()  # a mesh worker actor, listening too
    import ray

    session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
    me = psutil.Process()
    ours = {me.pid: me}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(session in part for part in p.info["cmdline"] or ()):
                ours[p.pid] = p
        except psutil.Error:
            pass
    for p in list(ours.values()):
        ours.update((c.pid, c) for c in p.children(recursive=True))
    bound = []
    for p in ours.values():
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN or c.type == 2:  # TCP listening, UDP
                    bound.append([p.name(), c.laddr.ip, c.laddr.port])
        except psutil.Error:
            pass
    names = sorted({p.name() for p in ours.values()})
    alpa.shutdown()
    restored = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    print(json.dumps({"bound": bound, "names": names, "restored": restored}))
    """
)


def test_a_ray_that_alpa_starts_listens_on_loopback_only(tmp_path):
    """A Ray that ``alpa.init("ray")`` starts for this machine: every socket its processes
    (GCS, raylet, agents, workers, the driver) listen on is a loopback address. Ray 2.60
    resolves a node address of 127.0.0.1 to the machine's routable one, and its servers
    listen on every interface, unless clusters are marked local-only, which the test
    suite does (tests/conftest.py): the subprocess runs without that mark."""
    pytest.importorskip("psutil")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")
    }
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # a socket path is short
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    try:
        out = subprocess.run(
            [sys.executable, "-c", _STARTED_RAY_SOCKETS],
            env=env, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"gcs_server", "raylet"} <= set(found["names"]), found["names"]
    assert len(found["bound"]) >= 4, found
    for name, ip, port in found["bound"]:
        address = ipaddress.ip_address(ip)
        address = getattr(address, "ipv4_mapped", None) or address
        assert address.is_loopback, f"{name} listens on {ip}:{port}"
    assert found["restored"] is None  # the environment is as it was before alpa's Ray


def test_a_ray_cluster_that_does_not_answer_is_not_joined(ray_cluster, monkeypatch, caplog):
    """``alpa.init("ray")`` without an address joins ``RAY_ADDRESS`` or the cluster ``ray
    start`` recorded, and only when it answers: Ray would wait without limit for one that
    is gone (a killed run's processes) or shutting down, and alpa starts its own instead."""
    import socket

    import ray._private.services as services

    from alpa.cluster import _running_cluster

    alpa.global_config.ray_connect_timeout, before = 2.0, alpa.global_config.ray_connect_timeout
    try:
        with socket.socket() as closed:  # bound, not listening: refused
            closed.bind(("127.0.0.1", 0))
            host, port = closed.getsockname()
            monkeypatch.setenv("RAY_ADDRESS", f"{host}:{port}")
            with caplog.at_level("WARNING", logger="alpa"):
                assert _running_cluster() is None
            assert f"the Ray cluster at {host}:{port} does not answer" in caplog.text
        monkeypatch.delenv("RAY_ADDRESS")
        monkeypatch.setattr(services, "find_bootstrap_address", lambda *_: None)
        # No address and no `ray start`: another program's Ray processes are not joined.
        assert _running_cluster() is None
        address = ray_cluster.address  # the control: a recorded cluster that answers
        monkeypatch.setattr(services, "find_bootstrap_address", lambda *_: address)
        assert _running_cluster() == address
    finally:
        alpa.global_config.ray_connect_timeout = before


# ----------------------------------------------------------------------------- benchmarks


def test_alpas_benchmark_api_on_a_ray_mesh(ray_cluster):
    """What Alpa's benchmark driver reads of a one-mesh step on Ray:
    ``ShardParallel(devices=mesh.get_logical_mesh(shape))``, the workers' step times,
    ``get_total_allocation_size``, the mesh's memory statistics and ``sync_workers``."""
    import argparse

    from alpa.executables.distributed import DistributedMeshExecutable
    from alpa.util import get_num_hosts_and_num_devices

    args = argparse.Namespace(num_hosts=None, num_devices_per_host=None, local=False)
    assert get_num_hosts_and_num_devices(args) == (2, DEVICES_PER_NODE)
    mesh = alpa.get_global_cluster().get_physical_mesh([0], DEVICES_PER_NODE)
    state, batch, step = get_mlp_train_state_and_step(16, 8, num_layers=2)
    expected = _serial(step, state, batch, 3)
    logical = mesh.get_logical_mesh((2, 2))
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(devices=logical))
    walls = []
    for _ in range(3):
        tic = time.perf_counter()
        state = p_step(state, batch)
        walls.append(time.perf_counter() - tic)
    assert_allclose(state.params, expected.params)
    executable = p_step.get_last_executable()
    assert isinstance(executable, DistributedMeshExecutable)
    assert executable.physical_mesh is mesh and executable.plan.logical_mesh.shape == (2, 2)
    # The workers timed each step; the driver waited for each at least that long.
    costs = executable.get_execution_time_costs()
    assert len(costs) == 3 and all(0 < c <= w for c, w in zip(costs, walls, strict=True))
    allocation = executable.get_total_allocation_size()
    assert allocation > 0
    # Memory: the bytes a worker's devices hold, exactly; the peak since a reset.
    mesh.sync_workers()
    mesh.reset_memory_stats()
    before = mesh.get_memory_allocated()
    assert mesh.get_max_memory_allocated() == before
    x = mesh.put(np.ones((256, 64), np.float32), Layout((2, 2), ("x", "y"), P("x")))
    mesh.sync_workers()
    assert mesh.get_memory_allocated() == before + 128 * 64 * 4  # half the rows per device
    x.delete()
    mesh.flush_deletes()  # sent, not waited for: sync_workers waits for the delete
    mesh.sync_workers()
    assert mesh.get_memory_allocated() == before
    assert mesh.get_max_memory_allocated() == before + 128 * 64 * 4
    state = p_step(state, batch)
    assert mesh.get_max_memory_allocated() >= allocation  # what XLA allocates for a step
    # A worker's exception reaches the driver, naming the mesh and host.
    with pytest.raises(RuntimeError, match=r"mesh \d+ host 0 \(node 127\.0\.0\.1 .*\): KeyError"):
        mesh.call("allocation_size", -1)


def test_alpas_benchmark_api_on_a_ray_pipeline(ray_cluster):
    """A pipelined step on Ray called with an abstract state under
    ``use_dummy_value_for_benchmarking`` runs on dummy values made on the workers;
    ``executable.mesh_group`` places arguments by their placement specs' mesh ids, times
    the steps per mesh and reports each mesh's memory."""
    from alpa.global_env import global_config

    state, batch, step = get_mlp_train_state_and_step(16, 8, add_manual_pipeline_marker=True)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)
    dummy = jax.tree.map(lambda x: np.full(np.shape(x), 1e-8, np.asarray(x).dtype), state)
    p_step = alpa.parallelize(step, method=_two_stages_one_per_node(2, "1f1b"))
    executable = p_step.get_executable(abstract, batch)
    with pytest.raises(ValueError, match=r"argument 0\.step of train_step is abstract"):
        p_step(abstract, batch)
    global_config.use_dummy_value_for_benchmarking = True
    try:
        out = p_step(abstract, batch)
        out = p_step(out, batch)
        specs = jax.tree.leaves(
            executable.get_input_placement_specs()[0], is_leaf=lambda x: hasattr(x, "mesh_ids")
        )
        group = executable.mesh_group
        placed = group.shard_args_to_arrays(specs, jax.tree.leaves(abstract))
    finally:
        global_config.use_dummy_value_for_benchmarking = False
    assert_allclose(out.params, _serial(step, dummy, batch, 2).params)
    assert list(group) == executable.meshes and len(group) == 2
    for spec, x in zip(specs, placed, strict=True):
        assert x.mesh is group[spec.mesh_ids[0]] is spec.placements[0][0]
        assert x.layout == spec.placements[0][1]
        assert np.all(np.asarray(x) == np.asarray(1e-8, x.dtype))
    per_mesh = executable.get_execution_time_costs(return_all_costs=True)
    assert len(per_mesh) == 2 and [len(m) for m in per_mesh] == [2, 2]
    assert executable.get_execution_time_costs() == [max(s) for s in zip(*per_mesh, strict=True)]
    group.sync_workers()
    memory = group.get_max_memory_allocated_per_mesh()
    assert len(memory) == 2 and min(memory) > 0 and group.get_max_memory_allocated() == max(memory)


def test_weights_loaded_by_the_mesh_workers_as_alpas_serving(ray_cluster, tmp_path):
    """Alpa's OPT serving loads its weights on the workers, never through the driver: per
    parameter a buffer reserved on each mesh that reads it (``create_remote_array_refs``),
    its handle ``DistributedArray(mesh, aval, spec, ref, indices)`` (a
    ``ReplicatedDistributedArray`` when several meshes read it: the tied embedding), and
    a function on every worker that reads its devices' slices from disk and hands them
    over with ``put_buffers``. The inference step then computes ``jax.jit``'s logits."""
    from alpa.device_mesh import (
        DistributedArray,
        ReplicatedDistributedArray,
        create_remote_array_refs,
    )
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    config = GPTConfig(
        hidden_size=32, num_layers=2, num_heads=4, seq_len=8, vocab_size=64,
        add_manual_pipeline_markers=True,
    )  # fmt: skip
    state, batch, _ = get_gpt_train_state_and_step(config, 8)
    params = state.params

    def logits(params, batch):
        return state.apply_fn({"params": params}, batch["input_ids"], batch["position_ids"])

    stages = alpa.ManualStageOption(
        [[0], [1]], [(1, DEVICES_PER_NODE)] * 2, [(2, 2), (1, DEVICES_PER_NODE)], [{}, {}]
    )
    method = alpa.PipeshardParallel(
        num_micro_batches=2,
        pipeline_schedule="inference",
        layer_option="manual",
        stage_option=stages,
    )
    p_logits = alpa.parallelize(logits, method=method, donate_argnums=())
    avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    executable = p_logits.get_executable(avals, batch)
    for i, leaf in enumerate(jax.tree.leaves(params)):
        np.save(tmp_path / f"{i}.npy", np.asarray(leaf))
    infos = jax.tree.leaves(
        executable.get_input_placement_specs()[0], is_leaf=lambda x: hasattr(x, "mesh_ids")
    )
    group = executable.mesh_group
    uuids, indices, mesh_ids, arrays = [], [], [], []
    for info in infos:
        per_mesh = []
        for mesh_id, spec, (_, layout) in zip(
            info.mesh_ids, info.sharding_specs, info.placements, strict=True
        ):
            mesh = group[mesh_id]
            refs, ids = create_remote_array_refs(mesh)
            index = layout.shard_indices(info.aval.shape)  # Alpa: pxla.spec_to_indices
            per_mesh.append((mesh, DistributedArray(mesh, info.aval, spec, refs[0], index)))
            uuids.append(ids[0]), indices.append(index), mesh_ids.append(mesh_id)
        meshes, handles = zip(*per_mesh, strict=True)
        arrays.append(
            handles[0] if len(handles) == 1 else ReplicatedDistributedArray(meshes, handles)
        )
    assert any(isinstance(a, ReplicatedDistributedArray) for a in arrays)
    leaf_of = [i for i, info in enumerate(infos) for _ in info.mesh_ids]

    def load(worker, path, uuids, indices, mesh_ids, leaf_of):
        for uuid, index, mesh_id, leaf in zip(uuids, indices, mesh_ids, leaf_of, strict=True):
            if mesh_id == worker.mesh_id:
                data = np.load(f"{path}/{leaf}.npy")
                first = worker.host_id * len(worker.local_devices)
                shards = [data[index[first + k]] for k in range(len(worker.local_devices))]
                worker.put_buffers(uuid, shards)

    calls = [
        w.__ray_call__.remote(load, str(tmp_path), uuids, indices, mesh_ids, leaf_of)
        for mesh in group
        for w in mesh.workers
    ]
    ray = pytest.importorskip("ray")
    ray.get(calls)
    loaded = jax.tree.unflatten(jax.tree.structure(params), arrays)
    assert_allclose(jax.tree.map(np.asarray, loaded), params)
    assert_allclose(p_logits(loaded, batch), jax.jit(logits)(params, batch), rtol=1e-5, atol=1e-5)


def test_init_without_arguments_joins_ray_as_alpas(ray_cluster):
    """``alpa.init()`` is Alpa's: its default cluster is Ray (the one this process is
    connected to). Last in this file: it starts the cluster's meshes afresh."""
    alpa.shutdown()
    try:
        alpa.init(num_devices_per_node=DEVICES_PER_NODE)
        cluster = alpa.get_global_cluster()
        assert isinstance(cluster, alpa.DeviceCluster) and cluster.num_hosts == 2
    finally:
        alpa.shutdown()
        alpa.init("ray", num_devices_per_node=DEVICES_PER_NODE)


def test_a_profile_of_a_ray_cluster_measures_every_host(ray_cluster, tmp_path):
    """``profile_all`` of the Ray cluster: each host's mesh worker measures its own
    devices (tiny settings); the profile is the cluster's shape, and a plan for it prices
    collectives inside a host from the curves, across hosts by alpha-beta."""
    from alpa import mesh_profiling

    path = str(tmp_path / "ray_profile.json")
    database = mesh_profiling.profile_all(
        alpa.get_global_cluster(),
        cache_filename=path,
        dot_range=(8, 16),
        dtypes=("float32",),
        min_comm_size=10,
        max_comm_size_intra_node=10,
        instruction_cost=False,
    )
    profile = database.only()
    assert profile.key == f"cpu/2x{DEVICES_PER_NODE}" and profile.meta["hosts_measured"] == 2
    assert set(profile.collectives["all-reduce"]) == {"2x1", "2x2", "4x1"}
    alpa.global_config.cluster_profile = path
    try:
        spec = alpa.get_global_cluster().spec
        assert spec.profile == profile
        mesh = spec.get_virtual_physical_mesh().get_logical_mesh((2, DEVICES_PER_NODE))
        inside = profile.collectives["all-reduce"]["4x1"](1 << 10)
        assert mesh.all_reduce_cost(1 << 10, 1) == pytest.approx(inside)
        assert mesh.all_reduce_cost(1 << 10, 0) == pytest.approx(
            mesh.mesh_alpha[0] + mesh.mesh_beta[0] * (1 << 10)
        )
    finally:
        alpa.global_config.cluster_profile = None
