"""Checkpoints: save a sharded training state, restore it onto any meshes.

A checkpoint of step ``s`` is the directory ``<ckpt_dir>/checkpoint_<s>`` (Alpa's naming),
written by orbax-checkpoint, the maintained checkpoint library of JAX:

* **What is saved** is ``flax.serialization.to_state_dict(target)``: nested dicts with
  string keys whose leaves are arrays (``params/Dense_0/kernel``). The checkpoint therefore
  does not depend on Python classes; the static fields of a flax ``TrainState``
  (``apply_fn``, ``tx``) are not saved, exactly as flax and Alpa did.
* **Saving writes each shard from where it lives.** A sharded ``jax.Array`` (the output of
  a parallelized step, on one mesh or, for ``PipeshardParallel``, on its stage's submesh)
  is written by tensorstore one shard at a time: each shard (one replica of it) is copied
  from its own device and written as its own chunk, so the chunk shape recorded in the
  checkpoint is the shard shape and no array is ever gathered whole. Leaves on a Ray
  mesh (``DistributedArray``) are the exception: they are fetched to the driver first
  (see "Ray" below).
* **A step is committed atomically, new or re-saved.** Every save writes into a
  directory of its own beside the step (``checkpoint_<s>.alpa-tmp-<id>``), records the
  checksums of what it wrote, and then swaps it in by renames
  (``alpa.checkpoint_files``): a save killed at any point leaves the old or the new step
  complete and readable, never neither, and an unfinished save is never listed by
  :func:`checkpoint_steps`. ``keep=`` deletes older steps only once the new one is
  committed and checked.
* **Checksums.** Every file of a step has its CRC-32 in ``alpa_checksums.json``, per part;
  :func:`restore_checkpoint` checks them first (``verify=True``, the default), so a damaged
  file is an error that names the step, the part and the file, never different values.
* **Restoring reads each shard where it goes.** Every leaf of ``placement_specs`` (a
  :class:`~alpa.executables.base.PlacementSpec`, as ``executable.get_input_placement_specs()``
  returns them) names the sharding the step reads the leaf in, on its first mesh; orbax
  gets that sharding (``ArrayRestoreArgs(sharding=...)``) and each device reads only its
  own slice of the stored array. The saved sharding does not matter: a state saved from
  8 devices restores onto 4, or onto another logical mesh shape. A pipeline's stacked
  parameter split by rows (its spec's ``rows``) is read straight into the sharding over
  its stages' devices where one says where its rows are (``PlacementSpec.rows_layout``),
  as the step returns it. An ``alpa.StackedRows`` (rows no sharding describes) is the
  exception both ways: saved from the host with its rows put together, and restored
  through the host, each row then placed on its stage's mesh.
* **The restored structure** is that of ``placement_specs`` (or of ``target=``): the
  specs of a ``TrainState`` form a ``TrainState`` whose leaves are specs, so a
  ``TrainState`` comes back, with the ``apply_fn`` and ``tx`` of the state the executable
  was compiled for. With neither, the state dict itself comes back.

Ray: no process sees every array of a state on Ray meshes, so such a checkpoint is made
of **parts** (``alpa.runtime.checkpoint_parts``): each mesh's workers write the leaves
that live on it as one orbax checkpoint ``mesh_<id>`` (each worker writing the shards its
devices hold, the workers of a mesh over several hosts coordinated by orbax), the driver
writes what it holds itself (``driver``), and ``alpa_parts.json`` records which part holds
each leaf and the state's structure; the step is committed as above. A save of arrays
whose mesh was shut down raises before anything is written. Restoring reads each leaf from
its part where it goes: a Ray placement's mesh workers read their slices, a local sharding
is read by this process; a checkpoint of either kind restores onto either runtime.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization as flax_serialization

from alpa import checkpoint_files as files
from alpa.checkpoint_files import DamagedCheckpointError
from alpa.runtime.checkpoint_parts import read_part, write_part
from alpa.runtime.placement import PlacementSpec, place
from alpa.saved_format import read_format

PyTree = Any

__all__ = [
    "DamagedCheckpointError",
    "checkpoint_steps",
    "restore_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger("alpa")

#: The record of a checkpoint made of parts (Ray; module docstring).
_PARTS_FILE = "alpa_parts.json"
#: The layout version of that file (``alpa.saved_format``).
PARTS_FORMAT = 1


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    target: PyTree,
    step: int,
    local_cache_dir: str | os.PathLike | None = None,
    *,
    keep: int | None = None,
) -> None:
    """Save the pytree ``target`` (e.g. a ``TrainState`` a parallelized step returned) as
    step ``step`` under ``ckpt_dir``, in ``ckpt_dir/checkpoint_<step>``.

    Args:
      ckpt_dir: the checkpoint directory (created if missing). On a cluster, a file
        system every host sees.
      target: a pytree of ``jax.Array`` (sharded anywhere), ``DistributedArray``,
        ``np.ndarray``, Python or numpy scalars and strings.
      step: the training step, an int >= 0.
      local_cache_dir: accepted for Alpa compatibility and unused: every shard is
        written straight to ``ckpt_dir`` and the step appears atomically, which is what
        Alpa's local cache staged by hand.
      keep: if given, keep only the ``keep`` highest steps (this one included) and
        delete older ones once this save is committed and its files checked. By default
        every step is kept.

    Raises:
      RuntimeError: a leaf is a ``DistributedArray`` of a mesh that was shut down (its
        data is gone); nothing is written.
    """
    directory = _check_dir_arg(ckpt_dir)
    step = _check_step_arg(step)
    if local_cache_dir is not None and not isinstance(local_cache_dir, (str, os.PathLike)):
        raise TypeError(
            f"local_cache_dir={local_cache_dir!r} ({type(local_cache_dir).__name__}) "
            "must be a path or None"
        )
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r} must be None (keep every step) or an int >= 1")
    path = _save(directory, flax_serialization.to_state_dict(target), step)
    if keep is not None:
        files.verify(path, step, contents=False)  # committed and every file there
        files.delete_steps(directory, checkpoint_steps(directory)[:-keep])


def restore_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int | None = None,
    placement_specs: PyTree | None = None,
    *,
    target: PyTree | None = None,
    verify: bool = True,
    cast_dtypes: bool = False,
) -> PyTree:
    """The state saved as ``step`` under ``ckpt_dir``, each leaf placed where
    ``placement_specs`` says.

    Args:
      ckpt_dir: the checkpoint directory given to :func:`save_checkpoint`.
      step: the step to restore; ``None`` restores the highest step there.
      placement_specs: a pytree with the saved state's structure whose leaves are
        ``PlacementSpec`` s (``executable.get_input_placement_specs()[0]`` for a train
        state) or ``jax.sharding.Sharding`` s. Each leaf is read shard by shard into the
        sharding of its first mesh (a ``DistributedArray`` on Ray). ``None``: every leaf
        is restored as a host ``np.ndarray``.
      target: a pytree whose structure the result takes (e.g. a ``TrainState``), in place
        of the structure of ``placement_specs``; its leaves are not read.
      verify: check every file of the step against the checksums its save wrote before
        reading it (one more read of the step's files: +15% on a 1 GiB restore as
        measured in ``docs/checkpoints.md``). ``False`` skips the check of the data, not of the
        metadata, and restores a step whose checksum file is missing (``True`` refuses it).
      cast_dtypes: read a leaf saved in another dtype than its placement spec's into the
        spec's dtype (``float32`` weights into a ``bfloat16`` step); ``False``: such a leaf
        is an error naming it and both dtypes.

    Returns:
      the restored pytree: in the structure of ``target``, else of ``placement_specs``,
      else the saved state dict (nested dicts with string keys).

    Raises:
      DamagedCheckpointError: a file of the step differs from what its save wrote, or
        its metadata cannot be read, or (with ``verify``) its checksum file is missing;
        the message names the step, the part and the file.
    """
    directory = _check_dir_arg(ckpt_dir)
    for name, flag in (("verify", verify), ("cast_dtypes", cast_dtypes)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} ({type(flag).__name__}) must be a bool")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    step = _latest_step(directory) if step is None else _check_step_arg(step)
    path = _step_path(directory, step)
    if files.has_checksums(path):
        files.verify(path, step, contents=verify)
    elif verify:
        raise files.missing_checksums(path, step)
    else:
        logger.warning(
            "checkpoint %s has no %s: restored without checking its files (verify=False)",
            path,
            files.CHECKSUMS_FILE,
        )
    if not verify and not os.path.exists(os.path.join(path, _PARTS_FILE)):
        # Unchecked: orbax still must not meet a damaged metadata file, which it reports
        # as a missing tree (and leaves a callback on a closed event loop). Its JSON
        # files and its database's manifest and tree are read first (no values).
        damage = files.find_damage(path, step, files.WHOLE_STATE, path, read_values=False)
        if damage is not None:
            raise damage
    if os.path.exists(os.path.join(path, _PARTS_FILE)):
        return _restore_parts(path, step, placement_specs, target, cast_dtypes)
    return _restore(path, step, placement_specs, target, cast_dtypes)


def checkpoint_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps committed under ``ckpt_dir``, in increasing order (an unfinished save,
    e.g. one killed midway, is not listed; a step whose re-save was killed is listed as
    its old copy)."""
    return sorted(files.step_dirs(_check_dir_arg(ckpt_dir)))


