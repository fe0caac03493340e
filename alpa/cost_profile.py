"""A cluster's measured rates, and how the cost model reads them.

The cost model prices a plan in seconds. Without a profile it takes its rates from a
``ClusterSpec``'s datasheet figures: contractions at the device's dense peak, every other
operation by the bytes it writes at the memory's peak bandwidth, and collectives by the
alpha-beta model of the links. A :class:`ClusterProfile` replaces each figure by what was
measured on the devices (``alpa.mesh_profiling.profile_all`` makes one):

* **Contractions** at the rate measured for their shape: a grid of matmuls
  ``(m, k, n)`` per dtype (:class:`DotTable`), the rate at a shape between the grid's
  points interpolated in log space, never above the best rate measured; a dimension
  below the grid's smallest runs at that point's rate scaled down in proportion (tiny
  matmuls are latency-bound).
* **Memory-bound work** (every other operation, priced by the bytes it writes) at the
  seconds measured for writing that many bytes through a chain of elementwise
  operations as XLA compiles it (:class:`Curve` of bytes -> seconds; XLA fuses the
  chain, so a byte of it costs less than a byte written alone), and data movement
  (copies, transposes, concatenations, slices, gathers: :data:`DATA_MOVEMENT`, each
  byte written for real) at the seconds measured for a transposed copy.
* **Concurrency.** Devices that share a host's cores (the virtual CPU devices) do not
  each run at their solo rate when several work at once: ``concurrency[k]`` is one
  device's throughput while ``k`` devices work at once, as a fraction of its throughput
  alone (1.0 for accelerators that own their compute), measured for matmuls and for
  memory-bound work apart (``memory_concurrency``). A mesh of ``n`` devices prices its
  work at the concurrency of ``n``; a pipeline whose stages share a host is bounded below
  by the host's cores (``stage_work.shared_makespan``).
* **Collectives** from measured curves of seconds against the bytes per device (in
  ``LogicalDeviceMesh``'s convention of each kind), one curve per kind and group layout
  (:class:`GroupLayout`: the size of each group, the number of groups running at once,
  whether a group spans hosts). A submesh's groups are priced as if the host's every
  device were in a group of that size (a pipeline's stages run beside each other); a
  layout that was not measured falls back to the alpha-beta model.
* **Cross-mesh transfers** (a value sent from one stage's mesh to the next) from a curve of
  seconds against bytes, and **host cost** per pipeline instruction and per program
  launch (the driver's work between the device programs).

Curves are monotone: time never falls with size and bandwidth never falls with size
(a larger message is never slower per byte than a smaller one); a measurement that breaks
this is taken for noise, which only adds time, and lowered.

A profile is keyed by device kind and cluster shape and stored as JSON
(:func:`save_profiles`, :func:`load_profiles`); ``format`` versions the file, read by
``alpa.saved_format``'s rules (one written by a newer alpa is refused by name).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpa.saved_format import read_format

#: Version of a cluster profile's JSON layout (``alpa.saved_format``'s rules).
PROFILE_FORMAT = 1

_REPROFILE = "profile the cluster again with this alpa (alpa.mesh_profiling.profile_all)"

#: Primitives that move data rather than compute on it: each byte they write is priced
#: at the measured copy rate (``ClusterProfile.copy``), not the fused elementwise one.
DATA_MOVEMENT = frozenset(
    {
        "concatenate",
        "transpose",
        "copy",
        "copy_p",
        "pad",
        "gather",
        "scatter",
        "scatter-add",
        "dynamic_slice",
        "dynamic_update_slice",
        "slice",
        "rev",
        "sort",
        "all_gather",
        "reduce_scatter",
    }
)


# ----------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class Curve:
    """Seconds as a function of a size (bytes), from measured points.

    Piecewise linear between the points; below the first point, that point's seconds
    (a latency floor); past the last, the last point's seconds plus the extra bytes at
    the best bandwidth measured."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        sizes = tuple(float(s) for s in self.sizes)
        seconds = tuple(float(t) for t in self.seconds)
        if not sizes or len(sizes) != len(seconds):
            raise ValueError(
                f"a Curve needs as many seconds as sizes, at least one: {sizes} {seconds}"
            )
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"a Curve's sizes must increase: {sizes}")
        if any(not (t >= 0 and math.isfinite(t)) for t in seconds):
            raise ValueError(f"a Curve's seconds must be finite and >= 0: {seconds}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", seconds)

    @classmethod
    def monotone(cls, points: Iterable[tuple[float, float]]) -> Curve:
        """The curve of measured ``(size, seconds)`` points made monotone, on the view
        that noise only adds time: sorted by size, each point's bandwidth raised to the
        best of the smaller ones (Alpa's ``make_monotonic``), then each point's seconds
        lowered to the least of the larger ones."""
        points = sorted((float(s), float(t)) for s, t in points)
        sizes = [s for s, _ in points]
        seconds = [t for _, t in points]
        best = 0.0
        for i, (s, t) in enumerate(points):
            if s > 0 and t > 0:
                best = max(best, s / t)
                seconds[i] = min(t, s / best)
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(tuple(sizes), tuple(seconds))

    @property
    def best_bandwidth(self) -> float:
        """The most bytes per second any point reached (``inf`` for a single point at
        size 0)."""
        rates = [s / t for s, t in zip(self.sizes, self.seconds, strict=True) if s > 0 and t > 0]
        return max(rates, default=math.inf)

    def __call__(self, size: float) -> float:
        sizes, seconds = self.sizes, self.seconds
        if size <= sizes[0]:
            return seconds[0]
        if size >= sizes[-1]:
            return seconds[-1] + (size - sizes[-1]) / self.best_bandwidth
        i = bisect.bisect_right(sizes, size) - 1
        w = (size - sizes[i]) / (sizes[i + 1] - sizes[i])
        return seconds[i] + w * (seconds[i + 1] - seconds[i])

    def to_json(self) -> list:
        return [list(self.sizes), list(self.seconds)]

    @classmethod
    def from_json(cls, data: Sequence) -> Curve:
        return cls(tuple(data[0]), tuple(data[1]))


