"""``runtime.stage_rows``: when the parts of a split stacked leaf are one ``jax.Array``,
and that joining and splitting it copies nothing (its shards are the parts' buffers).
Device arrays on 8 virtual CPU devices, no compile of a step."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from alpa.device_mesh import make_jax_mesh
from alpa.runtime.stacked_array import StackedRows
from alpa.runtime.stage_rows import join_parts, rows_layout, split_leaf

DATA = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)


def _mesh(first: int, shape=(1, 4)):
    return make_jax_mesh(jax.devices()[first : first + int(np.prod(shape))], shape, ("x", "y"))


def _pointers(x) -> set:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def test_two_blocks_are_one_array_without_a_copy():
    shardings = [
        NamedSharding(_mesh(0), P(None, None, "y")),
        NamedSharding(_mesh(4), P(None, None, "y")),
    ]
    layout = rows_layout((2, 2), shardings, 3)
    assert layout.joined.mesh.axis_names == ("stages", "x", "y")
    assert layout.joined.spec == P("stages", None, "y")
    parts = [jax.device_put(DATA[:2], shardings[0]), jax.device_put(DATA[2:], shardings[1])]
    joined = join_parts(parts, layout, DATA.shape)
    assert isinstance(joined, jax.Array) and joined.sharding == layout.joined
    np.testing.assert_array_equal(np.asarray(joined), DATA)
    assert _pointers(joined) == _pointers(parts[0]) | _pointers(parts[1])
    again = split_leaf(joined, layout)
    assert [_pointers(p) for p in again] == [_pointers(p) for p in parts]
    assert [p.sharding for p in again] == shardings
    # A host array (or one elsewhere) is placed in the joined sharding, then cut.
    from_host = split_leaf(DATA, layout)
    np.testing.assert_array_equal(np.asarray(from_host[1]), DATA[2:])
    assert from_host[1].sharding == shardings[1]


def test_rows_of_a_stage_that_holds_several_parts_are_put_together():
    """One row per part, two parts per stage: each stage's rows are concatenated on its
    mesh (one compiled call), and cut again on the way back."""
    row = [NamedSharding(_mesh(0), P()), NamedSharding(_mesh(4), P())]
    shardings = [row[0], row[0], row[1], row[1]]
    layout = rows_layout((1, 1, 1, 1), shardings, 3)
    assert layout.groups == ((0, 1), (2, 3)) and layout.joined.spec == P("stages")
    parts = [jax.device_put(DATA[i], s) for i, s in enumerate(shardings)]
    joined = join_parts(parts, layout, DATA.shape)
    np.testing.assert_array_equal(np.asarray(joined), DATA)
    back = split_leaf(joined, layout)
    for i, part in enumerate(back):
        np.testing.assert_array_equal(np.asarray(part), DATA[i])
        assert part.sharding == shardings[i]


def test_parts_no_sharding_can_describe_stay_stacked_rows():
    a, b = _mesh(0), _mesh(4, (2, 2))
    cases = {
        "two mesh shapes": ((2, 2), [NamedSharding(a, P()), NamedSharding(b, P())]),
        "unequal rows": ((1, 3), [NamedSharding(a, P()), NamedSharding(_mesh(4), P())]),
        "unlike shardings": (
            (2, 2),
            [NamedSharding(a, P(None, None, "y")), NamedSharding(_mesh(4), P())],
        ),
        "a mesh twice": (
            (1, 2, 1),
            [NamedSharding(a, P()), NamedSharding(_mesh(4), P()), NamedSharding(a, P())],
        ),
    }
    for name, (sizes, shardings) in cases.items():
        layout = rows_layout(sizes, shardings, 3)
        assert layout.joined is None, name
        start = np.cumsum((0,) + sizes)
        parts = [
            jax.device_put(DATA[s] if n == 1 else DATA[s : s + n], sh)
            for s, n, sh in zip(start, sizes, shardings, strict=False)
        ]
        value = join_parts(parts, layout, DATA.shape)
        assert isinstance(value, StackedRows), name
        np.testing.assert_array_equal(np.asarray(value), DATA)
        assert split_leaf(value, layout) == parts
