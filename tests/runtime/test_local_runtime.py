"""The in-process runtime's handlers, one instruction at a time (``alpa.runtime.local_runtime``).

``LOAD`` cuts a whole batch into its ``k`` micro-batches on one mesh in one compiled call.
The oracle is the batch itself: micro-batch ``m`` must be rows ``m * size .. (m + 1) * size``
in the planned sharding, whatever form the batch arrives in. A grouping error would not
show in a step's numerics (a mean loss's gradient does not depend on how rows are grouped),
so it is checked here directly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import devices_or_skip
from jax.sharding import NamedSharding, PartitionSpec

from alpa.runtime.instructions import Instruction, Op
from alpa.runtime.local_runtime import HANDLERS, RuntimeContext
from alpa.util import count_communication_primitives

SIZE, WIDTH = 4, 8


def _mesh(first: int, shape: tuple[int, int]) -> jax.sharding.Mesh:
    n = shape[0] * shape[1]
    devices = np.array(devices_or_skip(8)[first : first + n]).reshape(shape)
    return jax.sharding.Mesh(devices, ("x", "y"))


# (mesh of the stage, spec of a micro-batch): dim 0 left whole (the view is taken inside the
# call) and dim 0 split (the view is taken before it), on one device, four and a 2x2 grid.
LAYOUTS = {
    "one device": ((4, (1, 1)), PartitionSpec()),
    "columns split": ((4, (1, 4)), PartitionSpec(None, "y")),
    "rows split": ((4, (1, 4)), PartitionSpec(("x", "y"))),
    "rows and columns": ((4, (2, 2)), PartitionSpec("x", "y")),
}


def _forms(batch: np.ndarray) -> dict:
    """The batch as a user may pass it: host, uncommitted, and committed elsewhere (on a
    device outside the stage's mesh, or split over all 8 devices in another layout)."""
    all8 = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    return {
        "numpy": batch,
        "uncommitted": jnp.asarray(batch),
        "committed elsewhere": jax.device_put(batch, jax.devices()[0]),
        "sharded over 8": jax.device_put(batch, NamedSharding(all8, PartitionSpec("b", "a"))),
    }


def _load(sharding, k: int):
    keys = tuple(("x", m, 0) for m in range(k))
    context = RuntimeContext(
        kernels=[],
        allocs=lambda keys: None,
        sharding_of=lambda key: sharding,
        micro_batch_size=[SIZE],
        kernel_names=[],
        shape_of=lambda key: (SIZE, WIDTH),
    )
    instruction = Instruction(Op.LOAD, 0, (), keys, leaf=0)
    slots = {key: m for m, key in enumerate(keys)}
    fn, _, _, out_slots = HANDLERS[Op.LOAD](instruction, slots, context)
    return fn, out_slots


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_cuts_every_form_of_batch_into_its_micro_batches(layout, k):
    (first, shape), spec = LAYOUTS[layout]
    sharding = NamedSharding(_mesh(first, shape), spec)
    batch = np.arange(k * SIZE * WIDTH, dtype=np.float32).reshape(k * SIZE, WIDTH)
    fn, out_slots = _load(sharding, k)
    for form, value in _forms(batch).items():
        env = [None] * k
        fn(env, [value])
        for m, slot in enumerate(out_slots):
            micro = env[slot]
            assert micro.sharding.is_equivalent_to(sharding, 2), (form, m, micro.sharding)
            np.testing.assert_array_equal(
                np.asarray(micro), batch[m * SIZE : (m + 1) * SIZE], err_msg=f"{form} mb{m}"
            )
            # Every device holds exactly its tile of this micro-batch.
            tiles = sharding.devices_indices_map((SIZE, WIDTH))
            for shard in micro.addressable_shards:
                np.testing.assert_array_equal(
                    np.asarray(shard.data), batch[m * SIZE : (m + 1) * SIZE][tiles[shard.device]]
                )
    if k > 1:
        # Each device slices rows it received: the cut communicates nothing. It reads the
        # flat batch when the spec leaves dim 0 whole, else the batch's [k, size, ...] view.
        whole = not tuple(spec) or spec[0] is None
        shape = batch.shape if whole else (k, SIZE, WIDTH)
        hlo = fn.cut.lower(jax.ShapeDtypeStruct(shape, batch.dtype)).compile().as_text()
        assert count_communication_primitives(hlo).total == 0, hlo
