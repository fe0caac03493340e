"""DistributedArray: the driver's handle of a value that lives on a Ray mesh's workers.

Its shape, dtype and ``Layout`` (the mesh's logical shape, axis names and the value's
``PartitionSpec``) are known on the driver; its data stays on the workers until
``np.asarray(x)`` (or :func:`prefetch`, many at once) fetches it. Dropping the last handle
frees the buffer on the workers (batched: ``global_config.delete_remote_arrays_threshold``).

Alpa's programs also reach into a ``DistributedArray``: ``x.device_mesh``,
``x.remote_ref`` with ``mesh.get_remote_buffers(ref)`` (every device's block), and
``x.save(ckpt_dir)`` / ``DistributedArray.load(ckpt_dir, aval, mesh, sharding_spec)``,
which write one copy of the value and read it back in another layout (each worker
writes and reads only its devices' blocks, through orbax).

After ``alpa.shutdown()`` (or ``mesh.shutdown()``) every use of an array that lived on
the mesh raises at once (:func:`shut_down_error`).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from alpa.runtime.remote_arrays import RemoteArrayRef, alpa_array_args
from alpa.runtime.worker_program import Layout

if TYPE_CHECKING:
    from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh

#: The folder of ``ckpt_dir`` that ``DistributedArray.save`` writes (an orbax checkpoint).
ARRAY_FOLDER = "distributed_array"


class DistributedArray:
    """A value on a distributed mesh, seen from the driver (see the module docstring).

    Alpa's ``DistributedArray(mesh, aval, sharding_spec, remote_ref, indices)`` (an array
    its workers fill with ``put_buffers``) is accepted too: ``alpa.runtime.remote_arrays``.

    ``np.asarray(x)`` or ``x._value`` fetches it (and keeps the copy: the value never
    changes). A handle exists only once its value is computed (steps on Ray return when
    their workers are done), so ``block_until_ready()`` returns at once.
    """

    def __init__(
        self,
        mesh: DistributedPhysicalDeviceMesh,
        name: str,
        shape: tuple[int, ...],
        dtype: Any,
        layout: Layout,
        weak_type: bool = False,
    ):
        if not isinstance(name, str):  # Alpa's (mesh, aval, sharding_spec, remote_ref, indices)
            name, shape, dtype, layout = alpa_array_args(mesh, name, shape, dtype, layout)
        self.mesh = mesh
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.layout = layout
        self.weak_type = weak_type
        self._fetched: np.ndarray | None = None
        self._deleted = False
        self._finalizer = weakref.finalize(self, mesh.schedule_delete, name)

    #: Read by ``alpa.tracing.abstractify`` and ``alpa.api`` (which do not import Ray).
    is_distributed_array = True

    @property
    def device_mesh(self) -> DistributedPhysicalDeviceMesh:
        """Alpa's name of the mesh the value lives on."""
        return self.mesh

    @property
    def remote_ref(self) -> RemoteArrayRef:
        """Alpa's handle of the buffer (``mesh.get_remote_buffers(x.remote_ref)``)."""
        self._check()
        return RemoteArrayRef(self.mesh, self.name)

    @property
    def aval(self):
        from alpa.jax_internals import ShapedArray  # jax is loaded only when asked

        return ShapedArray(self.shape, self.dtype, weak_type=self.weak_type)

    def save(self, ckpt_dir: str, local_cache_dir: str | None = None) -> None:
        """Alpa's: write one copy of the value under ``ckpt_dir`` (a folder that every
        worker sees at the same path), each worker writing its devices' blocks.
        ``local_cache_dir`` is accepted and unused: the save is done when this returns
        (so ``sync_move_workers`` has nothing to wait for)."""
        self._check()
        del local_cache_dir
        self.mesh.call(
            "save_checkpoint_part", os.path.join(ckpt_dir, ARRAY_FOLDER), [self.name], ["value"]
        )

    @classmethod
    def load(
        cls, path: str, aval: Any, device_mesh: DistributedPhysicalDeviceMesh, sharding_spec: Any
    ) -> DistributedArray:
        """Alpa's: the value ``save`` wrote under ``path``, placed on ``device_mesh`` as
        the jax-0.3 ``sharding_spec`` says (``alpa.pxla_spec``), of ``aval``'s shape and
        dtype; each worker reads only its devices' blocks."""
        import uuid

        from alpa.pxla_spec import tile_layout

        layout = Layout(*tile_layout(aval, None, sharding_spec, device_mesh.num_devices))
        name = uuid.uuid4().hex
        folder = os.path.join(path, ARRAY_FOLDER)
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"DistributedArray.load({path!r}, ...): no array saved there "
                f"(DistributedArray.save writes the folder {ARRAY_FOLDER!r} in it)"
            )
        device_mesh.call(
            "restore_checkpoint_part", folder, [name], ["value"], [layout], [aval.dtype]
        )
        return cls(device_mesh, name, tuple(aval.shape), aval.dtype, layout)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def sharding_spec(self):
        """The ``PartitionSpec`` over the mesh's logical shape ``layout.mesh_shape``."""
        return self.layout.spec

    @property
    def _value(self) -> np.ndarray:
        if self._fetched is None:
            prefetch([self])
        return self._fetched

    def __array__(self, dtype=None, copy=None):
        value = self._value
        return value if dtype is None else value.astype(dtype)

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __format__(self, spec: str) -> str:
        value = self._value
        return format(value[()] if value.ndim == 0 else value, spec)

    def _scalar(self, kind: str):
        """The one element (Alpa's ``float(loss)``, ``'%.4f' % loss``)."""
        if self.size != 1:
            raise TypeError(
                f"only a DistributedArray of one element converts to {kind}; this one has "
                f"shape {self.shape} (use np.asarray(x) for its values)"
            )
        return self._value.reshape(())

    def block_until_ready(self) -> DistributedArray:
        """The array itself: a step returns only once its workers finished it (and
        ``put`` once the data is placed), so a handle's value is always ready."""
        self._check()
        return self

    def delete(self) -> None:
        """Free the buffer on the workers now."""
        if not self._deleted:
            self._deleted = True
            self._finalizer()

    def is_deleted(self) -> bool:
        return self._deleted

    def _mark_donated(self) -> None:
        """The buffer was donated to a step (the workers dropped it)."""
        self._deleted = True
        self._finalizer.detach()

    def _check(self) -> None:
        if self.mesh.is_shut_down:
            raise shut_down_error(
                f"a DistributedArray {self.shape} {self.dtype.name} that lived on mesh "
                f"{self.mesh.mesh_id}",
                self.mesh,
            )
        if self._deleted:
            raise RuntimeError(
                f"DistributedArray {self.name} {self.shape} was deleted or donated to a step"
            )

    def __repr__(self) -> str:
        return (
            f"DistributedArray(shape={self.shape}, dtype={self.dtype}, mesh={self.mesh.mesh_id},"
            f" spec={self.layout.spec} on {self.layout.mesh_shape})"
        )


