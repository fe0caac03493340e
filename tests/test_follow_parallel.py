"""CreateStateParallel and FollowParallel: the state is created where the training step
reads it, and an evaluation step reads it there too (alpa/methods/create_state_parallel.py,
alpa/methods/follow_parallel.py)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import alpa
from alpa.runtime.placement import is_placed
from alpa.testing import assert_allclose

BATCH, HIDDEN = 32, 64


class _MLP(nn.Module):
    marked: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN * 2, use_bias=False)(x))
        if self.marked:
            alpa.mark_pipeline_boundary()
        x = nn.relu(nn.Dense(HIDDEN * 2, use_bias=False)(x))
        return nn.Dense(HIDDEN, use_bias=False)(x)


def _functions(marked: bool = False):
    model = _MLP(marked)

    def create_state(rng):
        params = model.init(rng, jnp.ones((BATCH, HIDDEN)))
        # Adam's eps bounds m / (sqrt(v) + eps): with the default 1e-8 an element whose
        # gradient is ~0 moves by up to lr on float rounding alone, so two exact programs
        # that sum in different orders (a pipeline's micro-batches) differed by 2.6e-4.
        tx = optax.adam(1e-2, eps=1e-3)
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss(params, batch, apply_fn):
        return jnp.mean((apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    def train_step(state, batch, grad=alpa.grad):
        grads = grad(lambda p: loss(p, batch, state.apply_fn))(state.params)
        return state.apply_gradients(grads=grads)

    def eval_step(state, batch):
        return loss(state.params, batch, state.apply_fn)

    return create_state, train_step, eval_step


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((BATCH, HIDDEN), dtype=np.float32),
        "y": rng.standard_normal((BATCH, HIDDEN), dtype=np.float32),
    }


def _check_created_in_place(state, executable):
    """Every leaf of the created state is in the train step's sharding of it (so the
    first step copies nothing), and each device holds only its shard."""
    specs = jax.tree.leaves(
        executable.get_input_placement_specs()[0],
        is_leaf=lambda x: isinstance(x, alpa.executables.base.PlacementSpec),
    )
    leaves = jax.tree.leaves(state)
    assert len(specs) == len(leaves)
    sharded = 0
    for leaf, spec in zip(leaves, specs, strict=True):
        sharding = spec.placements[0]
        assert is_placed(leaf, sharding), (leaf.sharding, sharding)
        shard_shape = sharding.shard_shape(leaf.shape)
        for shard in leaf.addressable_shards:
            assert shard.data.shape == shard_shape
        sharded += math.prod(shard_shape) < math.prod(leaf.shape)
    return sharded


@pytest.mark.parametrize(
    "method",
    [
        lambda: alpa.ShardParallel(
            auto_sharding_option=alpa.AutoShardingOption(logical_mesh_shape=(2, 4))
        ),
        alpa.Zero3Parallel,
    ],
    ids=["shard_2x4", "zero3"],
)
def test_create_state_in_train_step_sharding(method):
    create_state, train_step, _ = _functions()
    batch = _batch(0)
    p_train = alpa.parallelize(train_step, method=method())
    p_create = alpa.parallelize(create_state, method=alpa.CreateStateParallel(p_train, batch))
    rng = jax.random.key(0)
    state = p_create(rng)

    expected = jax.jit(create_state)(rng)
    assert_allclose(state, expected)
    executable = p_train.get_executable(state, batch)
    assert _check_created_in_place(state, executable) > 0  # some leaves really sharded
    # No device builds the whole state: each holds its shards, and the creation's
    # temporaries stay well under the full state's size.
    memory = p_create.get_last_executable().compiled.memory_analysis()
    shard_bytes = sum(
        math.prod(leaf.addressable_shards[0].data.shape) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
    )
    full_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert abs(memory.output_size_in_bytes - shard_bytes) < 1024
    assert memory.temp_size_in_bytes < full_bytes / 2

    # The first step takes the state as it is: its fast path accepts every leaf.
    jitted = jax.jit(lambda s, b: train_step(s, b, jax.grad))
    for i in range(2):
        state = p_train(state, _batch(i))
        expected = jitted(expected, _batch(i))
    assert_allclose(state, expected)


def test_create_state_pipeshard_leaves_on_their_stage_mesh():
    create_state, train_step, _ = _functions(marked=True)
    batch = _batch(0)
    p_train = alpa.parallelize(
        train_step,
        method=alpa.PipeshardParallel(
            num_micro_batches=2, layer_option="manual", stage_option="uniform"
        ),
    )
    p_create = alpa.parallelize(create_state, method=alpa.CreateStateParallel(p_train, batch))
    rng = jax.random.key(1)
    state = p_create(rng)
    expected = jax.jit(create_state)(rng)
    assert_allclose(state, expected)
    executable = p_train.get_last_executable()
    _check_created_in_place(state, executable)
    meshes = {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(state.params)}
    assert len(meshes) == 2  # the layers' kernels on the two stages' submeshes

    jitted = jax.jit(lambda s, b: train_step(s, b, jax.grad))
    state = p_train(state, batch)
    expected = jitted(expected, batch)
    assert_allclose(state, expected)


def test_create_state_other_args_is_the_second_argument_as_in_alpa():
    """Alpa compiles ``train_step(state, other_args)``: a dict batch is passed as it is, a
    one-tuple is a one-tuple (and the error says so); a step that needs more arguments
    takes a tuple of them; a tuple that fits neither reading is refused by name."""
    create_state, train_step, _ = _functions()
    batch = _batch(0)
    p_train = alpa.parallelize(train_step, method=alpa.DataParallel())
    one_tuple = alpa.parallelize(create_state, method=alpa.CreateStateParallel(p_train, (batch,)))
    with pytest.raises(TypeError, match="tuple indices must be integers") as caught:
        one_tuple(jax.random.key(0))
    assert "with other_args=tuple of one element as its second argument, as Alpa does" in (
        "\n".join(caught.value.__notes__)
    )
    assert "CreateStateParallel(train_step, batch)" in caught.value.__notes__[-1]

    def scaled_step(state, batch, scale):
        return train_step(state, jax.tree.map(lambda x: x * scale, batch))

    p_scaled = alpa.parallelize(scaled_step, method=alpa.DataParallel())
    p_create = alpa.parallelize(
        create_state, method=alpa.CreateStateParallel(p_scaled, (batch, np.float32(2)))
    )
    state = p_create(jax.random.key(0))
    assert_allclose(state, jax.jit(create_state)(jax.random.key(0)))
    _check_created_in_place(state, p_scaled.get_executable(state, batch, np.float32(2)))
    with pytest.raises(
        TypeError,
        match=r"^CreateStateParallel\(scaled_step, other_args\) calls scaled_step\(state, "
        r"other_args\), as Alpa does, but scaled_step\(state, batch, scale\) takes 3 positional "
        r"arguments; other_args is a dict\. Pass the one argument after the state, or a tuple "
        r"of the 2 arguments after it$",
    ):
        alpa.CreateStateParallel(p_scaled, batch)


@pytest.mark.parametrize("method", [alpa.ShardParallel, alpa.Zero3Parallel], ids=str)
def test_follow_parallel_reads_the_state_where_training_left_it(method):
    create_state, train_step, eval_step = _functions()
    state = jax.jit(create_state)(jax.random.key(2))
    p_train = alpa.parallelize(train_step, method=method())
    # An evaluation step keeps the state (Alpa's examples too pass donate_argnums=()).
    p_eval = alpa.parallelize(eval_step, method=alpa.FollowParallel(p_train), donate_argnums=())
    state = p_train(state, _batch(0))
    loss = p_eval(state, _batch(1))

    serial_state = jax.jit(lambda s, b: train_step(s, b, jax.grad))(
        jax.jit(create_state)(jax.random.key(2)), _batch(0)
    )
    np.testing.assert_allclose(loss, jax.jit(eval_step)(serial_state, _batch(1)), rtol=1e-5)
    train_specs = p_train.get_last_executable().get_input_placement_specs()[0]
    eval_specs = p_eval.get_last_executable().get_input_placement_specs()[0]
    assert jax.tree.leaves(train_specs) == jax.tree.leaves(eval_specs)
    # The state as training left it is what evaluation reads: nothing moves.
    eval_shardings = p_eval.get_last_executable().flat_input_shardings()
    for leaf, sharding in zip(jax.tree.leaves(state), eval_shardings, strict=False):
        assert is_placed(leaf, sharding)


def test_follow_parallel_pipeshard_uses_the_training_stages():
    create_state, train_step, eval_step = _functions(marked=True)
    state = jax.jit(create_state)(jax.random.key(3))
    serial = jax.jit(lambda s, b: train_step(s, b, jax.grad))(state, _batch(0))
    p_train = alpa.parallelize(
        train_step,
        method=alpa.PipeshardParallel(
            num_micro_batches=2, layer_option="manual", stage_option="uniform"
        ),
    )
    p_eval = alpa.parallelize(
        eval_step, method=alpa.FollowParallel(p_train, num_micro_batches=2), donate_argnums=()
    )
    state = p_train(state, _batch(0))
    loss = p_eval(state, _batch(1))
    np.testing.assert_allclose(loss, jax.jit(eval_step)(serial, _batch(1)), rtol=1e-5)

    train = p_train.get_last_executable()
    evaluate = p_eval.get_last_executable()
    assert evaluate.plan.schedule.name == "inference"
    # Placement specs describe what the caller passes: the whole batch, not a micro-batch.
    assert train.get_input_placement_specs()[1]["x"].aval.shape == (BATCH, HIDDEN)
    assert evaluate.stage_plan.device_ranges == train.stage_plan.device_ranges
    train_specs = jax.tree.leaves(
        train.get_input_placement_specs()[0].params,
        is_leaf=lambda x: isinstance(x, alpa.executables.base.PlacementSpec),
    )
    eval_specs = jax.tree.leaves(
        evaluate.get_input_placement_specs()[0].params,
        is_leaf=lambda x: isinstance(x, alpa.executables.base.PlacementSpec),
    )
    for t, e in zip(train_specs, eval_specs, strict=True):
        assert (t.mesh_ids, t.sharding_specs) == (e.mesh_ids, e.sharding_specs)


def test_follow_parallel_errors():
    _, train_step, eval_step = _functions()
    p_train = alpa.parallelize(train_step)
    with pytest.raises(TypeError, match="src_func must be a function returned by alpa.parallelize"):
        alpa.FollowParallel(train_step)
    with pytest.raises(TypeError, match="train_step must be a function returned by"):
        alpa.CreateStateParallel(train_step, ())
    with pytest.raises(ValueError, match=r"unknown pipeline_schedule '1F1B'; expected one of"):
        alpa.FollowParallel(p_train, pipeline_schedule="1F1B")
    p_eval = alpa.parallelize(eval_step, method=alpa.FollowParallel(p_train))
    create_state = _functions()[0]
    state = jax.jit(create_state)(jax.random.key(0))
    with pytest.raises(RuntimeError, match="has not been called or compiled yet"):
        p_eval(state, _batch(0))


def _params_eval_step(params, batch):
    """Alpa's evaluation steps take ``state.params``, not the state."""
    model = _MLP()
    return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)


