"""The Ray workers' instruction set (``runtime/worker_program.py``) against the plan's
(``runtime/instructions.py``): one name per idea, one handler per opcode; and the one
tile-plan type (``TransferPlan``) that the planner, the plan and the workers share."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from alpa.runtime import worker_ops
from alpa.runtime.instructions import Op
from alpa.runtime.resharding import (
    MeshSharding,
    apply_plan,
    plan_resharding,
    shard_array,
    worker_transfer_plan,
)
from alpa.runtime.worker_program import Layout, TransferPlan, WorkerOp


def test_a_plan_opcode_that_stays_on_its_mesh_keeps_its_name_on_the_workers():
    # A RESHARD between two meshes becomes a SEND and a RECV; every other plan opcode is
    # one worker opcode of the same name (zero accumulators are ALLOC on both sides).
    same = {op.value for op in Op} - {Op.RESHARD.value}
    assert same == {"LOAD", "RUN", "ALLOC"}
    assert {WorkerOp(name).value for name in same} == same
    assert "ZEROS" not in WorkerOp.__members__


def test_every_worker_opcode_has_one_handler():
    assert set(worker_ops.HANDLERS) == set(WorkerOp)
    assert worker_ops.HANDLERS[WorkerOp.ALLOC].__name__ == "_alloc"


def test_one_tile_plan_type_for_the_planner_the_plan_and_the_workers():
    # A row-split value on a (2, 2) mesh to a column split over one host of 4 devices: the
    # planner's plan from tile shardings and the workers' plan from layouts are one type,
    # with the same pieces, and it survives the pickling that ships it to Ray workers.
    shape = (8, 12)
    src = MeshSharding((2, 2), ((0, 1), ()))
    dst = MeshSharding((1, 4), ((), (1,)))
    tiles = plan_resharding(shape, src, dst, np.float32)
    workers = worker_transfer_plan(
        shape,
        np.float32,
        Layout((2, 2), ("x", "y"), P(("x", "y"))),
        2,
        Layout((1, 4), ("x", "y"), P(None, "y")),
        4,
    )
    assert type(tiles) is type(workers) is TransferPlan
    assert workers.pieces == tiles.pieces and workers.src_boxes == tiles.src_boxes
    assert workers.dst_boxes == tiles.dst_boxes
    assert tiles.src_mesh_shape == (2, 2) and tiles.dst_mesh_shape == (1, 4)
    # Each source device sends its rows to the one destination host, 4 pieces of 2x3.
    assert sorted(p.src_device for p in tiles.pieces) == [d for d in range(4) for _ in range(4)]
    assert all(p.dst_host == 0 and len(p.dst_devices) == 1 for p in tiles.pieces)
    assert tiles.nbytes() == workers.nbytes() == 8 * 12 * 4
    from_host_1 = workers.pieces_from(1)
    assert len(from_host_1) == 8 and {p.src_device for _, p in from_host_1} == {2, 3}
    assert pickle.loads(pickle.dumps(workers)) == workers
    array = np.arange(96.0).reshape(shape)
    out = apply_plan(workers, shard_array(array, src))
    for got, want in zip(out, shard_array(array, dst), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_tile_plan_names_its_bad_devices_per_host_and_missing_dtype():
    plan = plan_resharding(
        (4, 4), MeshSharding((1, 2), ((0,), ())), MeshSharding((1, 2), ((), (1,)))
    )
    with pytest.raises(ValueError, match="a tile plan without a dtype has no size in bytes"):
        plan.nbytes()
    with pytest.raises(
        ValueError, match="dst_devices_per_host=3 does not divide the 2 dst devices"
    ):
        dataclasses.replace(plan, dst_devices_per_host=3)


def test_the_ray_runtime_calls_the_one_tile_planner_itself():
    # Nothing hands the launcher a planner: it and reshard_array call the tile planner
    # of runtime.resharding directly.
    from alpa.executables.distributed import DistributedMeshExecutable
    from alpa.runtime import ray_launch

    for fn in (ray_launch.RayStepLauncher, ray_launch.reshard_array, DistributedMeshExecutable):
        assert "planner" not in inspect.signature(fn).parameters, fn
    assert ray_launch.worker_transfer_plan is worker_transfer_plan