def shut_down_error(what: str, mesh: DistributedPhysicalDeviceMesh) -> RuntimeError:
    """The error for ``what`` (a value, an executable, the mesh itself) used after ``mesh``
    was shut down: what is gone, and what to do instead."""
    return RuntimeError(
        f"{what} cannot be used: mesh {mesh.mesh_id} ({mesh.num_hosts} hosts x "
        f"{mesh.num_devices_per_host} devices) was shut down (alpa.shutdown() or "
        "mesh.shutdown()), and its workers, their arrays and the programs compiled for "
        "them are gone. After alpa.init(), parallelize the function again (alpa.parallelize, "
        "or alpa.clear_executable_cache()) and re-place values on the new cluster: restore "
        "them from a checkpoint (alpa.restore_checkpoint), or pass host copies taken with "
        "np.asarray(x) before the shutdown."
    )


def prefetch(arrays: Any) -> None:
    """Fetch the ``DistributedArray`` s among the leaves of ``arrays`` (a list, or any
    pytree: a state, a dict of metrics) to the driver in one round per worker (other
    leaves are ignored); ``np.asarray`` of each is then free."""
    import jax

    by_mesh: dict[int, list[DistributedArray]] = {}
    meshes = {}
    for x in jax.tree.leaves(arrays):
        if isinstance(x, DistributedArray) and x._fetched is None:
            x._check()
            by_mesh.setdefault(x.mesh.mesh_id, []).append(x)
            meshes[x.mesh.mesh_id] = x.mesh
    for mesh_id, xs in by_mesh.items():
        mesh = meshes[mesh_id]
        per_worker = mesh.call("fetch", [x.name for x in xs])
        for i, x in enumerate(xs):
            parts = [worker_result[i] for worker_result in per_worker]
            if isinstance(parts[0], np.ndarray):
                x._fetched = parts[0]
                continue
            value = np.empty(x.shape, x.dtype)
            for shards in parts:
                for index, data in shards:
                    value[index] = data
            x._fetched = value
