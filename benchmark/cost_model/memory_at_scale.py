"""The stage cost model's memory per device at scale, against XLA's.

GPT-39B (``models.GPT_39B``: 48 blocks, hidden 8192, 64 heads, fp32, an explicit causal
mask, Adam), batch 1024 in 64 micro-batches, ``AutoLayerOption(16,
remat_mode="coarse_grained_remat")``, planned for 8 x 8 A100-40GB (``ClusterSpec``; no GPU
needed). For each plan below, each stage's predicted bytes per device
(``plan.cost.memory``: state, activations of the micro-batches in flight under the
schedule, temporaries) against XLA's: the stage's programs (forward, backward, apply)
compiled at their real shapes for 8 CPU devices in the stage's logical shape (compile
only: ``lower().compile().memory_analysis()`` allocates nothing), then the most a device
holds at any ``RUN`` of the step with the buffers the step keeps around it
(``runtime.memory.step_peak_bytes``, what ``get_step_memory_per_mesh`` reports for a
compiled pipeline). The programs are compiled as the executable compiles them: the
step's donated state (its ``TrainState``) donated to the apply computation that replaces
it, whose new state then reuses the old one's buffers.

* ``hand``: the hand plan of ``benchmark/pipeline``: 8 stages of 2 layers, each on one
  node's 8 GPUs, logical ``(1, 8)``, every weight split
  (``allow_replicated_parameters=False``), the ILP otherwise free;
* ``megatron``: the same with the batch forced onto the logical axis of one device
  (``force_batch_dim_to_mesh_dim=0``): tensor parallelism inside each node;
* ``search``: what ``stage_option="auto"`` picks (or, when no plan fits the budget, its
  error, recorded as the row's ``no_plan_fits``);
* ``fifteen``: 2 layers on one node (logical ``(8, 1)``), then 14 one-layer stages on 4
  GPUs each (logical ``(4, 1)``), the ILP free: what the search picked before the model
  counted the parameter copies a stage gathers.

XLA's CPU backend fuses less than XLA:GPU, and the A100 preset's model counts
temporaries as XLA:GPU fuses them (``ClusterSpec.fuses_elementwise``); the model is
therefore priced twice, under the preset (what planning uses) and with
``fuses_elementwise=False`` (the CPU compiler's setting), and the second is what is set
against the CPU compile. Results go to ``--out`` (JSON) and a table is printed.

    python benchmark/cost_model/memory_at_scale.py [--stages 0 7] [--plans hand search]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        # Memory analysis is the same at LLVM -O0 (tests/conftest.py); compiling is faster.
        " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import alpa  # noqa: E402
from alpa.device_mesh import ClusterSpec  # noqa: E402
from alpa.executables.stage_programs import StagePrograms  # noqa: E402
from alpa.runtime.instructions import Op, donated_inputs  # noqa: E402
from alpa.runtime.memory import allocation_bytes, step_peak_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT_39B, gpt_setup  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def method(cluster: ClusterSpec, plan: str, micro_batches: int, remat: str, replay=None):
    """The method of ``plan``; ``replay``: a plan whose stages it takes instead (the
    search's, priced again under another fusion setting without searching again)."""
    layer_option = alpa.AutoLayerOption(layer_num=16, remat_mode=remat)
    if replay is not None:
        stages = replay.stage_plan
        stage_option = alpa.ManualStageOption(
            forward_stage_layer_ids=stages.stage_layers(),
            submesh_physical_shapes=stages.submesh_shapes,
            submesh_logical_shapes=[m.shape for m in replay.logical_meshes],
            submesh_autosharding_option_dicts=[o or {} for o in stages.autosharding_option_dicts],
        )
    elif plan == "search":
        stage_option = "auto"
    elif plan == "fifteen":
        # The plan the search picked before parameter copies were counted: 2 layers on a
        # node's 8 GPUs, then 14 stages of one layer on 4 GPUs, logical (4, 1).
        stage_option = alpa.ManualStageOption(
            forward_stage_layer_ids=[[0, 1]] + [[layer] for layer in range(2, 16)],
            submesh_physical_shapes=[(1, 8)] + [(1, 4)] * 14,
            submesh_logical_shapes=[(8, 1)] + [(4, 1)] * 14,
        )
    else:
        nodes, per = cluster.num_nodes, cluster.num_devices_per_node
        option = {"allow_replicated_parameters": False}
        if plan == "megatron":
            # The batch on the logical mesh's axis 0, of one device: every weight split
            # over the node's 8 GPUs and the activations between them, Megatron's tensor
            # parallelism (without it the ILP may keep the weights split for storage and
            # split the batch instead, gathering each weight for its use: ZeRO-3).
            option = {**option, "force_batch_dim_to_mesh_dim": 0}
        stage_option = alpa.ManualStageOption(
            forward_stage_layer_ids=[[2 * s, 2 * s + 1] for s in range(nodes)],
            submesh_physical_shapes=[(1, per)] * nodes,
            submesh_logical_shapes=[(1, per)] * nodes,
            submesh_autosharding_option_dicts=[option] * nodes,
        )
    return alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=micro_batches,
        layer_option=layer_option,
        stage_option=stage_option,
    )


