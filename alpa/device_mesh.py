"""Clusters and device meshes.

Four views of hardware, from the most abstract to the most concrete:

* :class:`ClusterSpec` describes hardware that need not exist: nodes, devices per node,
  peak FLOP/s and memory per device, bandwidth and latency inside and between nodes. The
  planner can plan for a ``ClusterSpec`` with no devices at all.
* :class:`VirtualPhysicalMesh` is a cluster not yet sliced, shape
  ``(num_hosts, num_devices_per_host)``; the stage DP slices it into submeshes
  ``(1,1), (1,2), (1,4) ... (1,M), (2,M) ... (N,M)``.
* :class:`LocalPhysicalDeviceMesh` holds real devices of this process.
* :class:`LogicalDeviceMesh` is a 2-D view ``(n0, n1)`` of a physical mesh with
  alpha-beta parameters per axis, used by the cost model and lowered to a
  ``jax.sharding.Mesh`` whose axes are ``Auto`` (``docs/design.md``, Views of hardware).

Collective costs along one logical axis with ``n`` devices, ``B`` bytes per device (for an
all-to-all, the whole tensor the ``n`` devices exchange: ``n`` times each one's buffer, as
in Alpa) (alpha-beta model, ``docs/auto_sharding.md``, Cost model)::

    all-gather       alpha + beta * (n-1)/n * B
    all-reduce       alpha + beta * 2(n-1)/n * B
    reduce-scatter   alpha + beta * (n-1)/n * B
    all-to-all       alpha + beta * (n-1)/n**2 * B * 1.5

An axis of one device communicates nothing and costs 0.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from alpa.cost_profile import ClusterProfile, MeshRates
from alpa.device_memory import MemoryStats

MESH_AXIS_NAMES = ("x", "y")
#: The leading axis of the mesh of a pipeline's leaf whose rows its stages hold (one
#: position per stage mesh, each of ``MESH_AXIS_NAMES``): ``runtime.stage_rows``.
STAGE_AXIS_NAME = "stages"


# ----------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class ClusterSpec:
    """A description of a cluster, real or not.

    Bandwidths are in bytes/s per device, latencies in seconds, FLOP/s are the dense peak
    of one device for the training dtype; ``memory_bandwidth`` is one device's own memory
    (HBM, or DRAM for CPU devices), which prices the bytes an operation writes.
    ``fuses_elementwise``: whether the device's XLA backend leaves chains of elementwise
    operations unwritten, computed inside the kernel that reads them (XLA:GPU does; the
    virtual CPU devices' figures match a model without it, bar broadcasts, which every
    backend computes inside their readers): the stage cost model's
    temporaries follow it (``layer_facts.temporary_bytes``).

    ``profile``: the rates measured on the cluster (``cost_profile.ClusterProfile``, made
    by ``alpa.mesh_profiling.profile_all``), or ``None``. With one, the cost model prices
    work and collectives at the measured rates, and a pipeline's time with the measured
    host costs (``docs/cost_model.md``); without, at the figures above. The figures above
    stay the cluster's datasheet (what "the hardware limit" is computed from).
    """

    num_nodes: int
    num_devices_per_node: int
    device_flops: float
    device_memory: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float = 1e-5
    inter_node_latency: float = 2e-5
    name: str = "custom"
    memory_bandwidth: float = 2e12
    fuses_elementwise: bool = True
    profile: ClusterProfile | None = None

    def __post_init__(self):
        if self.profile is not None and not isinstance(self.profile, ClusterProfile):
            raise TypeError(
                "ClusterSpec.profile must be a ClusterProfile (ClusterSpec.from_profile(path) "
                f"reads one from a file), got {type(self.profile).__name__}"
            )
        for attr in ("num_nodes", "num_devices_per_node"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{attr} must be a positive int, got {value!r}")
        for attr in (
            "device_flops",
            "device_memory",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "memory_bandwidth",
        ):
            value = getattr(self, attr)
            if not value > 0:
                raise ValueError(f"ClusterSpec.{attr} must be positive, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.num_devices_per_node

    @classmethod
    def preset(cls, name: str, num_nodes: int = 1, num_devices_per_node: int = 8) -> ClusterSpec:
        """A cluster of known devices: one of :data:`CLUSTER_PRESETS`."""
        key = name.lower()
        if key not in CLUSTER_PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r}; expected one of {sorted(CLUSTER_PRESETS)}"
            )
        return replace(
            CLUSTER_PRESETS[key], num_nodes=num_nodes, num_devices_per_node=num_devices_per_node
        )

    @classmethod
    def local(cls, profile: ClusterProfile | str | None = None) -> ClusterSpec:
        """This process's devices (virtual CPU devices or local GPUs) as one node.

        ``profile``: a ``ClusterProfile`` or the path of a profile file
        (``alpa.mesh_profiling.profile_all``) whose entry for these devices the cost model
        prices with; default ``global_config.cluster_profile`` (``None``: no profile, the
        preset's datasheet figures)."""
        import jax

        devices = jax.devices()
        base = _preset_of_kind(devices[0].platform, devices[0].device_kind)
        spec = replace(base, num_nodes=1, num_devices_per_node=len(devices))
        if profile is None:
            from alpa.global_env import global_config

            profile = global_config.cluster_profile
        if profile is None:
            return spec
        return spec.with_profile(
            resolve_profile(profile, devices[0].device_kind, 1, len(devices), "profile")
        )

    @classmethod
    def from_profile(
        cls,
        path: str,
        device_kind: str | None = None,
        num_nodes: int | None = None,
        num_devices_per_node: int | None = None,
    ) -> ClusterSpec:
        """The cluster a profile file was measured on (its entry for ``device_kind``,
        default its only one), with that profile: a ``ClusterSpec`` of the preset of its
        device kind (the datasheet figures) and the measured rates. ``num_nodes`` /
        ``num_devices_per_node`` plan for another size of the same devices (collectives
        of group layouts the profile lacks are then priced by the preset's alpha-beta)."""
        from alpa.cost_profile import load_profiles

        profiles = load_profiles(path)
        if device_kind is None:
            if len(profiles) != 1:
                raise ValueError(
                    f"{path!r} holds {len(profiles)} profiles {sorted(profiles)}; pass "
                    "device_kind= to choose one"
                )
            profile = next(iter(profiles.values()))
        else:
            profile = resolve_profile(path, device_kind, None, None, "path")
        base = _preset_of_kind(profile.platform, profile.device_kind)
        spec = replace(
            base,
            num_nodes=num_nodes or profile.num_hosts,
            num_devices_per_node=num_devices_per_node or profile.num_devices_per_host,
        )
        return spec.with_profile(profile)

    def with_profile(self, profile: ClusterProfile | None) -> ClusterSpec:
        """This cluster priced with ``profile`` (``None``: the datasheet figures)."""
        return replace(self, profile=profile)

    def get_virtual_physical_mesh(self) -> VirtualPhysicalMesh:
        return VirtualPhysicalMesh(self.num_nodes, self.num_devices_per_node, cluster=self)


def _preset_of_kind(platform: str, device_kind: str) -> ClusterSpec:
    """The preset of a device kind: the CPU's, or the GPU preset whose name the kind holds
    (A100 80GB if none does)."""
    if platform != "gpu":
        return CLUSTER_PRESETS["cpu"]
    kind = device_kind.lower()
    return next(
        (spec for key, spec in CLUSTER_PRESETS.items() if key.split("-")[0] in kind),
        CLUSTER_PRESETS["a100-80gb"],
    )


def resolve_profile(
    profile, device_kind: str, num_hosts: int | None, per_host: int | None, name: str
) -> ClusterProfile:
    """``profile`` (a ``ClusterProfile``, a ``ProfilingResultDatabase`` or the path of a
    profile file) as the ``ClusterProfile`` of ``device_kind``: the entry of that kind and
    cluster shape, else of that kind with the most devices; a clear error naming ``name``
    and what the file holds, when it has no entry of the kind."""
    from alpa.cost_profile import load_profiles, profile_key

    if isinstance(profile, ClusterProfile):
        return profile
    if isinstance(profile, str | os.PathLike):
        profiles = load_profiles(os.fspath(profile))
    elif hasattr(profile, "data") and isinstance(profile.data, dict):
        profiles = dict(profile.data)
    else:
        raise TypeError(
            f"{name} must be a ClusterProfile, a ProfilingResultDatabase or the path of a "
            f"profile file, got {type(profile).__name__} {profile!r}"
        )
    if num_hosts is not None and per_host is not None:
        exact = profiles.get(profile_key(device_kind, num_hosts, per_host))
        if exact is not None:
            return exact
    of_kind = [p for p in profiles.values() if p.device_kind == device_kind]
    if not of_kind:
        raise ValueError(
            f"{name}={profile!r} holds no profile of {device_kind!r} devices (it holds "
            f"{sorted(profiles)}); profile these devices with alpa.mesh_profiling.profile_all"
        )
    return max(of_kind, key=lambda p: p.num_hosts * p.num_devices_per_host)


def profile_in_file(
    path: str, device_kind: str | None, num_hosts: int, per_host: int, name: str
) -> ClusterProfile:
    """The profile of ``path`` for ``device_kind`` devices (``resolve_profile``), or, with
    no kind known (a cluster that is not here), the file's only profile; an error naming
    ``name`` and the file's entries otherwise."""
    if device_kind is not None:
        return resolve_profile(path, device_kind, num_hosts, per_host, name)
    from alpa.cost_profile import load_profiles

    profiles = load_profiles(path)
    if len(profiles) != 1:
        raise ValueError(
            f"{name}={path!r} holds {len(profiles)} profiles {sorted(profiles)}; a cluster "
            "that is not here is priced with a file of one profile "
            "(ClusterSpec.from_profile(path, device_kind=...) chooses among several)"
        )
    return next(iter(profiles.values()))


_GB = 1 << 30
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # Peak dense FLOP/s in fp16/bf16 tensor cores; NVLink per-direction bandwidth per GPU;
    # inter-node: one NIC per GPU (100, 200, 400 Gb/s); HBM bandwidth.
    "v100-16gb": ClusterSpec(
        1, 8, 125e12, 16 * _GB, 150e9, 12.5e9, name="v100-16gb", memory_bandwidth=900e9
    ),
    "a100-40gb": ClusterSpec(
        1, 8, 312e12, 40 * _GB, 300e9, 25e9, name="a100-40gb", memory_bandwidth=1.555e12
    ),
    "a100-80gb": ClusterSpec(
        1, 8, 312e12, 80 * _GB, 300e9, 25e9, name="a100-80gb", memory_bandwidth=2.039e12
    ),
    "h100-80gb": ClusterSpec(
        1, 8, 989e12, 80 * _GB, 450e9, 50e9, name="h100-80gb", memory_bandwidth=3.35e12
    ),
    "h200-141gb": ClusterSpec(
        1, 8, 989e12, 141 * _GB, 450e9, 50e9, name="h200-141gb", memory_bandwidth=4.8e12
    ),
    # Virtual CPU devices in one process: links priced at 10 GB/s, a rough figure; a
    # measured profile (docs/cost_model.md) replaces it.
    "cpu": ClusterSpec(
        1,
        8,
        5e10,
        2 * _GB,
        10e9,
        10e9,
        1e-5,
        1e-5,
        name="cpu",
        memory_bandwidth=20e9,
        fuses_elementwise=False,
    ),
}


