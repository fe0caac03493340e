"""Checkpoints (alpa/serialization.py): save a parallelized state, restore it into an
executable's placement specs (the same meshes, other mesh shapes, pipeline stages),
continue training equal to the serial run; atomicity under a killed save; bad input."""

import dataclasses
import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import killed_save  # tests/ is on sys.path, as for conftest
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import devices_or_skip
from flax.training.train_state import TrainState

import alpa
from alpa.runtime.placement import PlacementSpec
from alpa.saved_format import NewerFormatError
from alpa.serialization import DamagedCheckpointError, checkpoint_steps
from alpa.testing import assert_allclose, get_mlp_train_state_and_step

BATCH, HIDDEN = 32, 16


def _serial(state, batch, train_step, steps):
    step = jax.jit(train_step)
    for _ in range(steps):
        state = step(state, batch)
    return state


def _train(p_step, state, batch, steps):
    for _ in range(steps):
        state = p_step(state, batch)
    return state


def _assert_placed_as_specs(restored, specs):
    """Every restored leaf is a jax.Array in the sharding of its spec's first mesh."""
    leaves = jax.tree.leaves(restored)
    spec_leaves = jax.tree.leaves(specs)
    assert len(leaves) == len(spec_leaves)
    for x, spec in zip(leaves, spec_leaves, strict=True):
        assert isinstance(x, jax.Array)
        assert x.shape == spec.aval.shape
        target = spec.placements[0]
        assert x.sharding == target or x.sharding.is_equivalent_to(target, x.ndim)


def _shard_parallel(devices=None, logical_shape=None):
    if logical_shape is not None:
        mesh = alpa.LocalPhysicalDeviceMesh(jax.devices()[: np.prod(logical_shape)])
        devices = mesh.get_logical_mesh(logical_shape)
    return alpa.ShardParallel(devices=devices)


# ---- save / restore / continue


def _sharding_method():
    """``ShardParallel`` with no parameter replicated, so that the checkpoint holds split
    leaves (the ILP's free choice for this small MLP on the CPU costs is data parallel)."""
    option = alpa.AutoShardingOption(allow_replicated_parameters=False)
    return alpa.ShardParallel(auto_sharding_option=option)


def test_shard_parallel_state_round_trip_and_continue(tmp_path):
    devices_or_skip(8)
    state, batch, train_step = get_mlp_train_state_and_step(BATCH, HIDDEN, num_layers=2)
    after_two = _serial(state, batch, train_step, 2)
    expected = _serial(state, batch, train_step, 4)
    alpa.save_checkpoint(tmp_path, state, step=0)  # host arrays and a Python int step
    p_step = alpa.parallelize(train_step, method=_sharding_method())
    specs = p_step.get_executable(state, batch).get_input_placement_specs()[0]
    initial = alpa.restore_checkpoint(tmp_path, 0, specs)
    _assert_placed_as_specs(initial, specs)
    assert_allclose(state, initial)

    trained = _train(p_step, state, batch, 2)  # donates state
    alpa.save_checkpoint(tmp_path, trained, step=2)
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)

    assert isinstance(restored, TrainState)
    assert restored.apply_fn is state.apply_fn and restored.tx is state.tx
    _assert_placed_as_specs(restored, specs)
    # The control: at least one leaf is really sharded, so placement was not trivial.
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(restored))
    assert_allclose(after_two, restored)
    assert_allclose(expected, _train(p_step, restored, batch, 2))


def test_save_writes_each_shard_as_its_own_chunk(tmp_path):
    devices_or_skip(8)
    state, batch, train_step = get_mlp_train_state_and_step(BATCH, HIDDEN, num_layers=2)
    trained = alpa.parallelize(train_step, method=_sharding_method())(state, batch)
    alpa.save_checkpoint(tmp_path, trained, step=1)

    with ocp.PyTreeCheckpointer() as checkpointer:
        saved = checkpointer.metadata(tmp_path / "checkpoint_1").item_metadata.tree
    params = trained.params
    kernels = [params[name]["kernel"] for name in sorted(params)]
    assert any(not k.sharding.is_fully_replicated for k in kernels)
    for name in sorted(params):
        for leaf in ("kernel", "bias"):
            x = params[name][leaf]
            shard_shape = x.sharding.shard_shape(x.shape)
            chunk_shape = saved["params"][name][leaf].storage.chunk_shape
            # tensorstore wrote the array shard by shard: every chunk lies inside one
            # shard (orbax may split a replicated shard among its replicas), so no array
            # was gathered whole to one place; a sharded array has one chunk per shard.
            assert all(s % c == 0 for s, c in zip(shard_shape, chunk_shape, strict=True))
            if not x.sharding.is_fully_replicated:
                assert chunk_shape == shard_shape