def test_follow_parallel_follows_the_params_of_the_state():
    create_state, train_step, eval_step = _functions()
    state = jax.jit(create_state)(jax.random.key(4))
    p_train = alpa.parallelize(train_step, method=alpa.Zero3Parallel())
    state = p_train(state, _batch(0))
    # Zero3: the parameters are split, so following them is visible in the plan.
    p_eval = alpa.parallelize(
        _params_eval_step, method=alpa.FollowParallel(p_train), donate_argnums=()
    )
    loss = p_eval(state.params, _batch(1))
    np.testing.assert_allclose(loss, jax.jit(eval_step)(state, _batch(1)), rtol=1e-5)
    train_specs = p_train.get_last_executable().get_input_placement_specs()[0].params
    eval_specs = p_eval.get_last_executable().get_input_placement_specs()[0]
    leaves = jax.tree.leaves(eval_specs)
    assert leaves == jax.tree.leaves(train_specs)
    assert any(spec.sharding_specs[0] != jax.sharding.PartitionSpec() for spec in leaves)
    for leaf, sharding in zip(
        jax.tree.leaves(state.params),
        p_eval.get_last_executable().flat_input_shardings(),
        strict=False,
    ):
        assert is_placed(leaf, sharding)


def test_follow_parallel_ignores_micro_batches_of_a_one_mesh_eval_step():
    create_state, train_step, eval_step = _functions()
    state = jax.jit(create_state)(jax.random.key(5))
    p_train = alpa.parallelize(train_step, method=alpa.ShardParallel(num_micro_batches=2))
    state = p_train(state, _batch(0))
    p_eval = alpa.parallelize(
        eval_step, method=alpa.FollowParallel(p_train, num_micro_batches=2), donate_argnums=()
    )
    with pytest.warns(UserWarning, match=r"FollowParallel\(num_micro_batches=2\) is ignored for "
                      r"eval_step: it has no alpa.grad"):  # fmt: skip
        loss = p_eval(state, _batch(1))
    np.testing.assert_allclose(loss, jax.jit(eval_step)(state, _batch(1)), rtol=1e-5)