# ---------------------------------------------------------------------------------------
# Argument checks and step directories
# ---------------------------------------------------------------------------------------


def _check_dir_arg(ckpt_dir: Any) -> str:
    if not isinstance(ckpt_dir, (str, os.PathLike)):
        raise TypeError(f"ckpt_dir={ckpt_dir!r} ({type(ckpt_dir).__name__}) must be a path")
    # orbax wants absolute paths; resolve now so error messages show the real place.
    return os.path.abspath(os.fspath(ckpt_dir))


def _check_step_arg(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r} ({type(step).__name__}) must be an int >= 0")
    return int(step)


def _latest_step(directory: str) -> int:
    steps = checkpoint_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}{_unfinished_note(directory, None)}")
    return steps[-1]


def _step_path(directory: str, step: int) -> str:
    """The directory of a complete save of ``step``, or a ``FileNotFoundError`` that names
    the steps there are."""
    steps = files.step_dirs(directory)
    if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint of step {step} in {directory}: the steps there are "
            f"{sorted(steps)}{_unfinished_note(directory, step)}"
        )
    return steps[step]


def _unfinished_note(directory: str, step: int | None) -> str:
    """A note on what unfinished saves of ``step`` (any step when ``None``) left, which
    is what a save killed midway leaves."""
    unfinished = files.unfinished(directory, step)
    if not unfinished:
        return ""
    return f" ({', '.join(unfinished)}: a save that did not finish, e.g. killed midway)"