# ----------------------------------------------------------------------------- matmuls


@dataclass(frozen=True)
class DotTable:
    """Seconds of ``(m, k) @ (k, n)`` matmuls of one dtype on one device working alone,
    measured on the grid ``sizes`` x ``sizes`` x ``sizes``: ``seconds[i][j][l]`` for
    ``m = sizes[i]``, ``k = sizes[j]``, ``n = sizes[l]``."""

    sizes: tuple[int, ...]
    seconds: tuple  # nested [m][k][n]

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        table = np.asarray(self.seconds, dtype=float)
        if table.shape != (len(sizes),) * 3:
            raise ValueError(
                f"a DotTable over sizes {sizes} needs seconds of shape {(len(sizes),) * 3}, "
                f"got {table.shape}"
            )
        if not (table > 0).all() or not np.isfinite(table).all():
            raise ValueError("a DotTable's seconds must be finite and positive")
        if any(b <= a for a, b in itertools.pairwise(sizes)) or sizes[0] < 1:
            raise ValueError(f"a DotTable's sizes must be positive and increase: {sizes}")
        object.__setattr__(self, "sizes", sizes)
        nested = tuple(tuple(tuple(float(t) for t in row) for row in plane) for plane in table)
        object.__setattr__(self, "seconds", nested)

    @functools.cached_property
    def _log_rates(self) -> np.ndarray:
        s = np.asarray(self.sizes, dtype=float)
        flops = 2.0 * s[:, None, None] * s[None, :, None] * s[None, None, :]
        return np.log(flops / np.asarray(self.seconds, dtype=float))

    @functools.cached_property
    def best_rate(self) -> float:
        """The most FLOP/s any measured shape reached."""
        return float(np.exp(self._log_rates.max()))

    @functools.cached_property
    def _log_sizes(self) -> np.ndarray:
        return np.log(np.asarray(self.sizes, dtype=float))

    def rate(self, m: float, k: float, n: float) -> float:
        """FLOP/s of an ``(m, k) @ (k, n)`` matmul: log-rate interpolated between the
        grid's points (trilinear in ``log m, log k, log n``), a dimension past the grid
        clamped to its last point, one below the grid's first point scaling the rate by
        ``dim / sizes[0]``; never above :attr:`best_rate`."""
        logs = self._log_sizes
        table = self._log_rates
        weights = []
        scale = 1.0
        for dim in (m, k, n):
            dim = max(float(dim), 1.0)
            if dim < self.sizes[0]:
                scale *= dim / self.sizes[0]
            x = min(max(math.log(dim), logs[0]), logs[-1])
            i = min(max(int(np.searchsorted(logs, x, side="right")) - 1, 0), len(logs) - 2)
            if len(logs) == 1:
                weights.append(((0, 1.0),))
                continue
            w = (x - logs[i]) / (logs[i + 1] - logs[i])
            weights.append(((i, 1.0 - w), (i + 1, w)))
        log_rate = 0.0
        for a, wa in weights[0]:
            for b, wb in weights[1]:
                for c, wc in weights[2]:
                    log_rate += wa * wb * wc * table[a, b, c]
        return min(math.exp(log_rate), self.best_rate) * scale

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": np.asarray(self.seconds).tolist()}

    @classmethod
    def from_json(cls, data: Mapping) -> DotTable:
        return cls(tuple(data["sizes"]), data["seconds"])


