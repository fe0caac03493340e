"""A pipeline plan and the step it runs, drawn side by side.

Plans a 4-layer MLP (Dense(1024), Adam, batch 256 in 8 micro-batches) as 2 automatic
stages on this machine's 8 (virtual CPU) devices, runs two steps, and writes

* ``OUT/mlp_planned.png``: the plan (devices by stage, the 1F1B timeline at the
  predicted latencies), ``plan.draw``;
* ``OUT/mlp_ran.png``: the second step as it ran, each instruction waited for
  (``executable.draw_last_step``), and ``OUT/mlp_trace.json``, its Chrome/Perfetto trace.

Needs matplotlib (``pip install -e ".[plot]"``).

    python examples/draw_plan.py docs/images
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402

import alpa  # noqa: E402
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step  # noqa: E402


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    alpa.init("local")
    model = MLPModel(hidden_size=1024, num_layers=3, output_dim=1024)
    state, batch, step = get_mlp_train_state_and_step(
        model, 256, 1024, grad_func=alpa.value_and_grad
    )
    method = alpa.PipeshardParallel(
        num_micro_batches=8,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option=alpa.UniformStageOption(num_stages=2),
    )
    parallel = alpa.parallelize(step, method=method)
    jax.block_until_ready(parallel(state, batch))  # compile and warm up
    executable = parallel.get_last_executable()
    executable.collect_trace = True
    jax.block_until_ready(parallel(state, batch))
    planned = executable.plan.draw(os.path.join(out, "mlp_planned.png"))
    ran = executable.draw_last_step(os.path.join(out, "mlp_ran.png"))
    executable.dump_stage_execution_trace(os.path.join(out, "mlp_trace.json"))
    print(f"planned: {planned.makespan * 1e3:.2f} ms per step, blocks {planned.blocks}")
    print(f"ran:     {ran.makespan * 1e3:.2f} ms per step, blocks {ran.blocks}")
    print(f"wrote {planned.path}, {ran.path} and the trace into {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
