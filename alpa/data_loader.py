"""Data loaders: batches that arrive on the devices already placed as the step reads them.

A parallelized step reads each batch leaf in the sharding its plan chose
(``executable.get_input_placement_specs()``). A batch handed over as numpy arrays is
placed by the step itself, on its critical path. A loader places it before the step asks:

* :class:`DataLoader` reads whole batches from an iterator on the driver and places each
  leaf with :func:`alpa.executables.base.place`, so the step's cache hit takes it as it is.
* :class:`MeshDriverDataLoader` reads only rows: each host calls
  ``input_iter_func(start, end, batch_size)`` for the rows its devices hold, and every
  device receives only its own rows (its shard), never the whole batch.

**Prefetching** keeps ``prefetch_size`` batches read and placed beyond the one being
returned. It is a queue, not a thread. On the local runtime ``jax.device_put`` and the
step's dispatch both return before the devices are done, so by the time the user's step
for batch ``k`` is dispatched, the transfers of batches ``k+1 .. k+prefetch_size`` are
already issued and run beside it, and reading the next batch on the host overlaps with
the devices computing. A background thread would only add overlap for the Python work of
reading, at the price of a lifecycle (stopping it when the loader is dropped, handing its
exceptions over) and of racing the step's own dispatch for the GIL. Without one, the order
of everything is the order of the user's ``next`` calls, which is what makes two
guarantees simple: after the first ``next``, at most ``1 + prefetch_size`` batches have
been pulled from the input; and an exception raised while reading batch ``k`` is kept in
the queue at position ``k`` and raised by the ``next`` that would have returned batch
``k`` (batches before it are returned first), after which the iterator is exhausted.

**Which rows each host reads** (:class:`MeshDriverDataLoader`). An epoch is
``num_batches = num_samples // batch_size`` batches (the last partial batch is dropped, as
in Alpa). A host whose devices hold rows ``[r0, r1)`` of every batch reads the block
``[r0 * num_batches, r1 * num_batches)`` of the samples in batches of ``r1 - r0`` rows, so
row ``r`` of batch ``k`` is sample ``r0 * num_batches + k * (r1 - r0) + (r - r0)``: every
sample is read once per epoch, each host reads one contiguous range, and with a single
host (the local runtime) the batches are exactly those of
``input_iter_func(0, num_batches * batch_size, batch_size)``. Hosts whose ranges overlap
without being equal (rows sharded over a within-host mesh axis first) read their union.
On the local runtime every device then receives only its rows
(``jax.make_array_from_single_device_arrays`` from per-device pieces).

**Ray.** :class:`MeshDriverDataLoader` reads on the mesh workers, as Alpa's does: each
worker calls ``input_iter_func`` for the rows its devices hold (of the leaves on its
mesh) and makes its devices' shards of the batch from them, so the data never passes
through the driver, which only receives a handle per leaf. :class:`DataLoader` places
whole batches from the driver (``DistributedPhysicalDeviceMesh.put``). On Ray a batch is
made when the workers hold it, so prefetching reads ahead but does not overlap the
transfers with the step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from alpa.pxla_spec import is_sharding_spec, tile_layout
from alpa.runtime.placement import PlacementSpec, place

__all__ = ["DataLoader", "MeshDriverDataLoader"]


# ----------------------------------------------------------------------------- prefetch


class _Prefetcher:
    """An iterator over ``produce`` that keeps ``ahead`` produced items beyond the one it
    returns. An exception of ``produce`` takes the place of the item it failed to make
    and is raised when that item is asked for (see the module docstring)."""

    def __init__(self, produce: Iterator[Any], ahead: int):
        self._produce: Iterator[Any] | None = produce
        self._ahead = ahead
        self._queue: collections.deque[tuple[Any, BaseException | None]] = collections.deque()

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        while self._produce is not None and len(self._queue) <= self._ahead:
            try:
                self._queue.append((next(self._produce), None))
            except StopIteration:
                self._produce = None
            except Exception as error:  # raised in order, by the `next` that reaches it
                self._queue.append((None, error))
                self._produce = None
        if not self._queue:
            raise StopIteration
        item, error = self._queue.popleft()
        if error is not None:
            raise error
        return item

    def close(self) -> None:
        """Drop the prefetched items (and their device buffers); the iterator is done."""
        self._queue.clear()
        if hasattr(self._produce, "close"):
            self._produce.close()
        self._produce = None


# ----------------------------------------------------------------------------- validation


def _spec_leaves(placement_specs: Any) -> tuple[list[str], list[PlacementSpec], Any]:
    """Names (``['x']``), specs and tree of the ``PlacementSpec`` leaves, after checking
    that every leaf is one that some mesh holds."""
    with_path, tree = jax.tree_util.tree_flatten_with_path(placement_specs)
    if not with_path:
        raise ValueError("placement_specs holds no PlacementSpec: there is nothing to load")
    names, specs = [], []
    for path, spec in with_path:
        name = jax.tree_util.keystr(path) or "<root>"
        if not isinstance(spec, PlacementSpec):
            raise TypeError(
                f"placement_specs leaf {name} is a {type(spec).__name__}, expected an "
                "alpa.executables.base.PlacementSpec (executable.get_input_placement_specs() "
                "gives them, one per argument leaf)"
            )
        if not spec.placements:
            spec = _resolved(name, spec)
        names.append(name)
        specs.append(spec)
    return names, specs, tree


def _resolved(name: str, spec: PlacementSpec) -> PlacementSpec:
    """A spec as Alpa's programs write it, ``PlacementSpec(aval, mesh_ids,
    sharding_specs)`` with jax-0.3 ``ShardingSpec`` s (``alpa.pxla_spec``) or local
    ``jax.sharding.Sharding`` s, with its placements on the meshes of ``alpa.init``."""
    from alpa.cluster import mesh_by_id

    if not spec.mesh_ids:
        raise ValueError(
            f"placement_specs leaf {name} ({spec.aval}) is held by no mesh (mesh_ids=()), so "
            "it cannot be placed"
        )
    placements = []
    for mesh_id, sharding in zip(spec.mesh_ids, spec.sharding_specs, strict=True):
        if isinstance(sharding, jax.sharding.Sharding):
            placements.append(sharding)
            continue
        if not is_sharding_spec(sharding):
            raise TypeError(
                f"placement_specs leaf {name}: sharding_specs holds {sharding!r} "
                f"({type(sharding).__name__}); a PlacementSpec made by hand takes a "
                "ShardingSpec per mesh (LogicalDeviceMesh.make_tile_spec), or a "
                "jax.sharding.Sharding on the local runtime"
            )
        mesh = mesh_by_id(mesh_id)
        layout = tile_layout(spec.aval, None, sharding, mesh.num_devices)
        placements.append(mesh.tile_placement(*layout))
    return dataclasses.replace(spec, placements=tuple(placements))


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _batch_leaves(batch: Any, tree: Any, names: list[str], what: str) -> tuple[list, Any]:
    """The leaves of ``batch`` in the order of the specs: ``batch`` has the specs'
    structure, or is a flat list/tuple of their leaves (Alpa's convention)."""
    leaves, batch_tree = jax.tree.flatten(batch)
    if batch_tree != tree and not (
        isinstance(batch, list | tuple) and len(batch) == len(leaves) == len(names)
    ):
        raise ValueError(
            f"{what} has structure {batch_tree}, expected that of placement_specs {tree} "
            f"(or a list of its {len(names)} leaves)"
        )
    return leaves, batch_tree


def _check_leaf(name: str, x: Any, spec: PlacementSpec, rows: int | None, what: str) -> None:
    """``x`` must have the spec's trailing shape and dtype; ``rows`` rows when given,
    else a multiple of the spec's (a pipeshard spec holds one micro-batch's rows)."""
    shape, dtype = np.shape(x), jax.dtypes.canonicalize_dtype(np.result_type(x))
    want = tuple(spec.aval.shape)
    if rows is not None:
        ok = shape == (rows, *want[1:])
        expected = f"{(rows, *want[1:])}"
    elif not want:
        ok, expected = shape == (), "()"
    else:
        ok = len(shape) == len(want) and shape[1:] == want[1:] and shape[0] % want[0] == 0
        expected = f"{want} (or a multiple of {want[0]} rows)"
    if not ok:
        raise ValueError(f"{what} leaf {name} has shape {shape}, expected {expected}")
    if dtype != spec.aval.dtype:
        raise ValueError(f"{what} leaf {name} has dtype {dtype}, expected {spec.aval.dtype}")


# ----------------------------------------------------------------------------- DataLoader


class DataLoader:
    """Batches of ``input_iter`` placed where the step reads them, ``prefetch_size``
    batches ahead (see the module docstring).

    Args:
      input_iter: an iterator (or iterable) of batches, each a pytree like
        ``placement_specs`` (or a list of its leaves) of host arrays with the full batch.
      placement_specs: a pytree of ``PlacementSpec``, e.g.
        ``executable.get_input_placement_specs()[1]`` for ``train_step(state, batch)``.
      prefetch_size: batches placed beyond the one returned (0: none).

    Iterating yields the batches, with every leaf placed on its first mesh
    (:func:`alpa.executables.base.place`). The loader is its own iterator: iterating it again
    continues where it stopped. ``close()`` drops the prefetched batches.
    """

    def __init__(self, input_iter: Iterable[Any], placement_specs: Any, prefetch_size: int = 1):
        self.prefetch_size = _check_count("prefetch_size", prefetch_size, 0)
        self._names, self._specs, self._tree = _spec_leaves(placement_specs)
        try:
            batches = iter(input_iter)
        except TypeError:
            raise TypeError(
                f"input_iter must be an iterator of batches, got {type(input_iter).__name__}"
            ) from None
        self._batches = _Prefetcher(self._placed(batches), self.prefetch_size)

    def _placed(self, batches: Iterator[Any]) -> Iterator[Any]:
        for index, batch in enumerate(batches):
            what = f"batch {index} of input_iter"
            leaves, tree = _batch_leaves(batch, self._tree, self._names, what)
            for name, x, spec in zip(self._names, leaves, self._specs, strict=True):
                _check_leaf(name, x, spec, None, what)
            placed = [place(x, spec) for x, spec in zip(leaves, self._specs, strict=True)]
            yield jax.tree.unflatten(tree, placed)

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        self._batches.close()


# ----------------------------------------------------------------------------- mesh reads


@dataclass(frozen=True)
class _Read:
    """Rows ``[start, stop)`` of every batch, read by the hosts whose devices hold them."""

    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class _Piece:
    """One device's shard of a leaf: ``device``, the read holding its rows, and its index
    into that read's rows (dim 0 relative to the read's start)."""

    device: Any
    read: int
    index: tuple[slice, ...]


def _local_row_slices(name: str, spec: PlacementSpec, shape: tuple[int, ...]):
    """Per device of a local placement: (host, device, index into the full batch)."""
    sharding = spec.placements[0]
    try:
        sharding.shard_shape(shape)
    except ValueError as error:
        raise ValueError(
            f"batch_size={shape[0]} does not split evenly over the devices that leaf {name} "
            f"is sharded on ({spec.sharding_specs[0]}): {error}"
        ) from None
    return [
        (device.process_index, device, tuple(index))
        for device, index in sharding.devices_indices_map(shape).items()
    ]


def _layout_row_slices(name: str, spec: PlacementSpec, shape: tuple[int, ...]):
    """Per device of a Ray placement ``(mesh, Layout)``: (host, flat device id, index).
    Logical device ``i`` of the layout's mesh is ``devices[i]`` in row-major order, host
    ``i // num_devices_per_host`` (``alpa.device_mesh.make_jax_mesh``)."""
    mesh, layout = spec.placements[0]
    sizes = dict(zip(layout.axis_names, layout.mesh_shape, strict=True))
    entry = layout.spec[0] if len(layout.spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    blocks = math.prod(sizes[a] for a in axes)
    if shape[0] % blocks:
        raise ValueError(
            f"batch_size={shape[0]} does not split evenly over the {blocks} row blocks that "
            f"leaf {name} is sharded into ({layout.spec})"
        )
    height = shape[0] // blocks
    out = []
    for flat in range(math.prod(layout.mesh_shape)):
        coords = dict(
            zip(layout.axis_names, np.unravel_index(flat, layout.mesh_shape), strict=True)
        )
        block = 0
        for a in axes:
            block = block * sizes[a] + int(coords[a])
        rows = slice(block * height, (block + 1) * height)
        out.append((flat // mesh.num_devices_per_host, flat, (rows,)))
    return out


def _rows(index: tuple[slice, ...], num_rows: int) -> tuple[int, int]:
    start, stop, _ = index[0].indices(num_rows) if index else (0, num_rows, 1)
    return start, stop


def _plan_reads(
    names: list[str], specs: list[PlacementSpec], batch_size: int
) -> tuple[list[_Read], list[list[_Piece]]]:
    """The distinct row ranges the hosts read, and per leaf its per-device pieces."""
    host_rows: dict[Any, tuple[int, int]] = {}
    slices = []
    for name, spec in zip(names, specs, strict=True):
        if not spec.aval.shape:
            raise ValueError(
                f"placement_specs leaf {name} is a scalar ({spec.aval}): MeshDriverDataLoader "
                "splits every leaf into rows along its dimension 0"
            )
        if batch_size % spec.aval.shape[0]:
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of {spec.aval.shape[0]}, the rows "
                f"of leaf {name} ({spec.aval})"
            )
        shape = (batch_size, *spec.aval.shape[1:])
        ray = isinstance(spec.placements[0], tuple)
        per_device = (_layout_row_slices if ray else _local_row_slices)(name, spec, shape)
        per_device = [
            ((id(spec.placements[0][0]), h) if ray else h, d, i) for h, d, i in per_device
        ]
        for host, _, index in per_device:
            start, stop = _rows(index, batch_size)
            lo, hi = host_rows.get(host, (start, stop))
            host_rows[host] = (min(lo, start), max(hi, stop))
        slices.append(per_device)
    # Hosts whose row ranges overlap (a batch dim sharded over a minor mesh axis first)
    # read their union, so that every sample keeps one place in the epoch.
    reads: list[_Read] = []
    for start, stop in sorted(set(host_rows.values())):
        if reads and start < reads[-1].stop:
            reads[-1] = _Read(reads[-1].start, max(stop, reads[-1].stop))
        else:
            reads.append(_Read(start, stop))
    read_of = {
        host: next(i for i, r in enumerate(reads) if r.start <= lo and hi <= r.stop)
        for host, (lo, hi) in host_rows.items()
    }
    pieces = []
    for per_device in slices:
        leaf_pieces = []
        for host, device, index in per_device:
            read = read_of[host]
            start, stop = _rows(index, batch_size)
            local = slice(start - reads[read].start, stop - reads[read].start)
            leaf_pieces.append(_Piece(device, read, (local, *index[1:])))
        pieces.append(leaf_pieces)
    return reads, pieces


def _plan_mesh_reads(names: list[str], specs: list[PlacementSpec], batch_size: int) -> list:
    """On Ray, per mesh that holds batch leaves: ``(mesh, leaf indices, [(lo, hi) per
    host])``, the rows each host reads: those its devices hold of those leaves, or the
    union with another host's where they overlap."""
    groups: dict[int, tuple[Any, list[int], dict[int, tuple[int, int]]]] = {}
    for j, (name, spec) in enumerate(zip(names, specs, strict=True)):
        mesh = spec.placements[0][0]
        _, leaves, hosts = groups.setdefault(id(mesh), (mesh, [], {}))
        leaves.append(j)
        shape = (batch_size, *spec.aval.shape[1:])
        for host, _, index in _layout_row_slices(name, spec, shape):
            lo, hi = _rows(index, batch_size)
            old = hosts.get(host, (lo, hi))
            hosts[host] = (min(old[0], lo), max(old[1], hi))
    out = []
    for mesh, leaves, hosts in groups.values():
        # Hosts whose rows overlap read their union, as in _plan_reads, so that a row
        # always comes from the same sample whichever host reads it.
        merged: list[list[int]] = []
        for lo, hi in sorted(set(hosts.values())):
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(hi, merged[-1][1])
            else:
                merged.append([lo, hi])
        ranges = []
        for h in range(mesh.num_hosts):
            lo, hi = hosts[h]
            ranges.append(next((a, b) for a, b in merged if a <= lo and hi <= b))
        out.append((mesh, leaves, ranges))
    return out


@dataclass(frozen=True)
class _HostRead:
    """What a mesh worker calls to read its host's rows (pickled to it): the user's
    ``input_iter_func``, each batch checked and flattened in the order of the specs."""

    input_iter_func: Callable[[int, int, int], Iterable[Any]]
    tree: Any
    names: tuple[str, ...]
    specs: tuple[PlacementSpec, ...]  # avals only: a mesh does not travel

    def __call__(self, start: int, end: int, rows: int) -> Iterator[list[np.ndarray]]:
        call = f"input_iter_func({start}, {end}, {rows})"
        for k, batch in enumerate(self.input_iter_func(start, end, rows)):
            what = f"batch {k} of {call}"
            leaves, _ = _batch_leaves(batch, self.tree, list(self.names), what)
            for name, x, spec in zip(self.names, leaves, self.specs, strict=True):
                _check_leaf(name, x, spec, rows, what)
            yield [np.asarray(x) for x in leaves]


# ----------------------------------------------------------------------------- MeshDriverDataLoader


class MeshDriverDataLoader:
    """Batches read host by host with ``input_iter_func`` and assembled on the devices
    (see the module docstring for which rows each host reads).

    Args:
      batch_size: rows of a (global) batch.
      num_samples: samples in the dataset; an epoch is ``num_samples // batch_size``
        batches.
      input_iter_func: ``input_iter_func(start, end, batch_size)`` returns an iterator
        over samples ``[start, end)``, ``batch_size`` rows at a time, each batch a pytree
        like ``placement_specs`` (or a list of its leaves) of host arrays.
      placement_specs: a pytree of ``PlacementSpec`` of batch leaves (row dimension 0).
      prefetch_size: batches placed beyond the one returned.
      repeat: loop over epochs forever instead of stopping after one.

    Each ``iter(loader)`` starts an epoch (calling ``input_iter_func`` again) and yields,
    per batch, the list of its leaves in the order of ``jax.tree.leaves(placement_specs)``
    (Alpa's: its examples read ``x[0]``, ``x[1]``; ``jax.tree.unflatten(
    jax.tree.structure(placement_specs), x)`` rebuilds the batch). On the local runtime
    every device receives only its rows, and the global array is made from the
    per-device pieces. On Ray each mesh worker calls ``input_iter_func`` for its
    host's rows and builds its devices' shards itself (``input_iter_func`` is pickled to
    the workers); a failed read there is a ``RuntimeError`` naming the mesh and host.
    """

    def __init__(
        self,
        batch_size: int,
        num_samples: int,
        input_iter_func: Callable[[int, int, int], Iterable[Any]],
        placement_specs: Any,
        prefetch_size: int = 1,
        repeat: bool = False,
    ):
        self.batch_size = _check_count("batch_size", batch_size, 1)
        num_samples = _check_count("num_samples", num_samples, 0)
        if num_samples < self.batch_size:
            raise ValueError(
                f"num_samples={num_samples} is less than batch_size={self.batch_size}: an "
                "epoch would hold no batch"
            )
        if not callable(input_iter_func):
            raise TypeError(
                "input_iter_func must be a function (start, end, batch_size) -> iterator, "
                f"got {type(input_iter_func).__name__}"
            )
        self.num_samples = num_samples
        self.num_batches = num_samples // self.batch_size
        self.prefetch_size = _check_count("prefetch_size", prefetch_size, 0)
        self.repeat = bool(repeat)
        self._input_iter_func = input_iter_func
        self._names, self._specs, self._tree = _spec_leaves(placement_specs)
        self._reads, self._pieces = _plan_reads(self._names, self._specs, self.batch_size)
        self._on_ray = isinstance(self._specs[0].placements[0], tuple)
        if self._on_ray:
            self._mesh_reads = _plan_mesh_reads(self._names, self._specs, self.batch_size)

    @property
    def read_ranges(self) -> list[tuple[int, int, int]]:
        """The ``(start, end, batch_size)`` that ``input_iter_func`` is called with in
        each epoch, one per distinct range of rows the hosts hold."""
        n = self.num_batches
        return [(r.start * n, r.stop * n, r.rows) for r in self._reads]

    def __iter__(self) -> _Prefetcher:
        epochs = itertools.count() if self.repeat else range(1)
        return _Prefetcher((batch for _ in epochs for batch in self._epoch()), self.prefetch_size)

    def _epoch(self) -> Iterator[Any]:
        if self._on_ray:
            yield from self._worker_epoch()
            return
        ranges = self.read_ranges
        iterators = [iter(self._input_iter_func(*r)) for r in ranges]
        for k in range(self.num_batches):
            host_batches = []
            for (start, end, rows), it in zip(ranges, iterators, strict=True):
                call = f"input_iter_func({start}, {end}, {rows})"
                try:
                    batch = next(it)
                except StopIteration:
                    raise ValueError(
                        f"{call} stopped after {k} batches; an epoch is num_samples // "
                        f"batch_size = {self.num_batches} batches"
                    ) from None
                what = f"batch {k} of {call}"
                leaves, _ = _batch_leaves(batch, self._tree, self._names, what)
                for name, x, spec in zip(self._names, leaves, self._specs, strict=True):
                    _check_leaf(name, x, spec, rows, what)
                host_batches.append([np.asarray(x) for x in leaves])
            yield [self._assemble(j, spec, host_batches) for j, spec in enumerate(self._specs)]

    def _worker_epoch(self) -> Iterator[Any]:
        """An epoch on Ray: every worker of every mesh that holds batch leaves reads its
        host's rows and makes its devices' shards (module docstring)."""
        from alpa.runtime.ray_mesh import DistributedArray, wait_workers

        n = self.num_batches
        reader = uuid.uuid4().hex
        read = _HostRead(
            self._input_iter_func,
            self._tree,
            tuple(self._names),
            tuple(PlacementSpec(spec.aval, (), ()) for spec in self._specs),
        )
        workers = [
            (mesh.workers[host], mesh.label(host), lo, hi)
            for mesh, _, hosts in self._mesh_reads
            for host, (lo, hi) in enumerate(hosts)
        ]
        try:
            wait_workers(
                [
                    (w.open_rows.remote(reader, read, lo * n, hi * n, hi - lo), label)
                    for w, label, lo, hi in workers
                ]
            )
            for _ in range(n):
                calls, made = [], []
                for mesh, leaves, hosts in self._mesh_reads:
                    names = [uuid.uuid4().hex for _ in leaves]
                    layouts = [self._specs[j].placements[0][1] for j in leaves]
                    shapes = [(self.batch_size, *self._specs[j].aval.shape[1:]) for j in leaves]
                    calls += [
                        (
                            mesh.workers[host].next_rows.remote(
                                reader, names, leaves, layouts, shapes, lo
                            ),
                            mesh.label(host),
                        )
                        for host, (lo, _) in enumerate(hosts)
                    ]
                    made += [
                        (j, mesh, name, layout, shape)
                        for j, name, layout, shape in zip(
                            leaves, names, layouts, shapes, strict=True
                        )
                    ]
                try:
                    wait_workers(calls)
                except RuntimeError:
                    for _, mesh, name, _, _ in made:  # what the other workers made of it
                        mesh.schedule_delete(name)
                    raise
                placed: list[Any] = [None] * len(self._specs)
                for j, mesh, name, layout, shape in made:
                    placed[j] = DistributedArray(
                        mesh, name, shape, self._specs[j].aval.dtype, layout
                    )
                yield placed
        finally:
            for w, _, _, _ in workers:
                w.close_rows.remote(reader)

    def _assemble(self, j: int, spec: PlacementSpec, host_batches: list[list[np.ndarray]]):
        """Leaf ``j`` of the global batch, from the hosts' rows (local runtime)."""
        shape = (self.batch_size, *spec.aval.shape[1:])
        target = spec.placements[0]
        arrays = [
            jax.device_put(host_batches[p.read][j][p.index], p.device) for p in self._pieces[j]
        ]
        return jax.make_array_from_single_device_arrays(shape, target, arrays)