# ----------------------------------------------------------------------------- collectives


@dataclass(frozen=True, order=True)
class GroupLayout:
    """Which devices a collective runs over, as far as its time depends on it: the size of
    each group, how many groups run it at once (the other rows of the mesh) and whether a
    group spans hosts."""

    group_size: int
    num_groups: int = 1
    spans_hosts: bool = False

    def key(self) -> str:
        return f"{self.group_size}x{self.num_groups}{'-inter' if self.spans_hosts else ''}"

    @classmethod
    def from_key(cls, key: str) -> GroupLayout:
        inter = key.endswith("-inter")
        size, groups = key.removesuffix("-inter").split("x")
        return cls(int(size), int(groups), inter)


def axis_layouts(
    physical: tuple[int, int], logical: tuple[int, int]
) -> tuple[GroupLayout, GroupLayout]:
    """The group layout of each axis of the ``logical`` view of a submesh of ``physical``
    ``(hosts, devices per host)`` shape, devices laid out row-major: axis 1 groups
    ``logical[1]`` consecutive devices, axis 0 every ``logical[1]``-th. The groups that
    run at once are counted on one host (hosts do not share their links or cores)."""
    hosts, per_host = physical
    a, b = logical
    layouts = []
    for axis, size in enumerate((a, b)):
        span = size if axis == 1 else size * b
        spans_hosts = hosts > 1 and span > per_host
        on_one_host = a * b if spans_hosts else min(a * b, per_host)
        layouts.append(GroupLayout(size, max(on_one_host // size, 1), spans_hosts))
    return layouts[0], layouts[1]


# ----------------------------------------------------------------------------- the profile


@dataclass(frozen=True, eq=False)
class ClusterProfile:
    """What was measured on a cluster (module docstring). Seconds throughout.

    Attributes:
      device_kind: the devices' kind as JAX names it (``"cpu"``, ``"NVIDIA H100 80GB HBM3"``).
      platform: ``"cpu"``, ``"gpu"``, ...
      num_hosts, num_devices_per_host: the shape of the cluster it was measured on.
      dot: per dtype name (``"float32"``), the matmul table of one device alone.
      memory: bytes written -> seconds, of a chain of elementwise operations on one
        device alone (per byte of each operation's result, as the model counts them).
      concurrency: ``{k: fraction}`` one device's matmul throughput while ``k`` devices
        work at once, relative to working alone (``1`` is alone).
      copy: bytes written -> seconds of data movement on one device alone (``None``:
        priced as ``memory``).
      memory_concurrency: ``concurrency`` of memory-bound work (``None``: as matmuls').
      collectives: per kind (``"all-reduce"``, ...) per ``GroupLayout.key()``, bytes per
        device -> seconds.
      cross_mesh: bytes -> seconds of one value sent from one mesh to another.
      instruction_seconds: the driver's cost per pipeline instruction.
      launch_seconds: the driver's cost per launch of a one-mesh program.
      meta: free-form notes (jax version, date, how long profiling took).
    """

    device_kind: str
    platform: str
    num_hosts: int
    num_devices_per_host: int
    dot: Mapping[str, DotTable]
    memory: Curve
    concurrency: Mapping[int, float]
    collectives: Mapping[str, Mapping[str, Curve]]
    cross_mesh: Curve | None = None
    instruction_seconds: float = 0.0
    launch_seconds: float = 0.0
    meta: Mapping[str, object] = field(default_factory=dict, compare=False)
    copy: Curve | None = None
    memory_concurrency: Mapping[int, float] | None = None

    def __post_init__(self):
        if not self.dot:
            raise ValueError("a ClusterProfile needs the matmul table of at least one dtype")
        object.__setattr__(self, "concurrency", _fractions(self.concurrency, "concurrency"))
        if self.memory_concurrency is not None:
            fractions = _fractions(self.memory_concurrency, "memory_concurrency")
            object.__setattr__(self, "memory_concurrency", fractions)
        for attr in ("instruction_seconds", "launch_seconds"):
            value = getattr(self, attr)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"ClusterProfile.{attr} must be >= 0, got {value!r}")

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the measurements: two profiles are equal when their figures are."""
        data = self.to_json()
        data.pop("meta")
        text = json.dumps(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterProfile) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"ClusterProfile({self.key}, {self.fingerprint})"

    @property
    def key(self) -> str:
        """The database key: device kind and cluster shape."""
        return profile_key(self.device_kind, self.num_hosts, self.num_devices_per_host)

    # -- reading it

    def concurrency_factor(self, k: int, memory_bound: bool = False) -> float:
        """One device's throughput while ``k`` devices work at once, relative to alone
        (of matmuls, or ``memory_bound`` work): interpolated in ``log k`` between measured
        counts, the last one held past them."""
        points = self.concurrency
        if memory_bound and self.memory_concurrency is not None:
            points = self.memory_concurrency
        ks = sorted(points)
        if k <= ks[0]:
            return points[ks[0]]
        if k >= ks[-1]:
            return points[ks[-1]]
        i = bisect.bisect_right(ks, k) - 1
        w = (math.log(k) - math.log(ks[i])) / (math.log(ks[i + 1]) - math.log(ks[i]))
        return points[ks[i]] + w * (points[ks[i + 1]] - points[ks[i]])

    def dot_table(self, dtype: str) -> DotTable:
        """The matmul table of ``dtype``, else of float32, else the first one measured."""
        return self.dot.get(dtype) or self.dot.get("float32") or next(iter(self.dot.values()))

    def collective_curve(self, kind: str, layout: GroupLayout) -> Curve | None:
        return self.collectives.get(kind, {}).get(layout.key())

    # -- JSON

    def to_json(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "device_kind": self.device_kind,
            "platform": self.platform,
            "num_hosts": self.num_hosts,
            "num_devices_per_host": self.num_devices_per_host,
            "dot": {dtype: table.to_json() for dtype, table in self.dot.items()},
            "memory": self.memory.to_json(),
            "concurrency": {str(k): v for k, v in self.concurrency.items()},
            "collectives": {
                kind: {key: curve.to_json() for key, curve in curves.items()}
                for kind, curves in self.collectives.items()
            },
            "cross_mesh": None if self.cross_mesh is None else self.cross_mesh.to_json(),
            "instruction_seconds": self.instruction_seconds,
            "launch_seconds": self.launch_seconds,
            "copy": None if self.copy is None else self.copy.to_json(),
            "memory_concurrency": None
            if self.memory_concurrency is None
            else {str(k): v for k, v in self.memory_concurrency.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, data: Mapping, source: str = "the profile") -> ClusterProfile:
        read_format(data, PROFILE_FORMAT, "cluster profile", source, remedy=_REPROFILE)
        return cls(
            device_kind=data["device_kind"],
            platform=data["platform"],
            num_hosts=int(data["num_hosts"]),
            num_devices_per_host=int(data["num_devices_per_host"]),
            dot={dtype: DotTable.from_json(t) for dtype, t in data["dot"].items()},
            memory=Curve.from_json(data["memory"]),
            concurrency={int(k): v for k, v in data["concurrency"].items()},
            collectives={
                kind: {key: Curve.from_json(c) for key, c in curves.items()}
                for kind, curves in data["collectives"].items()
            },
            cross_mesh=None
            if data.get("cross_mesh") is None
            else Curve.from_json(data["cross_mesh"]),
            instruction_seconds=float(data.get("instruction_seconds", 0.0)),
            launch_seconds=float(data.get("launch_seconds", 0.0)),
            meta=dict(data.get("meta", {})),
            copy=_optional_curve(data.get("copy")),
            memory_concurrency=None
            if data.get("memory_concurrency") is None
            else {int(k): v for k, v in data["memory_concurrency"].items()},
        )


def _fractions(points: Mapping, name: str) -> dict[int, float]:
    """``{k: fraction}`` checked (``k = 1`` present, fractions in ``(0, 1.5]``) and made
    non-increasing in ``k``: one device never gains from more devices working beside it
    (a noisy measurement of 4 above 2 is held at 2's)."""
    fractions = {int(k): float(v) for k, v in points.items()}
    if 1 not in fractions or any(not 0 < v <= 1.5 for v in fractions.values()):
        raise ValueError(
            f"ClusterProfile.{name} needs k=1 and fractions in (0, 1.5], got {fractions}"
        )
    monotone, least = {}, math.inf
    for k, v in sorted(fractions.items()):
        least = min(least, v)
        monotone[k] = least
    return monotone


def _optional_curve(data) -> Curve | None:
    return None if data is None else Curve.from_json(data)


def profile_key(device_kind: str, num_hosts: int, num_devices_per_host: int) -> str:
    return f"{device_kind}/{num_hosts}x{num_devices_per_host}"


# ----------------------------------------------------------------------------- files


def save_profiles(path: str, profiles: Iterable[ClusterProfile]) -> None:
    """Write ``profiles`` to ``path`` (JSON), keyed by :attr:`ClusterProfile.key`, through a
    temporary file renamed into place."""
    data = {"format": PROFILE_FORMAT, "profiles": {p.key: p.to_json() for p in profiles}}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def load_profiles(path: str) -> dict[str, ClusterProfile]:
    """The profiles in ``path`` by key; a clear error for a file that is not one. A file
    read before and not changed since is not read again."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no cluster profile at {path!r}; make one with alpa.mesh_profiling.profile_all"
        ) from None
    return dict(_load_profiles(os.path.abspath(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _load_profiles(path: str, mtime_ns: int, size: int) -> dict[str, ClusterProfile]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no cluster profile at {path!r}; make one with alpa.mesh_profiling.profile_all"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path!r} is not a cluster profile (not JSON: {error})") from None
    if not isinstance(data, dict) or "profiles" not in data:
        raise ValueError(f"{path!r} is not a cluster profile (no 'profiles' in it)")
    read_format(data, PROFILE_FORMAT, "cluster profile", repr(path), remedy=_REPROFILE)
    return {
        key: ClusterProfile.from_json(p, f"{path!r}'s profile {key!r}")
        for key, p in data["profiles"].items()
    }


# ----------------------------------------------------------------------------- one mesh


@dataclass(frozen=True)
class MeshRates:
    """A profile as one submesh of ``physical = (hosts, devices per host)`` devices sees
    it, all of them working at once: what ``LogicalDeviceMesh`` prices work and
    collectives with when its cluster has a profile."""

    profile: ClusterProfile
    physical: tuple[int, int]

    @functools.cached_property
    def concurrency(self) -> float:
        """The fraction of its solo matmul rate each device runs at: the submesh's devices
        of one host work at once (hosts do not share cores)."""
        return self.profile.concurrency_factor(self.physical[1])

    @functools.cached_property
    def memory_concurrency(self) -> float:
        """The same of memory-bound work."""
        return self.profile.concurrency_factor(self.physical[1], memory_bound=True)

    def dot_seconds(self, batch: float, m: float, k: float, n: float, dtype: str) -> float:
        """Seconds of ``batch`` matmuls ``(m, k) @ (k, n)`` on one device of the mesh."""
        table = self.profile.dot_table(dtype)
        flops = 2.0 * batch * m * k * n
        return flops / (table.rate(m, k, n) * self.concurrency)

    def flops_seconds(self, flops: float, dtype: str = "float32") -> float:
        """Seconds of ``flops`` of contractions whose shape is not known (the body of an
        opaque equation): at the rate of the cube whose FLOPs they are."""
        if flops <= 0:
            return 0.0
        side = (flops / 2.0) ** (1.0 / 3.0)
        return self.dot_seconds(1.0, side, side, side, dtype)

    def write_seconds(self, num_bytes: float, movement: bool = False) -> float:
        """Seconds of memory-bound work writing ``num_bytes`` on one device of the mesh:
        elementwise work, or with ``movement`` data movement (:data:`DATA_MOVEMENT`)."""
        if num_bytes <= 0:
            return 0.0
        curve = self.profile.copy if movement and self.profile.copy is not None else None
        seconds = (curve or self.profile.memory)(num_bytes)
        return seconds / self.memory_concurrency

    def _curve(self, kind: str, logical: tuple[int, int], axis: int) -> Curve | None:
        """The measured curve of ``kind`` over ``axis``: of its group layout with every
        device of the host in a group, as when the other stages of a pipeline run their
        own collectives beside this submesh's (a submesh of 2 of a host's 8 devices runs
        its pairs' collectives as four pairs would at once); ``None`` where that layout
        was not measured."""
        layout = axis_layouts(self.physical, logical)[axis]
        if not layout.spans_hosts:
            per_host = self.profile.num_devices_per_host
            busy = GroupLayout(layout.group_size, max(per_host // layout.group_size, 1))
            found = self.profile.collective_curve(kind, busy)
            if found is not None:
                return found
        return self.profile.collective_curve(kind, layout)

    def collective_seconds(
        self, kind: str, logical: tuple[int, int], axis: int, num_bytes: float
    ) -> float | None:
        """Seconds of collective ``kind`` over ``axis`` of the ``logical`` view
        (:meth:`_curve`); ``None`` where its layout was not measured."""
        curve = self._curve(kind, logical, axis)
        return None if curve is None else curve(num_bytes)

    def collective_latency(self, kind: str, logical: tuple[int, int], axis: int) -> float | None:
        """The smallest measured message's seconds: what a collective costs beyond its
        bytes (``None`` where not measured)."""
        curve = self._curve(kind, logical, axis)
        return None if curve is None else curve.seconds[0]