# ----------------------------------------------------------------------------- logical mesh


@dataclass(frozen=True)
class LogicalDeviceMesh:
    """A 2-D view of devices with an alpha-beta communication model per axis, and the
    rates that price work on one device: ``device_flops`` (FLOP/s of contractions) and
    ``memory_bandwidth`` (bytes/s an operation writes its result at).

    ``devices`` may be ``None``: such a mesh is abstract, good for planning and cost
    queries but not for lowering. The defaults are Alpa's unit-free alpha = beta = 1 and,
    in the same units (beta = 1 per byte), rates in a GPU's proportions (an A100 does about
    1000 FLOPs and writes about 7 bytes of HBM in the time NVLink moves one byte); a mesh
    of a physical or virtual cluster takes all four from its ``ClusterSpec``. ``math.inf``
    turns a term off.

    ``rates``: where the cluster has a profile, the measured rates of this submesh
    (``cost_profile.MeshRates``; ``None`` otherwise): work and collectives are then priced
    in seconds at them, a collective of a group layout the profile lacks by alpha-beta.
    """

    shape: tuple[int, int]
    mesh_alpha: tuple[float, float] = (1.0, 1.0)
    mesh_beta: tuple[float, float] = (1.0, 1.0)
    devices: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)
    axis_names: tuple[str, str] = MESH_AXIS_NAMES
    device_flops: float = 1000.0
    memory_bandwidth: float = 10.0
    #: The physical mesh this is a view of (``PhysicalDeviceMesh.get_logical_mesh``): a
    #: method given the view runs there, also when its devices are another process's.
    physical_mesh: Any = field(default=None, compare=False, repr=False)
    rates: MeshRates | None = None

    def __post_init__(self):
        shape = tuple(self.shape)
        if len(shape) != 2 or not all(isinstance(d, int) and d >= 1 for d in shape):
            raise ValueError(f"LogicalDeviceMesh shape must be two positive ints, got {shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "mesh_alpha", tuple(float(a) for a in self.mesh_alpha))
        object.__setattr__(self, "mesh_beta", tuple(float(b) for b in self.mesh_beta))
        if len(self.mesh_alpha) != 2 or len(self.mesh_beta) != 2:
            raise ValueError("mesh_alpha and mesh_beta need one value per mesh axis (2)")
        for attr in ("device_flops", "memory_bandwidth"):
            value = getattr(self, attr)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"LogicalDeviceMesh.{attr} must be positive, got {value!r}")
            object.__setattr__(self, attr, float(value))
        if self.devices is not None:
            devices = tuple(self.devices)
            if len(devices) != math.prod(shape):
                raise ValueError(
                    f"logical mesh shape {shape} needs {math.prod(shape)} devices, "
                    f"got {len(devices)}"
                )
            object.__setattr__(self, "devices", devices)

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def __getstate__(self) -> dict:
        # A pickled view (Alpa's scripts pickle a ParallelPlan) leaves the physical mesh
        # behind: a handle of this process's devices or workers, not part of the record.
        return {**self.__dict__, "physical_mesh": None}

    @property
    def id_mesh(self) -> np.ndarray:
        return np.arange(self.num_devices).reshape(self.shape)

    # Collective costs; ``num_bytes`` is the size of the (full) value each device holds
    # or produces, ``mesh_dim`` the logical axis the collective runs over.
    def _alpha_beta(self, mesh_dim: int) -> tuple[int, float, float]:
        return self.shape[mesh_dim], self.mesh_alpha[mesh_dim], self.mesh_beta[mesh_dim]

    def _measured(self, kind: str, num_bytes: float, mesh_dim: int) -> float | None:
        if self.rates is None or self.shape[mesh_dim] == 1:
            return None
        return self.rates.collective_seconds(kind, self.shape, mesh_dim, num_bytes)

    def all_gather_cost(self, num_bytes: float, mesh_dim: int) -> float:
        measured = self._measured("all-gather", num_bytes, mesh_dim)
        if measured is not None:
            return measured
        n, alpha, beta = self._alpha_beta(mesh_dim)
        return 0.0 if n == 1 else alpha + beta * (n - 1) / n * num_bytes

    def all_reduce_cost(self, num_bytes: float, mesh_dim: int) -> float:
        measured = self._measured("all-reduce", num_bytes, mesh_dim)
        if measured is not None:
            return measured
        n, alpha, beta = self._alpha_beta(mesh_dim)
        return 0.0 if n == 1 else alpha + beta * 2 * (n - 1) / n * num_bytes

    def reduce_scatter_cost(self, num_bytes: float, mesh_dim: int) -> float:
        measured = self._measured("reduce-scatter", num_bytes, mesh_dim)
        if measured is not None:
            return measured
        n, alpha, beta = self._alpha_beta(mesh_dim)
        return 0.0 if n == 1 else alpha + beta * (n - 1) / n * num_bytes

    def all_to_all_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """Alpa's price: ``num_bytes`` is the whole tensor the axis's ``n`` devices
        exchange among them (``n`` times each device's buffer), of which each device sends
        ``(n - 1) / n**2``; Alpa's penalty of 1.5 matched it to all-to-alls measured on
        GPUs. A profile's measured curve replaces it."""
        measured = self._measured("all-to-all", num_bytes, mesh_dim)
        if measured is not None:
            return measured
        n, alpha, beta = self._alpha_beta(mesh_dim)
        return 0.0 if n == 1 else alpha + beta * (n - 1) / n / n * num_bytes * 1.5

    def collective_latency(self, kind: str, mesh_dim: int) -> float:
        """What one ``kind`` collective over ``mesh_dim`` costs whatever its bytes: the
        smallest measured message's seconds, else alpha (0 on an axis of one device)."""
        if self.shape[mesh_dim] == 1:
            return 0.0
        if self.rates is not None:
            latency = self.rates.collective_latency(kind, self.shape, mesh_dim)
            if latency is not None:
                return latency
        return self.mesh_alpha[mesh_dim]

    def with_alpha_beta(
        self, mesh_alpha: Sequence[float] | None, mesh_beta: Sequence[float] | None
    ) -> LogicalDeviceMesh:
        """This mesh with other alpha-beta parameters (``None`` keeps them), in the caller's
        units: the device rates are converted to those units, so that compute stays
        priced against the links as this mesh's hardware prices it (measured on the axis
        with the largest new beta). Explicit parameters replace a profile's measured
        rates (``rates``), which are in seconds."""
        alpha = self.mesh_alpha if mesh_alpha is None else tuple(mesh_alpha)
        beta = self.mesh_beta if mesh_beta is None else tuple(mesh_beta)
        scale = 1.0
        if len(beta) == 2 and max(beta) > 0:
            axis = int(np.argmax(beta))
            if self.mesh_beta[axis] > 0:
                scale = self.mesh_beta[axis] / beta[axis]
        if mesh_alpha is None and mesh_beta is None:
            return self
        return replace(
            self,
            mesh_alpha=alpha,
            mesh_beta=beta,
            device_flops=self.device_flops * scale,
            memory_bandwidth=self.memory_bandwidth * scale,
            rates=None,
        )

    def compute_cost(
        self,
        flops: float,
        num_bytes: float,
        dot: tuple[float, float, float, float] | None = None,
        dtype: str = "float32",
        movement: bool = False,
    ) -> float:
        """Seconds one device spends on ``flops`` of contractions and on writing
        ``num_bytes`` of results. With measured ``rates``: a contraction whose per-device
        shape ``dot = (batch, m, k, n)`` is known at the rate measured for that shape (one
        whose shape is not, at the rate of the cube of its FLOPs), the bytes at the
        measured memory-bound rate, of data movement where ``movement``
        (``cost_profile.DATA_MOVEMENT``)."""
        if self.rates is None:
            return flops / self.device_flops + num_bytes / self.memory_bandwidth
        if flops <= 0:
            work = 0.0
        elif dot is not None:
            work = self.rates.dot_seconds(*dot, dtype)
        else:
            work = self.rates.flops_seconds(flops, dtype)
        return work + self.rates.write_seconds(num_bytes, movement)

    def make_tile_spec(self, array: Any, tensor_dims: Sequence[int], mesh_dims: Sequence[int]):
        """Alpa's: the jax-0.3 ``ShardingSpec`` (``alpa.pxla_spec``) that cuts dimension
        ``tensor_dims[i]`` of ``array`` (anything with a ``shape``) over mesh axis
        ``mesh_dims[i]`` for each pair ``i`` (of the shorter list, as Alpa's ``zip``), and
        replicates it over the mesh's other axes."""
        from alpa.pxla_spec import Chunked, NoSharding, Replicated, ShardedAxis, ShardingSpec

        ndim = len(array.shape)
        tensor_dims, mesh_dims = list(tensor_dims), list(mesh_dims)
        for name, dims, bound in (("tensor_dims", tensor_dims, ndim), ("mesh_dims", mesh_dims, 2)):
            if len(set(dims)) != len(dims) or any(not 0 <= d < bound for d in dims):
                raise ValueError(
                    f"make_tile_spec: {name}={dims} must be distinct dimensions in [0, {bound})"
                )
        sharding: list[Any] = [NoSharding()] * ndim
        mapping: list[Any] = [Replicated(n) for n in self.shape]
        # As Alpa: the pairs of the shorter list (Alpa's own tests pass [0, 1] with [0]).
        for i, (tensor_dim, mesh_dim) in enumerate(zip(tensor_dims, mesh_dims, strict=False)):
            sharding[tensor_dim] = Chunked([self.shape[mesh_dim]])
            mapping[mesh_dim] = ShardedAxis(i)
        return ShardingSpec(sharding, mapping)

    def get_jax_mesh(self):
        """The ``jax.sharding.Mesh`` with Auto axes that this logical mesh lowers to."""
        if self.devices is None:
            raise ValueError("this LogicalDeviceMesh is abstract (no devices); cannot lower it")
        return make_jax_mesh(self.devices, self.shape, self.axis_names)

    def flatten(self) -> LogicalDeviceMesh:
        """Alpa's flattened mesh: the same devices as ``(n, 1)``, each axis priced with the
        largest alpha and the smallest beta of this mesh (Alpa's convention, which its
        scripts' closed-form costs assume). The planner's own 1-D view is
        :meth:`one_axis`."""
        alpha, beta = max(self.mesh_alpha), min(self.mesh_beta)
        return replace(
            self,
            shape=(self.num_devices, 1),
            mesh_alpha=(alpha, alpha),
            mesh_beta=(beta, beta),
        )

    def one_axis(self) -> LogicalDeviceMesh:
        """The same devices as a 1-D mesh ``(1, n)`` whose links are priced as this mesh's
        slowest (a ring over every device crosses it): what the planner uses for data
        parallelism over the whole mesh."""
        return replace(
            self,
            shape=(1, self.num_devices),
            mesh_alpha=(0.0, self.mesh_alpha[1]),
            mesh_beta=(0.0, max(self.mesh_beta)),
        )