def _leaf_paths(tree: PyTree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of a state dict, paths written ``params/Dense_0/kernel``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(str(key.key) for key in path), leaf) for path, leaf in flat]


# ---------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------


def _save(directory: str, state_dict: PyTree, step: int) -> str:
    """Write the step beside the old one, seal it with its checksums, swap it in
    (``alpa.checkpoint_files``); the committed step's path."""
    leaves, tree = jax.tree.flatten(state_dict)
    paths = [path for path, _ in _leaf_paths(state_dict)]
    on_ray = [x for x in leaves if getattr(x, "is_distributed_array", False)]
    for x in on_ray:
        x._check()  # a mesh shut down: raise before anything is written
    if not on_ray:
        items = jax.tree.unflatten(
            tree, [_savable(x, path) for x, path in zip(leaves, paths, strict=True)]
        )
    os.makedirs(directory, exist_ok=True)
    files.recover(directory, step)
    staging = files.staging_dir(directory, step)
    if on_ray:
        parts = _save_parts(staging, jax.tree.unflatten(tree, paths), paths, leaves)
    else:
        parts = []
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(staging, items)
    files.seal(staging, parts)
    return files.commit(staging, directory, step)


def _savable(x: Any, path: str) -> Any:
    """A leaf as orbax writes it: ``jax.Array`` s as they are (shard by shard), Ray arrays,
    scalars and a pipeline's ``StackedRows`` (rows on several meshes) as host arrays."""
    if isinstance(x, (jax.Array, np.ndarray, str)):
        return x
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return np.asarray(x)
    if getattr(x, "is_stacked_rows", False):  # a pipeline's rows on several meshes
        return np.asarray(x)
    raise TypeError(
        f"leaf {path!r} of the checkpoint target is a {type(x).__name__}; expected an "
        "array (jax.Array, DistributedArray, np.ndarray), a scalar or a string"
    )


# ---------------------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------------------