@pytest.mark.parametrize(
    "restore_method",
    [
        pytest.param(lambda: _shard_parallel(devices=jax.devices()[:4]), id="4-devices"),
        pytest.param(lambda: _shard_parallel(logical_shape=(2, 4)), id="logical-2x4"),
    ],
)
def test_restore_onto_another_mesh_shape_and_continue(tmp_path, restore_method):
    devices_or_skip(8)
    state, batch, train_step = get_mlp_train_state_and_step(BATCH, HIDDEN, num_layers=2)
    expected = _serial(state, batch, train_step, 4)
    p_step = alpa.parallelize(train_step, method=alpa.ShardParallel())
    trained = _train(p_step, state, batch, 2)
    saved_devices = trained.params["Dense_0"]["kernel"].sharding.device_set
    alpa.save_checkpoint(tmp_path, trained, step=2)

    other = alpa.parallelize(train_step, method=restore_method())
    specs = other.get_executable(trained, batch).get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)

    _assert_placed_as_specs(restored, specs)
    kernel = restored.params["Dense_0"]["kernel"]
    assert kernel.sharding.device_set == specs.params["Dense_0"]["kernel"].placements[0].device_set
    assert (kernel.sharding.device_set, kernel.sharding.spec) != (
        saved_devices,
        trained.params["Dense_0"]["kernel"].sharding.spec,
    )
    assert_allclose(expected, _train(other, restored, batch, 2))


def test_pipeshard_state_restores_onto_both_stage_meshes(tmp_path):
    devices_or_skip(8)
    state, batch, train_step = get_mlp_train_state_and_step(
        BATCH, HIDDEN, num_layers=2, add_manual_pipeline_marker=True
    )
    expected = _serial(state, batch, train_step, 4)
    method = alpa.PipeshardParallel(
        num_micro_batches=2, layer_option="manual", stage_option="uniform"
    )
    p_step = alpa.parallelize(train_step, method=method)
    trained = _train(p_step, state, batch, 2)
    alpa.save_checkpoint(tmp_path, trained, step=2)

    specs = p_step.get_executable(trained, batch).get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)

    _assert_placed_as_specs(restored, specs)
    # The parameters of the two stages live on two disjoint submeshes.
    device_sets = {frozenset(x.sharding.device_set) for x in jax.tree.leaves(restored.params)}
    assert len(device_sets) == 2
    first, second = device_sets
    assert not first & second
    assert_allclose(expected, _train(p_step, restored, batch, 2))


# ---- host restore, steps, keep


def test_restore_without_specs_gives_host_arrays(tmp_path):
    devices_or_skip(8)
    state, batch, train_step = get_mlp_train_state_and_step(BATCH, HIDDEN, num_layers=2)
    trained = alpa.parallelize(train_step, method=alpa.ShardParallel())(state, batch)
    alpa.save_checkpoint(tmp_path, trained, step=1)

    state_dict = alpa.restore_checkpoint(tmp_path, 1, None)
    assert set(state_dict) >= {"step", "params", "opt_state"}
    kernel = state_dict["params"]["Dense_0"]["kernel"]
    assert type(kernel) is np.ndarray
    np.testing.assert_array_equal(kernel, np.asarray(trained.params["Dense_0"]["kernel"]))

    as_state = alpa.restore_checkpoint(tmp_path, 1, None, target=state)
    assert isinstance(as_state, TrainState)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(as_state))
    assert_allclose(trained, as_state)