def test_follow_parallel_layer_option_is_an_option_to_replay():
    create_state, train_step, eval_step = _functions(marked=True)
    state = jax.jit(create_state)(jax.random.key(6))
    source_layers = alpa.ManualLayerOption(remat_layer=True)
    p_train = alpa.parallelize(
        train_step,
        method=alpa.PipeshardParallel(
            num_micro_batches=2, layer_option=source_layers, stage_option="uniform"
        ),
    )
    state = p_train(state, _batch(0))
    p_eval = alpa.parallelize(
        eval_step,
        method=alpa.FollowParallel(p_train, num_micro_batches=2, layer_option=source_layers),
        donate_argnums=(),
    )
    loss = p_eval(state, _batch(1))
    on_host = jax.tree.map(np.asarray, state)  # the state lives on the two stages' meshes
    np.testing.assert_allclose(loss, jax.jit(eval_step)(on_host, _batch(1)), rtol=1e-5)
    evaluate, train = p_eval.get_last_executable(), p_train.get_last_executable()
    assert evaluate.plan.layer_option == source_layers
    assert evaluate.plan.layers.num_layers == 2
    assert evaluate.stage_plan.device_ranges == train.stage_plan.device_ranges


def _params_of_first_layer_step(state, batch):
    """An evaluation step that reads the first layer's kernel only."""
    kernel = state.params["params"]["Dense_0"]["kernel"]
    return jnp.mean(batch["x"] @ kernel)


