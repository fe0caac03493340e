"""Checkpoint parts: the arrays one writer holds, saved and read as one orbax checkpoint.

On the local runtime every array of a state is a ``jax.Array`` of this process, and one
orbax save writes them all, each shard from its device. On Ray the arrays live in the
mesh workers' processes, and no process sees all of them; so each mesh writes its own
part (every worker of the mesh takes part, writing the shards its devices hold; the
workers of a mesh that spans hosts are one JAX program, which orbax coordinates), the
driver writes a part with what it holds itself (scalars, strings), and
``alpa.serialization`` commits the step by renaming the directory that holds the parts.

A part is an orbax ``PyTree`` checkpoint of nested dicts, keyed by the leaves' paths
(``params/Dense_0/kernel``). Reading takes any subset of its leaves (orbax's partial
restore), each into a given sharding (every device reads only its slice) or to host.
The same two functions run on the driver and in a ``MeshHostWorker``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def nest(flat: Mapping[str, Any]) -> dict:
    """``{"a/b": x, "a/c": y}`` -> ``{"a": {"b": x, "c": y}}``."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, name = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = value
    return tree


def _lookup(tree: Mapping, path: str) -> Any:
    node: Any = tree
    for key in path.split("/"):
        node = node[key]
    return node


def write_part(directory: str, arrays: Mapping[str, Any]) -> None:
    """Save ``arrays`` (path -> array or string) as an orbax checkpoint at ``directory``;
    a ``jax.Array`` is written shard by shard from the devices that hold it."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(directory, nest(arrays))


def read_part(directory: str, wanted: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Read the leaves ``wanted`` (path -> ``(sharding, dtype)``) of the part at
    ``directory``: into ``sharding`` (a ``jax.sharding.Sharding``; each device reads its
    slice) or, for ``sharding=None``, to a host array; ``dtype=None`` keeps the saved
    dtype. Returns path -> value."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(directory).item_metadata
        if metadata is None:  # orbax answers None for a damaged _METADATA file
            raise ValueError(f"checkpoint part {directory}: its file '_METADATA' is damaged")
        saved = metadata.tree
        items, args = {}, {}
        for path, (sharding, dtype) in wanted.items():
            meta = _lookup(saved, path)
            items[path] = meta
            shape = getattr(meta, "shape", None)
            if sharding is None:
                args[path] = ocp.RestoreArgs(
                    restore_type=np.ndarray if shape is not None else None, dtype=dtype
                )
            else:
                args[path] = ocp.ArrayRestoreArgs(
                    sharding=sharding, global_shape=shape, dtype=dtype
                )
        restored = checkpointer.restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=nest(items), restore_args=nest(args), partial_restore=True
            ),
        )
    return {path: _lookup(restored, path) for path in wanted}


def block(values: Mapping[str, Any]) -> None:
    """Wait until the device arrays among ``values`` are ready."""
    jax.block_until_ready([v for v in values.values() if isinstance(v, jax.Array)])