def _restore(path: str, step: int, placement_specs: PyTree, target: PyTree, cast: bool) -> PyTree:
    with ocp.PyTreeCheckpointer() as checkpointer:
        saved = _saved_tree(checkpointer, path, step)
        saved_leaves, saved_tree = jax.tree.flatten(saved)
        saved_paths = [p for p, _ in _leaf_paths(saved)]
        if placement_specs is None:
            specs = [None] * len(saved_paths)
        else:
            specs = _specs_by_saved_leaf(placement_specs, saved_paths, path)
        args = [
            _restore_args(spec, meta, leaf_path, step, cast)
            for spec, meta, leaf_path in zip(specs, saved_leaves, saved_paths, strict=True)
        ]
        try:
            restored = checkpointer.restore(
                path,
                args=ocp.args.PyTreeRestore(restore_args=jax.tree.unflatten(saved_tree, args)),
            )
        except (OSError, ValueError) as e:  # tensorstore's error for a file it cannot decode
            damage = files.find_damage(path, step, files.WHOLE_STATE, path)
            if damage is None:
                raise
            raise damage from e
    values = jax.tree.leaves(restored)
    # Ray placements and StackedRows leaves were read on the driver: placed now.
    values = [
        place(x, spec) if _is_ray_spec(spec) or _rows_on_host(spec) else x
        for x, spec in zip(values, specs, strict=True)
    ]
    restored = jax.tree.unflatten(jax.tree.structure(restored), values)
    structure = target if target is not None else placement_specs
    if structure is None:
        return restored
    return flax_serialization.from_state_dict(structure, restored)


def _saved_tree(checkpointer: Any, path: str, step: int) -> PyTree:
    """The saved tree of orbax's metadata, or an error naming the file when it is damaged
    (orbax itself answers ``None`` and fails later on ``None.tree``)."""
    try:
        metadata = checkpointer.metadata(path).item_metadata
        if metadata is None:
            raise ValueError("orbax finds no tree metadata in it")
        return metadata.tree
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        # orbax's metadata reads _METADATA, _sharding and the OCDBT database's files:
        # the one at fault is named, by its checksum or by reading each.
        damage = files.find_damage(path, step, files.WHOLE_STATE, path)
        if damage is None:
            damage = files.damaged_metadata(path, step, files.WHOLE_STATE, "_METADATA", e)
        raise damage from e


def _specs_by_saved_leaf(placement_specs: PyTree, saved_paths: list[str], path: str) -> list:
    """The leaves of ``placement_specs`` in the order of the saved leaves, after checking
    that both hold the same leaves."""
    given = dict(_leaf_paths(flax_serialization.to_state_dict(placement_specs)))
    saved = set(saved_paths)
    missing = [p for p in saved_paths if p not in given]
    extra = [p for p in given if p not in saved]
    if missing or extra:
        problems = []
        if extra:
            problems.append(f"leaf {extra[0]!r} of placement_specs is not in the checkpoint")
        if missing:
            problems.append(f"leaf {missing[0]!r} of the checkpoint has no placement spec")
        raise ValueError(
            f"placement_specs do not match the structure of the checkpoint {path}: "
            + "; ".join(problems)
        )
    return [given[p] for p in saved_paths]


def _is_ray_spec(spec: Any) -> bool:
    """Whether ``spec`` places on a Ray mesh (a ``(mesh, Layout)`` pair, not a sharding)."""
    return (
        isinstance(spec, PlacementSpec)
        and bool(spec.placements)
        and (isinstance(spec.placements[0], tuple))
    )


def _rows_on_host(spec: Any) -> bool:
    """Whether ``spec`` places a leaf split by rows that no one sharding describes (a
    ``StackedRows``: read on the host, then placed part by part)."""
    return bool(getattr(spec, "rows", ())) and spec.rows_layout.joined is None


def _check_spec(spec: Any, leaf_path: str, saved_shape: Any, step: int) -> None:
    """``spec`` must be a ``PlacementSpec`` of the saved leaf's shape that a mesh holds."""
    if not isinstance(spec, PlacementSpec):
        raise TypeError(
            f"placement spec of leaf {leaf_path!r} is a {type(spec).__name__}; expected a "
            "PlacementSpec (executable.get_input_placement_specs()) or a jax.sharding.Sharding"
        )
    if saved_shape is None or tuple(saved_shape) != tuple(spec.aval.shape):
        raise ValueError(
            f"leaf {leaf_path!r} has shape {saved_shape} in the checkpoint of step {step}, "
            f"but its placement spec expects {tuple(spec.aval.shape)}"
        )
    if not spec.placements:
        raise ValueError(f"leaf {leaf_path!r}: no mesh holds it in its placement spec")