def test_strings_scalars_and_empty_nodes_round_trip(tmp_path):
    target = {"name": "mlp", "n": 3, "lr": 0.5, "w": np.ones(2), "none": None, "empty": {}}
    alpa.save_checkpoint(tmp_path, target, 0)
    restored = alpa.restore_checkpoint(tmp_path, 0)
    assert restored["name"] == "mlp" and restored["none"] is None and restored["empty"] == {}
    assert (restored["n"], restored["lr"]) == (3, 0.5)
    np.testing.assert_array_equal(restored["w"], target["w"])


def test_steps_are_kept_and_latest_is_the_default(tmp_path):
    values = {step: {"w": np.full((4,), float(step)), "n": step} for step in (1, 3, 2)}
    for step, value in values.items():
        alpa.save_checkpoint(tmp_path, value, step)
    assert checkpoint_steps(tmp_path) == [1, 2, 3]
    latest = alpa.restore_checkpoint(tmp_path)
    np.testing.assert_array_equal(latest["w"], values[3]["w"])
    assert latest["n"] == 3
    np.testing.assert_array_equal(alpa.restore_checkpoint(tmp_path, 1)["w"], values[1]["w"])

    alpa.save_checkpoint(tmp_path, {"w": np.zeros(4), "n": 4}, 4, keep=2)
    assert checkpoint_steps(tmp_path) == [3, 4]


