"""Pipeline parallelism by hand: an MLP cut into two stages with one boundary.

The model calls ``alpa.mark_pipeline_boundary()`` once, so the step has two layers; each
becomes a stage on half of the devices, and 16 micro-batches flow through a 1F1B schedule.
The result is checked against the serial step, and the schedule and the per-mesh memory
the runtime accounted for are printed.

    python examples/pipeshard_manual.py
"""

import os

# Virtual CPU devices; this flag only affects the CPU platform, so GPUs win when present.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import alpa  # noqa: E402
from alpa.testing import assert_allclose  # noqa: E402


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        alpa.mark_pipeline_boundary()  # everything above is stage 0, below stage 1
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.hidden)(x)


def make_train_step(value_and_grad):
    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn(params, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step


def main():
    alpa.init("local")
    devices = jax.devices()
    half = len(devices) // 2
    batch_size, hidden = 128, 256
    key_x, key_y, key_init = jax.random.split(jax.random.PRNGKey(0), 3)
    batch = {
        "x": jax.random.normal(key_x, (batch_size, hidden)),
        "y": jax.random.normal(key_y, (batch_size, hidden)),
    }
    model = MLP(hidden)
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(key_init, batch["x"]), tx=optax.adam(1e-3)
    )

    method = alpa.PipeshardParallel(
        num_micro_batches=16,
        layer_option="manual",
        stage_option=alpa.ManualStageOption(
            forward_stage_layer_ids=[[0], [1]],
            submesh_physical_shapes=[(1, half), (1, len(devices) - half)],
        ),
        pipeline_schedule="1f1b",
    )
    parallel_step = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)
    serial_step = jax.jit(make_train_step(jax.value_and_grad))

    parallel_state, serial_state = state, state
    for _ in range(3):
        parallel_state, parallel_loss = parallel_step(parallel_state, batch)
        serial_state, serial_loss = serial_step(serial_state, batch)
    assert_allclose(parallel_state.params, serial_state.params)
    assert_allclose(parallel_loss, serial_loss)
    print(f"loss after 3 steps: {float(parallel_loss):.6f} (matches the serial step)")

    executable = parallel_step.get_last_executable()
    print(executable.schedule.grid())
    print("peak live bytes per mesh:", executable.get_peak_live_bytes())
    print("stage computations:", [c.name for c in executable.program.computations])


if __name__ == "__main__":
    main()