def _check_dtype(spec: Any, saved_dtype: Any, leaf_path: str, step: int, cast: bool) -> None:
    """A leaf is read in its spec's dtype: another saved dtype is a silent cast, which
    the caller must ask for. A 64-bit leaf read as JAX reads it (``int64`` as ``int32``
    without ``jax_enable_x64``: a Python or numpy scalar saved, a host array) is not a
    cast of the caller's making."""
    if cast or saved_dtype is None or not isinstance(spec, PlacementSpec):
        return
    saved, wanted = np.dtype(saved_dtype), np.dtype(spec.aval.dtype)
    if saved != wanted and np.dtype(jax.dtypes.canonicalize_dtype(saved)) != wanted:
        raise ValueError(
            f"leaf {leaf_path!r} is {saved.name} in the checkpoint of step {step}, but its "
            f"placement spec expects {wanted.name}: restoring would cast it. Pass "
            "cast_dtypes=True to restore_checkpoint to cast it, or placement specs of an "
            f"executable compiled for {saved.name}"
        )


def _restore_args(spec: Any, meta: Any, leaf_path: str, step: int, cast: bool) -> Any:
    """orbax's restore arguments for one saved leaf (``meta``, its metadata) read into
    ``spec``."""
    saved_shape = getattr(meta, "shape", None)
    if spec is None:
        # Arrays to host numpy; a string stays a string.
        return ocp.RestoreArgs(restore_type=np.ndarray if saved_shape is not None else None)
    if isinstance(spec, jax.sharding.Sharding):
        return ocp.ArrayRestoreArgs(sharding=spec, global_shape=saved_shape)
    _check_spec(spec, leaf_path, saved_shape, step)
    _check_dtype(spec, getattr(meta, "dtype", None), leaf_path, step, cast)
    if _is_ray_spec(spec) or _rows_on_host(spec):  # read on the driver, then placed
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=spec.aval.dtype)
    return ocp.ArrayRestoreArgs(
        sharding=_sharding_of(spec), global_shape=saved_shape, dtype=spec.aval.dtype
    )


def _sharding_of(spec: PlacementSpec) -> jax.sharding.Sharding:
    """The sharding a leaf is read into: its first mesh's, or for a leaf split by rows
    the one over its stages' devices."""
    return spec.rows_layout.joined if spec.rows else spec.placements[0]


# ---------------------------------------------------------------------------------------
# Checkpoints made of parts (Ray)
# ---------------------------------------------------------------------------------------


def _save_parts(staging: str, skeleton: PyTree, paths: list, leaves: list) -> list[str]:
    """Each Ray mesh writes its leaves into ``staging``, the driver the rest (module
    docstring); the names of the parts."""
    from alpa.runtime.ray_mesh import wait_workers

    os.makedirs(staging)
    meshes: dict[int, tuple[Any, list, list]] = {}
    on_driver, parts, avals = {}, {}, {}
    for path, x in zip(paths, leaves, strict=True):
        if getattr(x, "is_distributed_array", False):
            _, names, mesh_paths = meshes.setdefault(x.mesh.mesh_id, (x.mesh, [], []))
            names.append(x.name)
            mesh_paths.append(path)
            parts[path] = f"mesh_{x.mesh.mesh_id}"
            avals[path] = [list(x.shape), np.dtype(x.dtype).name]
        else:
            on_driver[path] = _savable(x, path)
            parts[path] = "driver"
    calls = []  # every mesh writes at once
    for mesh_id, (mesh, names, mesh_paths) in meshes.items():
        part = os.path.join(staging, f"mesh_{mesh_id}")
        calls += [
            (worker.save_checkpoint_part.remote(part, names, mesh_paths), mesh.label(host))
            for host, worker in enumerate(mesh.workers)
        ]
    wait_workers(calls)
    if on_driver:
        write_part(os.path.join(staging, "driver"), on_driver)
    record = {"format": PARTS_FORMAT, "skeleton": skeleton, "parts": parts, "avals": avals}
    with open(os.path.join(staging, _PARTS_FILE), "w") as f:
        json.dump(record, f)
    return sorted(set(parts.values()))