def test_restore_into_plain_shardings(tmp_path):
    devices_or_skip(4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    value = np.arange(32.0, dtype=np.float32).reshape(4, 8)
    alpa.save_checkpoint(tmp_path, {"w": value}, 0)
    restored = alpa.restore_checkpoint(tmp_path, 0, {"w": sharding})
    assert restored["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(restored["w"]), value)


# ---- atomicity: saves killed with SIGKILL (tests/killed_save.py)


# Kill points of a re-save (tests/killed_save.py counts renames and rmtrees): after orbax's
# rename of its own files (1), after the checksums (2), between the commit's two renames
# (3), after the commit (4), after deleting the old copy (5).
_RESAVE_OPS = [1, 2, 3, 4, 5]
# Timed kills, as fractions of how long an unkilled re-save of the 16 MiB state takes on
# this machine at this moment (~0.3 s on an idle 2-core machine; fixed offsets missed
# the save when a parallel test slowed or sped it).
_RESAVE_FRACTIONS = [0.1, 0.3, 0.5, 0.7]


def test_a_resave_killed_anywhere_leaves_the_old_or_the_new_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    outcomes, in_window = [], 0
    alpa.save_checkpoint(ckpt, killed_save.state(99), 1)
    # The fastest of three unkilled saves: timed from one slow save, the later kills
    # missed a faster killed one on a CI run (6 of 9 kills landed; 7 are required).
    seconds = min(killed_save.save_seconds(ckpt, 1, 98 - i) for i in range(3))
    times = [round(f * seconds, 4) for f in _RESAVE_FRACTIONS]
    kills = [("op", at) for at in _RESAVE_OPS] + [("time", t) for t in times]
    for seed, (mode, at) in enumerate(kills, start=1):
        # Each kill starts from a committed step 1 (this save also cleans what the last
        # kill left), so that the op counts of the save are the same every time.
        alpa.save_checkpoint(ckpt, killed_save.state(100 + seed), 1)
        assert sorted(os.listdir(ckpt)) == ["checkpoint_1"]
        code = killed_save.run(ckpt, 1, seed, mode, at)
        left = [n for n in os.listdir(ckpt) if n != "checkpoint_1"]
        in_window += bool(left) and code != 0  # killed while the save had files out
        assert checkpoint_steps(ckpt) == [1], (mode, at, os.listdir(ckpt))
        new = killed_save.restored_seed(ckpt, 1, {100 + seed, seed}) == seed
        outcomes.append((mode, at, code, "new" if new else "old"))
    killed = [o for o in outcomes if o[2] == -signal.SIGKILL]
    assert [o[3] for o in outcomes[:5]] == ["old", "old", "old", "new", "new"], outcomes
    # Kills landed between the commit's renames (op 3: no checkpoint_1, only the old copy
    # renamed) and, timed, while the new copy was being written.
    assert in_window >= 4 and len(killed) >= 7, outcomes
    assert any(o[0] == "time" and o[3] == "old" for o in killed), outcomes


def test_keep_deletes_old_steps_only_after_the_new_one_is_committed(tmp_path):
    ckpt = tmp_path / "ckpt"
    # A new step 2 with keep=1: killed before its commit (op 1: orbax's files written,
    # no checksums yet), after it (3), after step 1 was unlisted for deletion (4).
    for at, steps in [(1, [1]), (3, [1, 2]), (4, [2])]:
        shutil.rmtree(ckpt, ignore_errors=True)
        alpa.save_checkpoint(ckpt, killed_save.state(100), 1)
        assert killed_save.run(ckpt, 2, 7, "op", at, "--keep", 1) == -signal.SIGKILL
        assert checkpoint_steps(ckpt) == steps, (at, os.listdir(ckpt))
        for step in steps:
            assert killed_save.restored_seed(ckpt, step, {100, 7}) == (100 if step == 1 else 7)
        if at == 1:
            with pytest.raises(
                FileNotFoundError,
                match=r"no checkpoint of step 2 in .*: the steps there are \[1\] "
                r"\(checkpoint_2\.alpa-tmp-\w+: a save that did not finish, e\.g\. "
                r"killed midway\)",
            ):
                alpa.restore_checkpoint(ckpt, 2)
    alpa.save_checkpoint(ckpt, {"n": 3}, 3, keep=1)
    assert sorted(os.listdir(ckpt)) == ["checkpoint_3"]


# ---- checksums


def _largest_data_file(step_dir):
    sizes = {
        os.path.join(root, name): os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(step_dir)
        for name in names
    }
    return max(sizes, key=sizes.get)


def test_a_flipped_byte_is_an_error_naming_the_step_part_and_file(tmp_path):
    alpa.save_checkpoint(tmp_path, killed_save.state(5), 3)
    path = _largest_data_file(tmp_path / "checkpoint_3")
    rel = os.path.relpath(path, tmp_path / "checkpoint_3")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(64)
        f.seek(-64, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
    with pytest.raises(
        DamagedCheckpointError,
        match=rf"checkpoint of step 3 \(.*checkpoint_3\) is damaged: part 'state', file "
        rf"'{rel}' has CRC-32 \w+, the save wrote \w+",
    ):
        alpa.restore_checkpoint(tmp_path, 3)
    # The control: the same file truncated is caught by its size even without verify.
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DamagedCheckpointError, match=rf"file '{rel}' has 100 bytes, the save"):
        alpa.restore_checkpoint(tmp_path, 3, verify=False)


def test_damaged_metadata_is_an_error_naming_the_file(tmp_path):
    alpa.save_checkpoint(tmp_path, killed_save.state(5), 3)
    metadata = tmp_path / "checkpoint_3" / "_METADATA"
    metadata.write_bytes(b"#" * metadata.stat().st_size)  # same size: only the CRC knows
    with pytest.raises(DamagedCheckpointError, match=r"part 'state', file '_METADATA' has CRC"):
        alpa.restore_checkpoint(tmp_path, 3)
    # Without verify, the failed read is followed by the checksums, which name it too.
    with pytest.raises(DamagedCheckpointError, match=r"part 'state', file '_METADATA' has CRC"):
        alpa.restore_checkpoint(tmp_path, 3, verify=False)
    checksums = tmp_path / "checkpoint_3" / "alpa_checksums.json"
    checksums.write_text("{")
    with pytest.raises(
        DamagedCheckpointError, match=r"part 'checksums', file 'alpa_checksums.json' cannot be"
    ):
        alpa.restore_checkpoint(tmp_path, 3)
    with pytest.raises(TypeError, match=r"verify=1 \(int\) must be a bool"):
        alpa.restore_checkpoint(tmp_path, 3, verify=1)


def _flip(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_step_without_its_checksum_file_is_refused_unless_asked(tmp_path):
    """Every step alpa saves ends with its checksums: one without them (the file deleted)
    is not taken for one saved before checksums existed, whose damage would restore as
    other values; with verify=False it restores, unchecked."""
    saved = killed_save.state(5)
    alpa.save_checkpoint(tmp_path, saved, 3)
    (tmp_path / "checkpoint_3" / "alpa_checksums.json").unlink()
    with pytest.raises(
        DamagedCheckpointError,
        match=r"checkpoint of step 3 \(.*checkpoint_3\) has no checksum file "
        r"'alpa_checksums.json': every step alpa saves ends with one, so it was deleted .* "
        r"Pass verify=False to restore it without checking",
    ):
        alpa.restore_checkpoint(tmp_path, 3)
    restored = alpa.restore_checkpoint(tmp_path, 3, verify=False)
    np.testing.assert_array_equal(restored["params"]["w"], saved["params"]["w"])


@pytest.mark.parametrize("checksums", ["kept", "deleted"])
def test_damage_outside_the_data_names_its_file_without_verify(tmp_path, checksums):
    """With verify=False, or no checksum file, a damaged ``_sharding``, OCDBT manifest or
    root data file (``d/...``, the database's tree) is named, by its checksum where the
    step has one, else by reading each file (it was reported as ``_METADATA``)."""
    alpa.save_checkpoint(tmp_path, jax.tree.map(jnp.asarray, killed_save.state(5)), 3)
    step_dir = tmp_path / "checkpoint_3"
    (root_data,) = os.listdir(step_dir / "d")
    found = "has CRC-32 \\w+, the save wrote" if checksums == "kept" else "cannot be read"
    for rel in ("_sharding", "manifest.ocdbt", f"d/{root_data}"):
        damaged = tmp_path / rel.replace("/", "_")
        shutil.copytree(step_dir, damaged / "checkpoint_3")
        if checksums == "deleted":
            (damaged / "checkpoint_3" / "alpa_checksums.json").unlink()
        _flip(damaged / "checkpoint_3" / rel)
        with pytest.raises(
            DamagedCheckpointError,
            match=rf"checkpoint of step 3 \(.*\) is damaged: part 'state', file '{rel}' {found}",
        ):
            alpa.restore_checkpoint(damaged, 3, verify=False)


def test_a_checkpoint_of_another_dtype_is_not_cast_silently(tmp_path):
    alpa.save_checkpoint(tmp_path, {"w": np.ones((4, 2), np.float32)}, 1)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    bf16 = PlacementSpec(jax.core.ShapedArray((4, 2), jnp.bfloat16), (0,), (None,), (sharding,))
    with pytest.raises(
        ValueError,
        match=r"leaf 'w' is float32 in the checkpoint of step 1, but its placement spec "
        r"expects bfloat16: restoring would cast it. Pass cast_dtypes=True",
    ):
        alpa.restore_checkpoint(tmp_path, 1, {"w": bf16})
    cast = alpa.restore_checkpoint(tmp_path, 1, {"w": bf16}, cast_dtypes=True)
    assert cast["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cast["w"], np.float32), np.ones((4, 2)))
    # A 64-bit host leaf (a Python number, a numpy array) is read as JAX reads it.
    alpa.save_checkpoint(tmp_path, {"w": np.ones((4, 2)), "n": 3}, 2)
    int32 = PlacementSpec(jax.core.ShapedArray((), jnp.int32), (0,), (None,), (sharding,))
    f32 = dataclasses.replace(bf16, aval=jax.core.ShapedArray((4, 2), jnp.float32))
    back = alpa.restore_checkpoint(tmp_path, 2, {"w": f32, "n": int32})
    assert back["w"].dtype == jnp.float32 and int(back["n"]) == 3


# ---- bad input


def test_missing_directory_and_step_are_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=rf"checkpoint directory {missing} does not"):
        alpa.restore_checkpoint(missing, 1, None)
    alpa.save_checkpoint(tmp_path, {"w": np.zeros(2)}, 5)
    alpa.save_checkpoint(tmp_path, {"w": np.zeros(2)}, 7)
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint of step 6 in .*: the steps there are \[5, 7\]$"
    ):
        alpa.restore_checkpoint(tmp_path, 6, None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint in {empty}$"):
        alpa.restore_checkpoint(empty)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"step=-1 \(int\) must be an int >= 0"):
        alpa.save_checkpoint(tmp_path, {"w": np.zeros(2)}, -1)
    with pytest.raises(ValueError, match=r"step='3' \(str\) must be an int >= 0"):
        alpa.restore_checkpoint(tmp_path, "3", None)
    with pytest.raises(TypeError, match=r"ckpt_dir=3 \(int\) must be a path"):
        alpa.save_checkpoint(3, {"w": np.zeros(2)}, 1)
    with pytest.raises(ValueError, match=r"keep=0 must be None \(keep every step\) or an int"):
        alpa.save_checkpoint(tmp_path, {"w": np.zeros(2)}, 1, keep=0)
    with pytest.raises(TypeError, match=r"leaf 'f' of the checkpoint target is a function"):
        alpa.save_checkpoint(tmp_path, {"f": lambda: 0}, 1)


def _spec(shape):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    aval = jax.core.ShapedArray(shape, np.float32)
    return PlacementSpec(aval, (0,), (None,), (sharding,))


def test_specs_that_do_not_match_the_checkpoint_name_the_leaf(tmp_path):
    alpa.save_checkpoint(tmp_path, {"params": {"w": np.zeros((4, 2)), "b": np.zeros(2)}}, 1)
    with pytest.raises(
        ValueError,
        match=r"placement_specs do not match the structure of the checkpoint .*checkpoint_1: "
        r"leaf 'params/v' of placement_specs is not in the checkpoint; "
        r"leaf 'params/w' of the checkpoint has no placement spec",
    ):
        alpa.restore_checkpoint(tmp_path, 1, {"params": {"v": _spec((4, 2)), "b": _spec((2,))}})
    with pytest.raises(
        ValueError,
        match=r"leaf 'params/w' has shape \(4, 2\) in the checkpoint of step 1, but its "
        r"placement spec expects \(2, 4\)",
    ):
        alpa.restore_checkpoint(tmp_path, 1, {"params": {"w": _spec((2, 4)), "b": _spec((2,))}})
    with pytest.raises(TypeError, match=r"placement spec of leaf 'params/b' is a str"):
        alpa.restore_checkpoint(tmp_path, 1, {"params": {"w": _spec((4, 2)), "b": "x"}})


def test_a_checkpoint_of_a_newer_format_is_refused_by_name(tmp_path):
    """A checkpoint's records carry their layout's version: a newer one is refused with
    the file and both versions named (not called damaged, not read by guesswork); one
    written without the field still restores."""
    saved = killed_save.state(5)
    alpa.save_checkpoint(tmp_path, saved, 3)
    checksums = tmp_path / "checkpoint_3" / "alpa_checksums.json"
    record = json.loads(checksums.read_text())
    assert record["format"] == 1
    checksums.write_text(json.dumps({**record, "format": 2}))
    with pytest.raises(
        NewerFormatError,
        match=r"^the checksum file of step 3 \(.*checkpoint_3/alpa_checksums\.json\) is a "
        r"checksum record of format 2, newer than this alpa reads \(format 1 and older\): "
        r"it was saved by a newer alpa; restore it with that version$",
    ):
        alpa.restore_checkpoint(tmp_path, 3)
    del record["format"]  # as written before the field existed
    checksums.write_text(json.dumps(record))
    restored = alpa.restore_checkpoint(tmp_path, 3)
    np.testing.assert_array_equal(restored["params"]["w"], saved["params"]["w"])
    # The record of which part holds which leaf (Ray meshes' saves), read without verify.
    step = tmp_path / "checkpoint_4"
    step.mkdir()
    (step / "alpa_parts.json").write_text(
        json.dumps({"format": 3, "skeleton": {}, "parts": {}, "avals": {}})
    )
    with pytest.raises(
        NewerFormatError,
        match=r"^the part record of step 4 \(.*checkpoint_4/alpa_parts\.json\) is a checkpoint "
        r"part record of format 3, newer than this alpa reads \(format 1 and older\)",
    ):
        alpa.restore_checkpoint(tmp_path, 4, verify=False)
