"""``runtime.memory.step_peak_bytes``: the most one device of each mesh holds during a
step, by closed form on a hand-written instruction list."""

from __future__ import annotations

from alpa.runtime.instructions import Instruction, Op, PipelineInstructions
from alpa.runtime.memory import step_peak_bytes

SIZES = {"w": 100, "v": 40, "a0": 10, "a1": 10, "g": 5, "h": 5, "r": 10, "z": 1}
ALLOCATION = {0: 50, 1: 70, 2: 30}  # what XLA allocates per kernel (args + outs + temps)


def _key(name: str, mesh: int, micro_batch: int | None = None):
    return (name, micro_batch, mesh)


def test_peak_is_a_runs_allocation_plus_the_buffers_held_around_it():
    """Mesh 0 holds ``w`` (the caller's) all step. Two forwards write ``a0``, ``a1``; two
    backwards read them and free them. At each ``RUN``: the program's allocation plus
    the live buffers it neither reads nor writes:

    * forward 0: 50; forward 1: ``a0`` + 50 = 60;
    * backward 0 (reads ``a0``): ``a1`` + 70 = 80; backward 1 (``a0`` freed): ``g`` + 70 = 75.

    Mesh 1 holds ``v`` and receives ``r`` before its ``RUN``: 40 + 10 + 30 = 80."""
    w, v = _key("w", 0), _key("v", 1)
    a0, a1 = _key("a0", 0, 0), _key("a1", 0, 1)
    g, h, r, z = _key("g", 0), _key("h", 0), _key("r", 1), _key("z", 1)
    instructions = PipelineInstructions(
        instructions=(
            Instruction(Op.RUN, 0, inputs=(w,), outputs=(a0,), computation=0),
            Instruction(Op.RUN, 0, inputs=(w,), outputs=(a1,), computation=0),
            Instruction(Op.RUN, 0, inputs=(w, a0), outputs=(g,), computation=1, free=(a0,)),
            Instruction(Op.RESHARD, 1, inputs=(a1,), outputs=(r,)),
            Instruction(Op.RUN, 0, inputs=(w, a1), outputs=(h,), computation=1, free=(a1,)),
            Instruction(Op.RUN, 1, inputs=(), outputs=(z,), computation=2),
        ),
        kernels=(),
        num_meshes=2,
        persistent=frozenset({w, v}),
        outputs=(),
        nbytes={},
    )
    peak = step_peak_bytes(instructions, lambda key: SIZES[key[0]], ALLOCATION.__getitem__)
    assert peak == [80, 80]
    # The caller's buffers are never freed, even where an instruction lists them.
    freeing_w = PipelineInstructions(
        instructions=(
            Instruction(Op.RUN, 0, inputs=(w,), outputs=(a0,), computation=0, free=(w,)),
            Instruction(Op.RUN, 0, inputs=(a0,), outputs=(g,), computation=1),
        ),
        kernels=(),
        num_meshes=1,
        persistent=frozenset({w}),
        outputs=(),
        nbytes={},
    )
    assert step_peak_bytes(freeing_w, lambda key: SIZES[key[0]], ALLOCATION.__getitem__) == [170]
