"""Measurements of the devices of one host: what a cluster profile is made of.

Each function here times small XLA programs on a list of this process's devices and
returns plain data (``cost_profile`` curves and tables); ``alpa.mesh_profiling`` calls
them in the driver for local devices, and a Ray mesh worker calls them for its own host's
devices. Every timing is the median of repeated runs of one compiled program that
repeats its operation in a loop (``lax.fori_loop``), each iteration depending on the
last, so that neither the dispatch of the program nor XLA's loop-invariant code motion
enters the figure.

* :func:`time_dots`: ``(m, k) @ (k, n)`` on one device alone, over a grid of shapes.
* :func:`time_elementwise`: a chain of elementwise operations on one device alone, per
  byte of each operation's result (as the cost model counts memory-bound work).
* :func:`time_copies`: data movement (a transposed copy) on one device alone, per byte.
* :func:`time_concurrency`, :func:`time_memory_concurrency`: one device's throughput
  while ``k`` devices run the same matmul (the elementwise chain) at once, relative to
  alone.
* :func:`time_collectives`: each collective over each group layout of the host's devices.
* :func:`time_transfers`: ``jax.device_put`` of a value from one half of the devices to
  the other (the local runtime's cross-mesh transfer).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa.cost_profile import Curve, DotTable, GroupLayout

#: Seconds of device time one timing aims at (each of its runs, before the median).
TARGET_SECONDS = 0.02
#: Runs per timing (their median is the figure).
RUNS = 3


def _median_seconds(fn: Callable, args: Sequence) -> float:
    """Median wall seconds of ``RUNS`` calls of ``fn(*args)`` waited for (after one
    untimed call that compiles and warms up)."""
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _repeat_count(seconds_once: float) -> int:
    return int(min(max(TARGET_SECONDS / max(seconds_once, 1e-7), 1), 256))


def _per_iteration(make: Callable[[int], Callable], args: Sequence) -> float:
    """Seconds of one iteration of ``make(r)``, a program looping ``r`` times: timed at
    ``r = 1`` and ``r = R``; the difference over ``R - 1`` iterations leaves out what
    the program costs around its loop (dispatch, its inputs, its outputs)."""
    once = _median_seconds(make(1), args)
    r = _repeat_count(once)
    if r < 2:
        return once
    many = _median_seconds(make(r + 1), args)
    per = (many - once) / r
    return per if per > 0 else many / (r + 1)


# ----------------------------------------------------------------------------- compute


def time_dots(device, sizes: Sequence[int], dtype: str, progress=None) -> DotTable:
    """The matmul table of ``dtype`` on ``device`` alone, over ``sizes``^3."""
    n = len(sizes)
    table = np.zeros((n, n, n))
    for i, m in enumerate(sizes):
        for j, k in enumerate(sizes):
            for q, p in enumerate(sizes):
                table[i, j, q] = _time_dot(device, m, k, p, dtype)
                if progress is not None:
                    progress(1)
    return DotTable(tuple(sizes), table.tolist())


def _time_dot(device, m: int, k: int, n: int, dtype: str) -> float:
    a = jax.device_put(jnp.full((m, k), 0.5, dtype), device)
    b = jax.device_put(jnp.full((k, n), 0.5, dtype), device)

    def make(r: int):
        @jax.jit
        def run(a, b):
            return jax.lax.fori_loop(0, r, lambda _, a: _dot_step(a, b), a)[0, 0]

        return run

    return _per_iteration(make, (a, b))


def _dot_step(a, b):
    """``a @ b``, whose sum flows into one element of the next iteration's ``a``: the
    product cannot be hoisted out of the loop nor cut to the element read."""
    c = jnp.dot(a, b, preferred_element_type=a.dtype)
    return a.at[0, 0].set(0.5 + jnp.sum(c) * 1e-30)


def _chain_program(r: int):
    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, r, lambda _, y: _elementwise_chain(y), x)

    return run


def _elementwise_chain(x):
    """Memory-bound work as a transformer's layers hold it, on rows of ``ROW`` values: a
    layer norm, a GELU, a softmax over the row and a residual add (reductions,
    broadcasts and elementwise operations, which XLA fuses in part)."""
    rows = x.reshape(-1, ROW)
    mean = jnp.mean(rows, axis=-1, keepdims=True)
    centered = rows - mean
    normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, -1, keepdims=True) + 1e-5)
    y = jax.nn.gelu(normed)
    y = jax.nn.softmax(y, axis=-1)
    return (y + rows).reshape(x.shape)


#: The row of :func:`_elementwise_chain` (a hidden dimension).
ROW = 256


def chain_written_bytes(count: int, dtype: str = "float32") -> float:
    """The bytes the cost model counts for :func:`_elementwise_chain` on ``count``
    elements: every equation's results, as ``LogicalDeviceMesh.compute_cost`` is given
    them."""
    closed = jax.make_jaxpr(_elementwise_chain)(jax.ShapeDtypeStruct((count,), dtype))
    total = 0.0
    for eqn in closed.jaxpr.eqns:
        for v in eqn.outvars:
            total += float(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
    return total


def time_elementwise(device, sizes_bytes: Sequence[int], dtype: str = "float32") -> Curve:
    """Seconds per byte written by memory-bound equations on ``device`` alone: the
    seconds of :func:`_elementwise_chain` against the bytes its equations write, as the
    cost model counts them (:func:`chain_written_bytes`)."""
    itemsize = np.dtype(dtype).itemsize
    points = []
    for size in sizes_bytes:
        count = max(size // itemsize // ROW, 1) * ROW
        x = jax.device_put(jnp.full((count,), 0.5, dtype), device)
        seconds = _per_iteration(_chain_program, (x,))
        points.append((chain_written_bytes(count, dtype), seconds))
    return Curve.monotone(points)


def _copy_program(r: int):
    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, r, lambda _, y: y.T, x)

    return run


def time_copies(device, sizes_bytes: Sequence[int], dtype: str = "float32") -> Curve:
    """Seconds per ``bytes`` that data movement writes on ``device`` alone: a square
    array transposed (its copy in the other layout), as packing gradients into one buffer,
    a concatenation or a relayout writes them."""
    itemsize = np.dtype(dtype).itemsize
    points = []
    for size in sizes_bytes:
        side = max(int((size // itemsize) ** 0.5), 2)
        x = jax.device_put(jnp.full((side, side), 0.5, dtype), device)
        points.append((side * side * itemsize, _per_iteration(_copy_program, (x,))))
    return Curve.monotone(points)


def _concurrent_chains(mesh: Mesh, r: int):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))
    def run(x):
        return jax.lax.fori_loop(0, r, lambda _, y: _elementwise_chain(y), x)

    return run


def time_memory_concurrency(devices: Sequence, counts: Sequence[int], size: int = 1 << 22) -> dict:
    """``{k: fraction}``: one device's throughput on the elementwise chain of ``size``
    bytes while ``k`` devices run it at once, relative to one device alone (memory-bound
    work shares a host's cores and memory bandwidth otherwise than matmuls do). The size
    is a layer's activation per device (4 MiB): several devices' arrays together then
    leave the caches that one device's fits in, which the fraction includes."""
    result = {}
    count = size // 4 // ROW * ROW
    for k in counts:
        mesh = Mesh(np.asarray(devices[:k]), ("d",))
        x = jax.device_put(
            jnp.full((k * count,), 0.5, jnp.float32), NamedSharding(mesh, PartitionSpec("d"))
        )
        result[k] = _per_iteration(partial(_concurrent_chains, mesh), (x,))
    alone = result[1]
    return {k: min(alone / s, 1.5) for k, s in result.items()}


def _concurrent_dots(mesh: Mesh, r: int):
    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PartitionSpec("d"), PartitionSpec("d")),
        out_specs=PartitionSpec("d"),
    )
    def run(a, b):
        return jax.lax.fori_loop(0, r, lambda _, x: _dot_step(x, b.T), a)

    return run