def test_follow_parallel_cuts_the_step_where_it_reads_each_stages_leaves():
    """Alpa's default ``layer_option="follow"``: an evaluation step without boundaries
    following a pipeline whose layers were clustered is cut into one layer per stage, each
    beginning where the step first reads a leaf that stage holds; ``"manual"`` cuts at the
    step's boundaries, and says what the default does when it cannot."""
    create_state, train_step, eval_step = _functions()
    state = jax.jit(create_state)(jax.random.key(7))
    stages = alpa.ManualStageOption([[0], [1]], [(1, 4)] * 2, [(1, 4)] * 2, [{}, {}])
    method = alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(2), stage_option=stages
    )
    p_train = alpa.parallelize(train_step, method=method)
    state = p_train(state, _batch(0))
    on_host = jax.tree.map(np.asarray, state)

    p_eval = alpa.parallelize(
        eval_step, method=alpa.FollowParallel(p_train, num_micro_batches=2), donate_argnums=()
    )
    np.testing.assert_allclose(
        p_eval(state, _batch(1)), jax.jit(eval_step)(on_host, _batch(1)), rtol=1e-5
    )
    evaluate, train = p_eval.get_last_executable(), p_train.get_last_executable()
    assert evaluate.plan.layers.num_layers == 2
    assert evaluate.stage_plan.device_ranges == train.stage_plan.device_ranges
    train_specs = jax.tree.leaves(train.get_input_placement_specs()[0].params)
    eval_specs = jax.tree.leaves(evaluate.get_input_placement_specs()[0].params)
    assert train_specs == eval_specs  # every parameter read where training keeps it
    assert {s.mesh_ids for s in eval_specs} == {(0,), (1,)}

    manual = alpa.FollowParallel(p_train, num_micro_batches=2, layer_option="manual")
    by_boundaries = alpa.parallelize(eval_step, method=manual, donate_argnums=())
    with pytest.raises(ValueError, match="assigns 2 layers") as caught:
        by_boundaries(state, _batch(1))
    assert "the default, layer_option='follow', cuts it where it reads the parameters" in (
        "\n".join(caught.value.__notes__)
    )
    first_only = alpa.parallelize(
        _params_of_first_layer_step,
        method=alpa.FollowParallel(p_train, num_micro_batches=2),
        donate_argnums=(),
    )
    with pytest.raises(
        ValueError,
        match=r"layer_option='follow'\): _params_of_first_layer_step reads followed leaves "
        r"of stages 0\.\.0 only, of the 2 stages it follows",
    ):
        first_only(state, _batch(1))
