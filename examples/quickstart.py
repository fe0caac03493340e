"""Quickstart: one training step of a flax MLP, serial and parallelized automatically.

Runs on the GPUs of this machine, or on 8 virtual CPU devices when there are none. It shows

1. the auto-sharding ILP's plan for the step on a 2x4 mesh (every parameter's sharding),
2. an automatic pipeline (layers clustered, stages and submeshes by the stage DP), and
   the plan of GPT-2.6B for a cluster that is not here (2 nodes x 8 A100s), drawn into
   gpt_2.6b_plan.png (with matplotlib: pip install -e ".[plot]"),
3. the fixed methods (data parallel, ZeRO-2/3, gradient accumulation),

and for each whether the result matches the serial step, the collectives in the compiled
program and the bytes each device allocates.

    python examples/quickstart.py
"""

import os

# Virtual CPU devices; this flag only affects the CPU platform, so GPUs win when present.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import alpa  # noqa: E402
from alpa.testing import assert_allclose  # noqa: E402
from alpa.util import count_communication_primitives  # noqa: E402


class MLP(nn.Module):
    hidden: int = 512
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(x.shape[-1])(x)


def train_step(state, batch):
    def loss_fn(params):
        out = state.apply_fn(params, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    # alpa.grad is jax.grad plus a marker between computing and applying gradients.
    grads = alpa.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


def plan_for_a_cluster_that_is_not_here():
    """GPT-2.6B (fp16, batch 1024 in 64 micro-batches, Alpa's benchmark setting) planned
    for 2 nodes x 8 A100-40GB: abstract inputs, no device touched, the analytic cost
    model."""
    import dataclasses
    import time

    from alpa.model.gpt import GPT_PRESETS, get_gpt_train_state_and_step

    config = dataclasses.replace(GPT_PRESETS["2.6B"], dtype=jnp.float16)
    state, batch, step = get_gpt_train_state_and_step(
        config, 1024, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=alpa.ClusterSpec.preset("a100-40gb", num_nodes=2),
        num_micro_batches=64,
        layer_option=alpa.AutoLayerOption(layer_num=8, remat_mode="coarse_grained_remat"),
        stage_option="auto",
    )
    start = time.perf_counter()
    plan = alpa.parallelize(step, method=method).plan(state, batch)
    seconds = time.perf_counter() - start
    lines = str(plan).splitlines()
    print(f"\n   GPT-2.6B for 2 x 8 A100s, planned here in {seconds:.0f} s (no GPU needed):")
    for line in lines[: 2 + plan.stage_plan.num_stages]:  # the stage table
        print("  ", line)
    try:
        drawing = plan.draw("gpt_2.6b_plan.png")
    except ImportError as e:  # matplotlib: pip install -e ".[plot]"
        print(f"   (no picture: {e})")
    else:
        print(
            f"   drawn into {drawing.path}: {drawing.devices} devices by stage, the schedule's "
            f"{sum(drawing.blocks.values())} tasks over {drawing.makespan:.2f} s"
        )


def main():
    alpa.init("local")
    devices = jax.devices()
    print(f"{len(devices)} x {devices[0].platform} devices")

    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((256, 512)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((256, 512)), jnp.float32),
    }
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), batch["x"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    expected = jax.jit(train_step)(state, batch)

    # 1. The ILP's plan on a 2-D mesh.
    method = alpa.ShardParallel(
        auto_sharding_option=alpa.AutoShardingOption(logical_mesh_shape=(2, 4))
    )
    p_step = alpa.parallelize(train_step, method=method, donate_argnums=())
    plan = p_step.plan(state, batch)
    print(f"\n1. auto-sharding plan on a {plan.logical_mesh.shape} mesh (mesh axes x, y):")
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    for (path, leaf), spec in zip(leaves, plan.in_specs[1 : 1 + len(leaves)], strict=True):
        print(f"   {jax.tree_util.keystr(path):<42}{str(leaf.shape):<14}{spec}")
    out = p_step(state, batch)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    counts = count_communication_primitives(p_step.get_last_executable().get_hlo_text())
    print(
        f"   matches the serial step; {counts.all_reduce} all-reduce, "
        f"{counts.all_gather} all-gather, {counts.reduce_scatter} reduce-scatter"
    )

    # 2. An automatic pipeline: layers, stages, submeshes and logical shapes chosen.
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="auto",
    )
    p_step = alpa.parallelize(train_step, method=method, donate_argnums=())
    print("\n2.", p_step.plan(state, batch))
    out = p_step(state, batch)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    print("   matches the serial step")
    plan_for_a_cluster_that_is_not_here()
    print("\n3. fixed methods:")
    print(
        f"{'method':<34}{'matches serial':>15}{'all-reduce':>11}{'all-gather':>11}"
        f"{'MiB/device':>11}"
    )
    for method in (
        alpa.DataParallel(),
        alpa.Zero2Parallel(),
        alpa.Zero3Parallel(),
        alpa.DataParallel(num_micro_batches=4),
    ):
        p_step = alpa.parallelize(train_step, method=method, donate_argnums=())
        out = p_step(state, batch)
        executable = p_step.get_last_executable()
        try:
            assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
            ok = "yes"
        except AssertionError:
            ok = "NO"
        counts = count_communication_primitives(executable.get_hlo_text())
        mib = executable.get_total_allocation_size() / 2**20
        label = type(method).__name__
        if method.num_micro_batches:
            label += f", {method.num_micro_batches} micro-batches"
        print(f"{label:<34}{ok:>15}{counts.all_reduce:>11}{counts.all_gather:>11}{mib:>11.2f}")
    alpa.shutdown()


if __name__ == "__main__":
    main()