def time_concurrency(devices: Sequence, counts: Sequence[int], size: int = 256) -> dict:
    """``{k: fraction}``: one device's matmul throughput while ``k`` devices each run the
    same ``size``^3 matmul at once (one SPMD program over ``k`` devices), relative to one
    device alone."""
    alone = None
    result = {}
    for k in counts:
        mesh = Mesh(np.asarray(devices[:k]), ("d",))
        sharding = NamedSharding(mesh, PartitionSpec("d"))
        a = jax.device_put(jnp.full((k * size, size), 0.5, jnp.float32), sharding)
        b = jax.device_put(jnp.full((k * size, size), 0.5, jnp.float32), sharding)

        seconds = _per_iteration(partial(_concurrent_dots, mesh), (a, b))
        if alone is None:
            alone = seconds if k == 1 else None
        result[k] = seconds
    alone = result.get(1, alone)
    return {k: min(alone / s, 1.5) for k, s in result.items()}


# ----------------------------------------------------------------------------- collectives


def collective_layouts(num_devices: int) -> list[tuple[GroupLayout, tuple[int, int], int]]:
    """Each distinct ``GroupLayout`` of the logical views of this host's submeshes (power
    of two sizes up to ``num_devices``), with one ``(logical shape, axis)`` over
    ``num_groups * group_size`` devices that runs it."""
    seen = {}
    width = 2
    while width <= num_devices:
        a = 1
        while a <= width:
            b = width // a
            for axis, size in enumerate((a, b)):
                if size > 1:
                    layout = GroupLayout(size, width // size)
                    seen.setdefault(layout, ((a, b), axis))
            a *= 2
        width *= 2
    return [(layout, shape, axis) for layout, (shape, axis) in sorted(seen.items())]


def _collective_program(kind: str, mesh: Mesh, axis_name: str, r: int):
    """A program looping collective ``kind`` over ``axis_name`` ``r`` times, on a per-device
    buffer that keeps its shape from one iteration to the next."""
    specs = PartitionSpec(("x", "y"))

    def once(x):
        n = jax.lax.axis_size(axis_name)
        if kind == "all-reduce":
            return jax.lax.psum(x, axis_name) * (1.0 / n)
        if kind == "all-gather":
            full = jax.lax.all_gather(x, axis_name, tiled=True)
            return full[: x.shape[0]]
        if kind == "reduce-scatter":
            part = jax.lax.psum_scatter(x, axis_name, tiled=True)
            return jax.lax.dynamic_update_slice(x, part, (0,))
        if kind == "all-to-all":
            return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
        raise ValueError(f"unknown collective {kind!r}")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
    def run(x):
        return jax.lax.fori_loop(0, r, lambda _, y: once(y), x)

    return run


def _buffer_elements(kind: str, num_bytes: int, group: int, itemsize: int) -> int:
    """Elements of the per-device buffer whose collective ``kind`` has ``num_bytes`` in
    ``LogicalDeviceMesh``'s convention: an all-reduce's buffer, an all-gather's result
    (the buffer is its ``1/group``), a reduce-scatter's operand, an all-to-all's tensor
    over the group (the buffer is its ``1/group``)."""
    elements = max(num_bytes // itemsize, group * group)
    if kind in ("all-gather", "all-to-all"):
        elements //= group
    return max(group * (elements // group), group)


def time_collectives(
    devices: Sequence,
    kinds: Sequence[str],
    sizes_bytes: Sequence[int],
    dtype: str = "float32",
    progress=None,
) -> dict:
    """``{kind: {layout key: Curve}}`` over this host's group layouts
    (:func:`collective_layouts`), each curve of bytes in ``LogicalDeviceMesh``'s
    convention -> seconds."""
    itemsize = np.dtype(dtype).itemsize
    result: dict = {kind: {} for kind in kinds}
    for layout, shape, axis in collective_layouts(len(devices)):
        width = shape[0] * shape[1]
        mesh = Mesh(np.asarray(devices[:width]).reshape(shape), ("x", "y"))
        axis_name = ("x", "y")[axis]
        sharding = NamedSharding(mesh, PartitionSpec(("x", "y")))
        for kind in kinds:
            points = []
            for size in sizes_bytes:
                local = _buffer_elements(kind, size, layout.group_size, itemsize)
                x = jax.device_put(jnp.full((width * local,), 0.5, dtype), sharding)
                program = partial(_collective_program, kind, mesh, axis_name)
                seconds = _per_iteration(program, (x,))
                converted = (
                    local
                    * itemsize
                    * (layout.group_size if kind in ("all-gather", "all-to-all") else 1)
                )
                points.append((converted, seconds))
                if progress is not None:
                    progress(1)
            result[kind][layout.key()] = Curve.monotone(points)
    return result


def time_transfers(devices: Sequence, sizes_bytes: Sequence[int], dtype: str = "float32") -> Curve:
    """Seconds of ``jax.device_put`` of a value split over the first half of ``devices``
    onto the second half, split alike (the local runtime's cross-mesh ``RESHARD``)."""
    half = max(len(devices) // 2, 1)
    src = Mesh(np.asarray(devices[:half]), ("d",))
    dst = Mesh(np.asarray(devices[half : 2 * half] or devices[:half]), ("d",))
    itemsize = np.dtype(dtype).itemsize
    points = []
    for size in sizes_bytes:
        count = max(size // itemsize // half, 1) * half
        x = jax.device_put(jnp.full((count,), 0.5, dtype), NamedSharding(src, PartitionSpec("d")))
        target = NamedSharding(dst, PartitionSpec("d"))
        seconds = _median_seconds(lambda x, target=target: jax.device_put(x, target), (x,))
        points.append((count * itemsize, seconds))
    return Curve.monotone(points)


def time_launch(devices: Sequence, num_args: int = 16) -> float:
    """Seconds of one launch of a program over ``devices`` with ``num_args`` small
    arguments and as many results (what a step pays around its device work)."""
    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec())
    args = [jax.device_put(jnp.full((8,), float(i)), sharding) for i in range(num_args)]
    run = jax.jit(lambda *xs: [x + 1 for x in xs])
    jax.block_until_ready(run(*args))
    count = 50
    start = time.perf_counter()
    for _ in range(count):
        out = run(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / count


def powers_of_two(low: int, high: int, step: int = 1) -> list[int]:
    """``2**low, 2**(low + step), ...`` up to ``2**high`` (included)."""
    sizes = [1 << e for e in range(low, high + 1, step)]
    if sizes[-1] != 1 << high:
        sizes.append(1 << high)
    return sizes


# ----------------------------------------------------------------------------- one host


#: The matmul grids measured by default: on CPU a 2048^3 matmul already takes a tenth of
#: a second, on an accelerator shapes below 128 are all latency.
DEFAULT_DOT_SIZES = {"cpu": (32, 128, 512, 2048), "other": (128, 512, 2048, 8192)}
#: Sizes (bytes) of the elementwise chain.
ELEMENTWISE_SIZES = powers_of_two(14, 26, 3)


def dot_sizes(request: dict, platform: str) -> list[int]:
    sizes = request.get("dot_sizes")
    return list(sizes or DEFAULT_DOT_SIZES["cpu" if platform == "cpu" else "other"])


def concurrency_counts(num_devices: int) -> list[int]:
    """1, 2, 4, ... up to ``num_devices`` (and it)."""
    counts = [1]
    while counts[-1] * 2 <= num_devices:
        counts.append(counts[-1] * 2)
    if counts[-1] != num_devices:
        counts.append(num_devices)
    return counts


def profile_steps(request: dict, num_devices: int, platform: str = "cpu") -> int:
    """How many progress steps :func:`profile_host` reports."""
    dots = len(dot_sizes(request, platform)) ** 3 * len(request["dtypes"])
    layouts = len(collective_layouts(num_devices))
    comms = layouts * len(request["kinds"]) * len(request["comm_sizes"])
    return dots + comms + 2


def profile_host(devices: Sequence, request: dict, progress=None) -> dict:
    """Every measurement of one host's ``devices`` (module docstring) as JSON-able data:
    ``request`` holds ``dot_sizes`` (or ``None``: :data:`DEFAULT_DOT_SIZES`), ``dtypes``,
    ``kinds`` (collectives) and ``comm_sizes`` (bytes)."""
    platform = devices[0].platform
    sizes = dot_sizes(request, platform)
    dots = {dtype: time_dots(devices[0], sizes, dtype, progress) for dtype in request["dtypes"]}
    memory = time_elementwise(devices[0], ELEMENTWISE_SIZES)
    copies = time_copies(devices[0], ELEMENTWISE_SIZES)
    if progress is not None:
        progress(1)
    counts = concurrency_counts(len(devices))
    concurrency = time_concurrency(devices, counts)
    memory_concurrency = time_memory_concurrency(devices, counts)
    if progress is not None:
        progress(1)
    collectives = (
        time_collectives(devices, request["kinds"], request["comm_sizes"], progress=progress)
        if len(devices) > 1
        else {}
    )
    return {
        "device_kind": devices[0].device_kind,
        "platform": platform,
        "num_devices": len(devices),
        "dot": {dtype: table.to_json() for dtype, table in dots.items()},
        "memory": memory.to_json(),
        "copy": copies.to_json(),
        "concurrency": {str(k): v for k, v in concurrency.items()},
        "memory_concurrency": {str(k): v for k, v in memory_concurrency.items()},
        "collectives": {
            kind: {key: curve.to_json() for key, curve in curves.items()}
            for kind, curves in collectives.items()
        },
    }
