"""The Ray workers' instruction set (``runtime/worker_program.py``) against the plan's
(``runtime/instructions.py``): one name per idea, one handler per opcode."""

from __future__ import annotations

from alpa.runtime import worker_ops
from alpa.runtime.instructions import Op
from alpa.runtime.worker_program import WorkerOp


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
