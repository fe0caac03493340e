"""Resharding plans: each needed byte moves once per destination host, arrays reproduce."""

import itertools
import math

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from alpa.runtime.resharding import (
    MeshSharding,
    apply_plan,
    plan_resharding,
    shard_array,
)

SHAPE = (12, 24)
MESHES = [(1, 2), (2, 1), (1, 4), (2, 2), (2, 3), (1, 6)]
LAYOUTS = {
    "replicated": ((), ()),
    "row": ((0, 1), ()),
    "column": ((), (0, 1)),
    "2d": ((0,), (1,)),
    "row_in_host": ((1,), ()),  # split inside a host, replicated across hosts
}


def _boxes_disjoint(boxes):
    for a, b in itertools.combinations(boxes, 2):
        if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True)):
            return False
    return True


@pytest.mark.parametrize("src_mesh,dst_mesh", list(itertools.product(MESHES, MESHES)))
def test_plans_move_each_needed_byte_once(src_mesh, dst_mesh):
    array = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    for src_layout, dst_layout in itertools.product(LAYOUTS.values(), LAYOUTS.values()):
        src = MeshSharding(src_mesh, src_layout)
        dst = MeshSharding(dst_mesh, dst_layout)
        plan = plan_resharding(SHAPE, src, dst)
        out = apply_plan(plan, shard_array(array, src))
        for got, want in zip(out, shard_array(array, dst), strict=True):
            np.testing.assert_array_equal(got, want)
        dst_boxes = dst.device_boxes(SHAPE)
        for host in range(dst_mesh[0]):
            sent = [t.box for t in plan.pieces if t.dst_host == host]
            assert _boxes_disjoint(sent), plan.table()
            needed = {dst_boxes[d] for d in range(host * dst_mesh[1], (host + 1) * dst_mesh[1])}
            needed_elements = sum(math.prod(b - a for a, b in box) for box in needed)
            assert sum(math.prod(b - a for a, b in box) for box in sent) == needed_elements
        for t in plan.pieces:
            assert src_boxes_contain(src.device_boxes(SHAPE)[t.src_device], t.box)


def src_boxes_contain(outer, inner):
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def test_replicated_destination_is_sent_once_per_host():
    src = MeshSharding((1, 2), LAYOUTS["row"])
    dst = MeshSharding((2, 3), LAYOUTS["replicated"])
    plan = plan_resharding(SHAPE, src, dst)
    assert plan.num_elements_sent() == 2 * math.prod(SHAPE)  # two hosts, not six devices
    assert {t.dst_devices for t in plan.pieces} == {(0, 1, 2), (3, 4, 5)}
    # Replicas of the source take turns sending.
    src = MeshSharding((1, 2), LAYOUTS["replicated"])
    plan = plan_resharding(SHAPE, src, MeshSharding((1, 2), LAYOUTS["row"]))
    assert sorted(t.src_device for t in plan.pieces) == [0, 1]


def test_partition_spec_conversion_and_errors():
    sharding = MeshSharding.from_partition_spec((2, 3), P("x", "y"), ndim=2)
    assert sharding.dim_axes == ((0,), (1,))
    assert MeshSharding.from_partition_spec((1, 4), P(("x", "y")), ndim=2).dim_axes == (
        (0, 1),
        (),
    )
    with pytest.raises(ValueError, match="cannot be split into 4 equal tiles"):
        MeshSharding((1, 4), ((1,), ())).device_boxes((6, 4))
    with pytest.raises(ValueError, match="each mesh axis"):
        MeshSharding((2, 2), ((0,), (0,)))