def _restore_parts(
    path: str, step: int, placement_specs: PyTree, target: PyTree, cast: bool
) -> PyTree:
    """Each leaf read from its part where its spec places it (module docstring)."""
    from alpa.runtime.ray_mesh import DistributedArray, wait_workers

    try:
        with open(os.path.join(path, _PARTS_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise files.damaged_metadata(path, step, "record", _PARTS_FILE, e) from e
    if isinstance(record, dict):  # a newer alpa's record is refused, not called damaged
        source = f"the part record of step {step} ({os.path.join(path, _PARTS_FILE)})"
        read_format(
            record, PARTS_FORMAT, "checkpoint part record", source, "restore it with that version"
        )
    try:
        skeleton, parts = record["skeleton"], record["parts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise files.damaged_metadata(path, step, "record", _PARTS_FILE, e) from e
    saved_paths = jax.tree.leaves(skeleton)
    if placement_specs is None:
        specs = [None] * len(saved_paths)
    else:
        specs = _specs_by_saved_leaf(placement_specs, saved_paths, path)
    values: dict[str, Any] = {}
    local: dict[str, dict] = {}  # part -> leaves this process reads
    remote: dict[tuple[int, str], tuple[Any, list]] = {}  # (mesh, part) -> leaves
    by_rows: dict[str, Any] = {}  # leaves split by rows: read here, placed row by row
    for leaf_path, spec in zip(saved_paths, specs, strict=True):
        part = parts[leaf_path]
        if spec is None or isinstance(spec, jax.sharding.Sharding):
            local.setdefault(part, {})[leaf_path] = (spec, None)
            continue
        recorded = record["avals"].get(leaf_path)  # a leaf the driver wrote has none
        _check_dtype(spec, recorded[1] if recorded else None, leaf_path, step, cast)
        if _rows_on_host(spec):
            local.setdefault(part, {})[leaf_path] = (None, spec.aval.dtype)
            by_rows[leaf_path] = spec
            continue
        aval = getattr(spec, "aval", None)
        saved_shape = recorded[0] if recorded else getattr(aval, "shape", None)
        _check_spec(spec, leaf_path, saved_shape, step)
        if _is_ray_spec(spec):
            mesh, layout = spec.placements[0]
            remote.setdefault((mesh.mesh_id, part), (mesh, []))[1].append((leaf_path, spec))
        else:
            local.setdefault(part, {})[leaf_path] = (_sharding_of(spec), spec.aval.dtype)
    calls, made = [], []
    for mesh, _ in remote.values():
        mesh._check_alive()  # specs of an executable compiled for a cluster shut down
    for (_, part), (mesh, leaves) in remote.items():
        names = [uuid.uuid4().hex for _ in leaves]
        layouts = [spec.placements[0][1] for _, spec in leaves]
        dtypes = [np.dtype(spec.aval.dtype) for _, spec in leaves]
        args = (os.path.join(path, part), names, [p for p, _ in leaves], layouts, dtypes)
        calls += [
            (worker.restore_checkpoint_part.remote(*args), mesh.label(host))
            for host, worker in enumerate(mesh.workers)
        ]
        made += [(mesh, name, leaf) for name, leaf in zip(names, leaves, strict=True)]
    wait_workers(calls)  # every mesh reads at once
    for mesh, name, (leaf_path, spec) in made:
        aval = spec.aval
        values[leaf_path] = DistributedArray(
            mesh, name, aval.shape, aval.dtype, spec.placements[0][1], bool(aval.weak_type)
        )
    for part, wanted in local.items():
        values.update(read_part(os.path.join(path, part), wanted))
    for leaf_path, spec in by_rows.items():
        _check_spec(spec, leaf_path, np.shape(values[leaf_path]), step)
        values[leaf_path] = place(values[leaf_path], spec)
    restored = jax.tree.map(lambda leaf_path: values[leaf_path], skeleton)
    structure = target if target is not None else placement_specs
    if structure is None:
        return restored
    return flax_serialization.from_state_dict(structure, restored)