def make_jax_mesh(devices: Sequence[Any], shape: Sequence[int], axis_names: Sequence[str]):
    """A ``jax.sharding.Mesh`` with ``Auto`` axes (JAX >= 0.9 defaults to Explicit)."""
    from jax.sharding import AxisType, Mesh

    devices = list(devices)
    if len(set(devices)) != len(devices):
        raise ValueError(
            f"a mesh of shape {tuple(shape)} cannot hold a device twice, got devices="
            f"{devices}; a device listed twice in devices= can host two pipeline stages "
            "(each on a submesh of its own), not two positions of one mesh"
        )
    device_array = np.asarray(devices, dtype=object).reshape(tuple(shape))
    return Mesh(device_array, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def entry_names(entry) -> tuple[str, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry (``None``, a name, or a tuple)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(names: tuple[str, ...]):
    """The ``PartitionSpec`` entry of mesh axes ``names``: the inverse of :func:`entry_names`."""
    return names if len(names) > 1 else names[0] if names else None


# ----------------------------------------------------------------------------- physical meshes


def _check_logical_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, int]:
    shape = tuple(mesh_shape)
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2 or not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ValueError(f"mesh_shape must be one or two positive ints, got {mesh_shape!r}")
    if shape[0] * shape[1] != num_devices:
        raise ValueError(
            f"mesh_shape {shape} has {shape[0] * shape[1]} devices but the physical mesh "
            f"has {num_devices}"
        )
    return shape


def _default_alpha_beta(
    cluster: ClusterSpec, shape: tuple[int, int], num_devices_per_host: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Alpha (s) and beta (s/byte) per logical axis: an axis whose devices sit on one
    host uses the intra-node link, one that spans hosts the inter-node link."""
    alphas, betas = [], []
    for axis, size in enumerate(shape):
        # Devices are laid out row-major, so axis 1 stays in a host when it fits there and
        # axis 0 steps by shape[1] devices.
        span = size if axis == 1 else size * shape[1]
        inside = span <= num_devices_per_host
        alphas.append(cluster.intra_node_latency if inside else cluster.inter_node_latency)
        bandwidth = cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth
        betas.append(1.0 / bandwidth)
    return tuple(alphas), tuple(betas)


@dataclass(frozen=True)
class VirtualPhysicalMesh:
    """A cluster of ``num_hosts x num_devices_per_host`` devices, not yet sliced."""

    num_hosts: int
    num_devices_per_host: int
    cluster: ClusterSpec | None = None

    def __post_init__(self):
        for attr in ("num_hosts", "num_devices_per_host"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{attr} must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_hosts, self.num_devices_per_host)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host

    def get_submesh_shapes(self) -> list[tuple[int, int]]:
        """(1,1), (1,2), (1,4) ... (1,M), then (2,M) ... (N,M) (paper §5.2)."""
        shapes = []
        width = 1
        while width < self.num_devices_per_host:
            shapes.append((1, width))
            width *= 2
        shapes.append((1, self.num_devices_per_host))
        shapes += [(h, self.num_devices_per_host) for h in range(2, self.num_hosts + 1)]
        return shapes

    def get_logical_mesh(
        self,
        mesh_shape: Sequence[int] | None = None,
        mesh_alpha: Sequence[float] | None = None,
        mesh_beta: Sequence[float] | None = None,
    ) -> LogicalDeviceMesh:
        cluster = self.cluster or CLUSTER_PRESETS["cpu"]
        return _logical_view(self, cluster, mesh_shape, mesh_alpha, mesh_beta, None)


def _logical_view(
    mesh, cluster: ClusterSpec, mesh_shape, mesh_alpha, mesh_beta, devices
) -> LogicalDeviceMesh:
    """The 2-D view ``mesh_shape`` (default the mesh's own shape) of a mesh of
    ``mesh.num_hosts`` x ``mesh.num_devices_per_host`` devices, with ``cluster``'s
    alpha-beta per axis unless given (in the caller's units: ``with_alpha_beta``)."""
    shape = _check_logical_shape(mesh_shape or mesh.shape, mesh.num_devices)
    alpha, beta = _default_alpha_beta(cluster, shape, mesh.num_devices_per_host)
    rates = None
    if cluster.profile is not None:
        rates = MeshRates(cluster.profile, (mesh.num_hosts, mesh.num_devices_per_host))
    hardware = LogicalDeviceMesh(
        shape,
        alpha,
        beta,
        devices=devices,
        device_flops=cluster.device_flops,
        memory_bandwidth=cluster.memory_bandwidth,
        physical_mesh=mesh if isinstance(mesh, PhysicalDeviceMesh) else None,
        rates=rates,
    )
    return hardware.with_alpha_beta(mesh_alpha or None, mesh_beta or None)


class PhysicalDeviceMesh(abc.ABC):
    """Real devices: :class:`LocalPhysicalDeviceMesh` (this process's) or
    ``alpa.runtime.ray_mesh.DistributedPhysicalDeviceMesh`` (Ray mesh workers'). Shape
    ``(num_hosts, num_devices_per_host)``."""

    num_hosts: int
    num_devices_per_host: int

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_hosts, self.num_devices_per_host)

    @property
    @abc.abstractmethod
    def host_info(self) -> list[dict]:
        """Per host, where it is (``NodeManagerAddress``, and Ray's record under Ray)."""

    @property
    @abc.abstractmethod
    def spec(self) -> ClusterSpec:
        """The hardware of this mesh (links and devices), for the cost model."""

    #: The devices a logical mesh of this mesh lowers to; ``None``: they belong to other
    #: processes (Ray mesh workers) and the logical mesh is abstract.
    logical_devices: tuple[Any, ...] | None = None

    def get_logical_mesh(
        self,
        mesh_shape: Sequence[int] | None = None,
        mesh_alpha: Sequence[float] | None = None,
        mesh_beta: Sequence[float] | None = None,
    ) -> LogicalDeviceMesh:
        """A 2-D view of the mesh (default its own shape) with alpha-beta costs per axis."""
        return _logical_view(
            self, self.spec, mesh_shape, mesh_alpha, mesh_beta, self.logical_devices
        )

    @abc.abstractmethod
    def slice_2d(
        self, host_indices: Sequence[int], device_indices: Sequence[Sequence[int]]
    ) -> PhysicalDeviceMesh:
        """The mesh of ``device_indices[i]`` of host ``host_indices[i]``, for each ``i``."""

    def shard_args_to_arrays(
        self,
        avals: Sequence[Any],
        shard_indices: Sequence[Any] | None,
        sharding_specs: Sequence[Any],
        args: Sequence[Any],
    ) -> list[Any]:
        """Alpa's: ``args[i]`` placed on this mesh as the jax-0.3 ``sharding_specs[i]``
        says (``alpa.pxla_spec``; ``shard_indices[i]`` are its per-device blocks, checked),
        as a ``jax.Array`` here or a ``DistributedArray`` on Ray workers."""
        from alpa.pxla_spec import tile_layout

        indices = [None] * len(args) if shard_indices is None else shard_indices
        out = []
        for aval, index, spec, arg in zip(avals, indices, sharding_specs, args, strict=True):
            if tuple(np.shape(arg)) != tuple(aval.shape):
                raise ValueError(f"an argument of shape {np.shape(arg)} for aval {aval}")
            out.append(self.put_tiled(arg, *tile_layout(aval, index, spec, self.num_devices)))
        return out

    @abc.abstractmethod
    def tile_placement(self, mesh_shape, axis_names, partition_spec) -> Any:
        """Where ``partition_spec`` over ``axis_names`` puts a value on this mesh's devices
        seen as ``mesh_shape`` (row-major): a ``NamedSharding`` here, a ``(mesh,
        Layout)`` pair on Ray (a ``PlacementSpec``'s placement)."""

    @abc.abstractmethod
    def put_tiled(self, value: Any, mesh_shape, axis_names, partition_spec) -> Any:
        """``value`` placed as :meth:`tile_placement` says."""

    def sync_move_workers(self) -> None:
        """Alpa's: wait for checkpoint shards moving from a local cache in the background.
        Saves here are done when they return: nothing to wait for."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free what the mesh holds."""

    # Alpa's memory statistics and synchronization (``alpa.device_memory``).

    @abc.abstractmethod
    def sync_workers(self) -> None:
        """Wait until every computation launched on the mesh's devices has finished."""

    @abc.abstractmethod
    def get_memory_allocated(self) -> int:
        """Bytes a device of the mesh holds now (the most over its devices)."""

    @abc.abstractmethod
    def get_max_memory_allocated(self) -> int:
        """The most bytes a device of the mesh held since :meth:`reset_memory_stats`."""

    @abc.abstractmethod
    def reset_memory_stats(self) -> None:
        """Start :meth:`get_max_memory_allocated` again from what is held now."""


class LocalPhysicalDeviceMesh(PhysicalDeviceMesh):
    """Devices of this process, seen as one host.

    A device may be listed more than once: each position is a slot that a pipeline stage's
    submesh can take, so ``PipeshardParallel(devices=[gpu, gpu])`` runs two stages of
    one device each on one GPU (a pipeline tried on one accelerator). One mesh cannot
    hold a device twice (:func:`make_jax_mesh` says which).
    """

    def __init__(self, devices: Sequence[Any] | None = None, cluster: ClusterSpec | None = None):
        import jax

        if isinstance(devices, str):
            raise TypeError(
                f"devices={devices!r} is a string; pass jax devices (jax.devices({devices!r})) "
                "or a mesh"
            )
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("LocalPhysicalDeviceMesh needs at least one device")
        for device in devices:
            if not isinstance(device, jax.Device):
                raise TypeError(
                    f"devices must be jax devices (from jax.devices()), got "
                    f"{type(device).__name__} {device!r}"
                )
        self.devices = tuple(devices)
        self._cluster = cluster
        self._memory = MemoryStats(lambda: self.devices)

    num_hosts = 1
    #: Alpa's mesh id: the one mesh of this process is mesh 0 of its placement specs.
    mesh_id = 0

    @property
    def num_devices_per_host(self) -> int:
        return len(self.devices)

    @property
    def cluster(self) -> ClusterSpec:
        """The hardware of these devices: the one given, else ``ClusterSpec.local()`` with
        the profile ``global_config.cluster_profile`` names at the time of asking."""
        if self._cluster is not None:
            return self._cluster
        spec = ClusterSpec.local()
        return replace(spec, num_devices_per_node=len(self.devices))

    @property
    def spec(self) -> ClusterSpec:
        return self.cluster

    @property
    def logical_devices(self) -> tuple[Any, ...]:
        return self.devices

    def slice_1d(self, start: int, stop: int) -> LocalPhysicalDeviceMesh:
        if not 0 <= start < stop <= self.num_devices:
            raise ValueError(f"cannot slice devices [{start}, {stop}) of {self.num_devices}")
        return LocalPhysicalDeviceMesh(self.devices[start:stop], self._cluster)

    @property
    def host_info(self) -> list[dict]:
        import socket

        return [{"NodeManagerAddress": socket.gethostname(), "NodeID": "local"}]

    def slice_2d(
        self, host_indices: Sequence[int], device_indices: Sequence[Sequence[int]]
    ) -> LocalPhysicalDeviceMesh:
        if list(host_indices) != [0] or len(device_indices) != 1:
            raise ValueError(
                f"a LocalPhysicalDeviceMesh has one host (0), got host_indices={host_indices}"
            )
        (indices,) = device_indices
        if not indices or any(not 0 <= i < self.num_devices for i in indices):
            raise ValueError(f"device_indices must be in [0, {self.num_devices}), got {indices}")
        return LocalPhysicalDeviceMesh([self.devices[i] for i in indices], self._cluster)

    def tile_placement(self, mesh_shape, axis_names, partition_spec) -> Any:
        from jax.sharding import NamedSharding

        mesh = make_jax_mesh(self.devices, mesh_shape, axis_names)
        return NamedSharding(mesh, partition_spec)

    def put_tiled(self, value: Any, mesh_shape, axis_names, partition_spec) -> Any:
        import jax

        return jax.device_put(value, self.tile_placement(mesh_shape, axis_names, partition_spec))

    def shutdown(self) -> None:
        """Nothing to free: the devices belong to this process."""

    def sync_workers(self) -> None:
        """Wait for every live array on the mesh's devices: the outputs of every
        computation launched on them (the mesh's "workers" are this process)."""
        import jax

        wanted = set(self.devices)
        arrays = [a for a in jax.live_arrays() if not a.is_deleted() and wanted & a.devices()]
        jax.block_until_ready(arrays)
        self._memory.observe()

    def get_memory_allocated(self) -> int:
        return self._memory.allocated()

    def get_max_memory_allocated(self) -> int:
        return self._memory.max_allocated()

    def reset_memory_stats(self) -> None:
        self._memory.reset()

    def __repr__(self) -> str:
        return f"LocalPhysicalDeviceMesh({len(self.devices)} x {self.devices[0].platform})"


# Alpa's programs import the global cluster's accessors and DistributedArray from this
# module; they live in alpa.cluster and alpa.runtime.ray_mesh, which build on this one.
_ALPA_NAMES = {
    "get_global_cluster": "alpa.cluster",
    "get_global_physical_mesh": "alpa.cluster",
    "get_global_virtual_physical_mesh": "alpa.cluster",
    "set_global_virtual_physical_mesh": "alpa.cluster",
    "DistributedArray": "alpa.runtime.ray_mesh",
    "DistributedPhysicalDeviceMesh": "alpa.runtime.ray_mesh",
    "DeviceCluster": "alpa.runtime.ray_mesh",
    "MeshHostWorker": "alpa.runtime.ray_worker",
    "ReplicatedDistributedArray": "alpa.runtime.remote_arrays",
    "RemoteArrayRef": "alpa.runtime.remote_arrays",
    "create_remote_array_refs": "alpa.runtime.remote_arrays",
    "prefetch": "alpa.runtime.ray_mesh",
}


def __getattr__(name: str):
    module = _ALPA_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'alpa.device_mesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
