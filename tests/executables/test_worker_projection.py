"""A ``PipeshardPlan`` projected onto Ray worker programs (``executables/worker_projection``),
with no Ray and no device of the workers' kind: the plan comes from ``.plan()`` on the CPU
``ClusterSpec`` and the programs are exported for CPU.

The step: the 4-layer MLP (Dense(64) x 4, Adam), ``UniformStageOption(2)``, 4 micro-batches."""

from __future__ import annotations

import collections

import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.executables.distributed import abstract_mesh
from alpa.executables.stage_programs import StagePrograms
from alpa.executables.worker_projection import (
    PROJECTIONS,
    ConstOutputSource,
    LiteralOutputSource,
    MeshOutputSource,
    project_plan,
)
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES
from alpa.runtime.instructions import Op
from alpa.runtime.worker_program import WorkerOp

WIDTH, LAYERS, MESH_IDS = 64, 4, (10, 11)


@pytest.fixture(scope="module")
def projected():
    model = MLPModel(hidden_size=WIDTH, num_layers=LAYERS - 1, output_dim=WIDTH)
    state, batch, step = get_mlp_train_state_and_step(
        model, 32, WIDTH, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=4,
        layer_option=alpa.AutoLayerOption(layer_num=LAYERS),
        stage_option=alpa.UniformStageOption(num_stages=2),
    )
    plan = alpa.parallelize(step, method=method).plan(state, batch)
    meshes = [abstract_mesh(tuple(m.shape), DATA_AXES) for m in plan.logical_meshes]
    return plan, project_plan(plan, StagePrograms(plan, meshes), MESH_IDS, "cpu")


def test_every_plan_opcode_has_one_projection():
    assert set(PROJECTIONS) == set(Op)


def test_each_mesh_runs_its_instructions_under_their_own_names(projected):
    plan, projection = projected
    instructions = plan.instructions
    assert instructions.num_physical_meshes == len(projection.programs) == 2
    for m, program in enumerate(projection.programs):
        ops = collections.Counter(ins.op for ins in program.instructions)
        mine = collections.Counter(ins.op for ins in instructions.for_mesh(m))
        assert ops[WorkerOp.LOAD] == mine[Op.LOAD] > 0, m
        assert ops[WorkerOp.RUN] == mine[Op.RUN] > 0, m  # no relayouts: one stage a mesh
        assert ops[WorkerOp.ALLOC] == mine[Op.ALLOC] > 0, m  # 4 micro-batches: accumulators
        assert ops[WorkerOp.RECV] == mine[Op.RESHARD] > 0, m
        assert len(program.fns) == len({ins.fn for ins in program.instructions} - {None})


def test_a_reshard_is_a_send_and_a_recv_with_the_plans_tile_plan(projected):
    plan, projection = projected
    sends, recvs = {}, {}
    for m, program in enumerate(projection.programs):
        for ins in program.instructions:
            if ins.op is WorkerOp.SEND:
                sends[ins.tag] = (m, ins.peer_mesh, ins.transfer)
            elif ins.op is WorkerOp.RECV:
                recvs[ins.tag] = (m, ins.peer_mesh, ins.transfer)
    reshards = [i for i, ins in enumerate(plan.instructions.instructions) if ins.op is Op.RESHARD]
    assert sorted(sends) == sorted(recvs) == reshards
    for tag in reshards:
        (src, to, sent), (dst, came_from, received) = sends[tag], recvs[tag]
        assert sent is received is plan.reshards[tag]
        assert src != dst and (to, came_from) == (MESH_IDS[dst], MESH_IDS[src])


def test_step_outputs_say_where_they_come_from(projected):
    plan, projection = projected
    assert len(projection.sources) == len(plan.instructions.outputs)
    kinds = (MeshOutputSource, ConstOutputSource, LiteralOutputSource)
    assert all(isinstance(source, kinds) for source in projection.sources)
    from_mesh = [s for s in projection.sources if isinstance(s, MeshOutputSource)]
    assert from_mesh  # the state and the loss
    for source in from_mesh:
        program = projection.programs[source.mesh]
        assert source.index < len(program.outputs)
        assert len(projection.mesh_outputs[source.mesh]) == len(program.outputs)
        assert plan.instructions.physical_mesh(source.stage_mesh) == source.mesh
    per_mesh = [
        [f"mesh{m} out{i}" for i in range(len(p.outputs))]
        for m, p in enumerate(projection.programs)
    ]
    read = [s.read(per_mesh, {}) for s in from_mesh]
    assert read == [f"mesh{s.mesh} out{s.index}" for s in from_mesh]