def xla_stage_peaks(plan, stages) -> dict[int, dict]:
    """Per stage in ``stages``: XLA's peak bytes per device over the step, and its
    programs' figures, compiled for this process's CPU devices."""
    devices = jax.devices()
    meshes = []
    for logical in plan.logical_meshes:
        n = logical.num_devices
        if n > len(devices):
            meshes.append(None)
            continue
        array = np.asarray(devices[:n]).reshape(logical.shape)
        meshes.append(Mesh(array, logical.axis_names))
    programs = StagePrograms(plan, meshes)
    instructions = plan.instructions
    # The state the step donates (a TrainState argument, ``donate_argnums="auto"``) is
    # donated to the apply computation that replaces it, as the executable compiles it.
    traced = plan.traced
    donated = {
        plan.names[v] for v, d in zip(traced.jaxpr.invars, traced.donated_invars, strict=True) if d
    }
    donate = donated_inputs(instructions, donated)
    wanted = {m for m in stages}
    run_bytes: dict[int, int] = {}
    figures: dict[int, list] = {s: [] for s in stages}
    for ins in instructions.instructions:
        if ins.op is not Op.RUN or ins.mesh not in wanted or ins.computation in run_bytes:
            continue
        kernel = instructions.kernels[ins.computation]
        start = time.perf_counter()
        jitted, structs, _ = programs.kernel(kernel, donate.get(ins.computation, ()))
        compiled = jitted.lower(*structs).compile()
        stats = compiled.memory_analysis()
        run_bytes[ins.computation] = allocation_bytes(compiled)
        comp = plan.program.computations[kernel.computation]
        figures[ins.mesh].append(
            {
                "program": comp.name,
                "arguments": int(stats.argument_size_in_bytes),
                "outputs": int(stats.output_size_in_bytes),
                "temporaries": int(stats.temp_size_in_bytes),
                "aliased": int(stats.alias_size_in_bytes),
                "compile_s": round(time.perf_counter() - start, 1),
            }
        )

    var_of = {name: v for v, name in plan.names.items()}

    def buffer_bytes(key) -> int:
        aval = var_of[key[0]].aval
        logical = plan.logical_meshes[key[2]]
        spec = plan.buffer_specs[(key[0], key[2])]
        split = 1
        for entry in spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                split *= logical.shape[list(logical.axis_names).index(axis)]
        return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize // split

    peaks = step_peak_bytes(instructions, buffer_bytes, lambda k: run_bytes.get(k, 0), donate)
    return {s: {"xla_peak": peaks[s], "programs": figures[s]} for s in stages}


def run(args) -> list[dict]:
    state, batch, step = gpt_setup(GPT_39B, args.batch, abstract=True)
    preset = ClusterSpec.preset("a100-40gb", 8, 8)
    rows = []
    for name in args.plans:
        start = time.perf_counter()
        parallel = alpa.parallelize(
            step, method=method(preset, name, args.micro_batches, args.remat)
        )
        try:
            plan = parallel.plan(state, batch)
        except ValueError as e:
            if name != "search":
                raise
            # No plan fits the budget: the search's own explanation is the result.
            print(f"search: {e}", flush=True)
            rows.append(
                {
                    "plan": name,
                    "plan_s": round(time.perf_counter() - start, 1),
                    "no_plan_fits": str(e),
                }
            )
            continue
        plan_s = time.perf_counter() - start
        cost = plan.cost
        cpu_cluster = dataclasses.replace(preset, fuses_elementwise=False)
        # The search's stages replayed: searching again under the CPU setting could pick
        # other stages.
        replay = plan if name == "search" else None
        cpu_method = method(cpu_cluster, name, args.micro_batches, args.remat, replay)
        cpu_cost = alpa.parallelize(step, method=cpu_method).plan(state, batch).cost
        print(
            f"{name}: {plan.num_stages} stages, predicted GiB per device "
            f"{[round(m / GIB, 2) for m in cost.memory]}",
            flush=True,
        )
        stages = [s for s in args.stages if s < plan.num_stages] or [0]
        xla = xla_stage_peaks(plan, stages)
        for s in stages:
            rows.append(
                {
                    "plan": name,
                    "plan_s": round(plan_s, 1),
                    "stage": s,
                    "num_stages": plan.num_stages,
                    "layers": plan.stage_plan.stage_layers()[s],
                    "submesh": list(plan.stage_plan.submesh_shapes[s]),
                    "logical": list(plan.logical_meshes[s].shape),
                    "predicted": cost.memory[s],
                    "predicted_state": cost.state_memory[s],
                    "predicted_activation_per_micro_batch": cost.activation_memory[s],
                    "predicted_cpu_fusion": cpu_cost.memory[s],
                    "fits": cost.fits[s],
                    "predicted_step_s": plan.predicted_cost,
                    **xla[s],
                }
            )
            r = rows[-1]
            print(
                f"{name} stage {s} ({len(r['layers'])} layers on {r['submesh']}, logical "
                f"{r['logical']}): predicted {r['predicted'] / GIB:.2f} GiB (CPU fusion "
                f"{r['predicted_cpu_fusion'] / GIB:.2f}), XLA "
                f"{r['xla_peak'] / GIB:.2f} GiB",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", nargs="+", default=["hand", "search"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 7])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--remat", default="coarse_grained_remat")
    parser.add_argument("--out", default=os.path.join(HERE, "memory_at_scale.json"))
    args = parser.parse_args()
    alpa.util.disable_tqdm_globally()
    rows = run(args)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
