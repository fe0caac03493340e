"""A stage's seconds at a cluster profile's measured rates, and a pipeline's bounds.

Without a profile the stage model prices a stage's work as its FLOPs at the device's
peak (``stage_cost``'s module docstring). With one (``ClusterSpec.profile``), every term
is priced at what was measured on the cluster (``cost_profile``):

.. math::  t(i, j, m, c) = \\sum_{l=i}^{j} \\Big(W_l(m, c)\\,(1 + r\\,\\phi_l) + K_l(m, c)
           + \\frac{G_l(m, c) + A_l(m, c)}{B}\\Big) + [i > 0]\\,2\\,X(x_i) + h\\,I_i

with :math:`W_l` the seconds one device spends on layer ``l``'s forward and backward under
its ILP plan (each equation at the measured rate of its per-device shape: the ILP's own
compute term, ``ilp_solver.compute_cost``), :math:`\\phi_l` the forward's share of its
FLOPs (recomputed under remat), :math:`K_l` and :math:`G_l` the plan's collectives from
the measured curves, :math:`A_l` its apply-grad (the optimizer's update of its
parameters, at the memory-bound rate, on the share of the parameters a device holds),
run once per step, :math:`X` the measured cross-mesh transfer of the :math:`x_i` bytes
entering the stage (forward, and its cotangent back), :math:`h` the driver's measured
seconds per pipeline instruction and :math:`I_i` the stage's instructions per
micro-batch (its forward and backward ``RUN``, and its two transfers when it is not the
first).

A step's time is the schedule's (the stage DP's :math:`\\sum t + (B - 1)\\max t`, or the
timeline's makespan) but never less than two floors (:class:`StepBound`):

* **the host's cores**: devices that share a host's cores (virtual CPU devices) do not
  run stages side by side at their solo speed. A stage of :math:`n_s` devices prices its
  work at the concurrency of :math:`n_s` devices (``ClusterProfile.concurrency``); while
  :math:`D` devices of the host work at once, each runs at :math:`g(D)` instead of
  :math:`g(n_s)`. :func:`shared_makespan` runs the schedule so, task by task (processor
  sharing); its total work, :math:`B \\sum_s \\frac{n_s}{N} t_s \\frac{g(n_s)}{g(N)}`
  (:func:`host_bound`), is what the stage search also minimises where devices share a
  host. For GPUs, which own their compute, :math:`g = 1` and the floor is the schedule's
  own time;
* **the driver**: the local runtime's driver dispatches every instruction of the step
  in turn, :math:`h` seconds each.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from jax.extend.core import JaxprEqn

from alpa.cost_profile import DATA_MOVEMENT, ClusterProfile
from alpa.device_mesh import ClusterSpec, LogicalDeviceMesh
from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule
from alpa.pipeline_parallel.scheduling.schedules import make_schedule, task_dependencies
from alpa.shard_parallel.strategies.strategy_costs import contraction_flops, itemsize, operand_dtype
from alpa.tracing.jaxpr_util import is_var


def equations_seconds(
    eqns: Iterable[JaxprEqn], mesh: LogicalDeviceMesh, share: Callable[[object], float]
) -> float:
    """Seconds one device of ``mesh`` spends on ``eqns``, each equation's work (its
    contraction FLOPs and the bytes it writes) taken at ``share(first result)`` of its
    whole (``1 / n`` for a value split over ``n`` devices)."""
    total = 0.0
    for eqn in eqns:
        outs = [v for v in eqn.outvars if is_var(v)]
        if not outs:
            continue
        part = share(outs[0])
        written = sum(_nbytes(v) for v in outs) * part
        flops = contraction_flops(eqn) * part
        movement = eqn.primitive.name in DATA_MOVEMENT
        total += mesh.compute_cost(flops, written, None, operand_dtype(eqn), movement)
    return total


def _nbytes(v) -> float:
    shape = getattr(v.aval, "shape", ())
    size = 1
    for d in shape:
        size *= d
    return float(size * itemsize(v.aval))


def instructions_per_micro_batch(first: bool) -> int:
    """A stage's instructions per micro-batch: its forward and backward ``RUN`` and,
    unless it is the first stage, the transfer of what enters it and of its cotangent
    back."""
    return 2 if first else 4


def estimated_instructions(num_stages: int, num_micro_batches: int) -> int:
    """A step's instructions: each stage's per micro-batch
    (:func:`instructions_per_micro_batch`) and one apply-grad ``RUN`` per stage."""
    micro = max(1, num_micro_batches)
    per_micro = sum(instructions_per_micro_batch(s == 0) for s in range(num_stages))
    return micro * per_micro + num_stages


def host_bound(
    profile: ClusterProfile,
    latencies: Sequence[float],
    submesh_shapes: Sequence[tuple[int, int]],
    num_micro_batches: int,
    busy_devices: int,
) -> float:
    """The step's time at the host's throughput (module docstring): the stages'
    device-seconds at the concurrency of all ``busy_devices`` (the plan's devices,
    stages sharing a mesh counted once), spread over those devices."""
    per_host = max(1, min(profile.num_devices_per_host, busy_devices))
    full = profile.concurrency_factor(per_host)
    work = 0.0
    for t, (hosts, devices) in zip(latencies, submesh_shapes, strict=True):
        work += hosts * devices * t * profile.concurrency_factor(devices) / full
    return max(1, num_micro_batches) * work / max(1, busy_devices)


def host_work_table(profile: ClusterProfile, latencies, submesh_choices) -> np.ndarray:
    """Per stage-DP entry ``[i, j, m, c]``, its share of :func:`host_bound` per
    micro-batch on a host whose devices all work: ``n_m t g(n_m) / (N g(N))`` for a
    stage of ``n_m`` devices and latency ``t``, ``N`` the host's devices. Their sum over
    a plan's stages is the host's floor of its step divided by the micro-batches, what the
    stage search minimises as well where devices share a host."""
    per_host = profile.num_devices_per_host
    full = profile.concurrency_factor(per_host)
    scale = np.array(
        [h * d * profile.concurrency_factor(d) / (full * per_host * h) for h, d in submesh_choices]
    )
    return np.asarray(latencies, dtype=float) * scale[None, None, :, None]


def shared_makespan(
    profile: ClusterProfile,
    schedule: PipelineSchedule,
    latencies: Sequence[float],
    mesh_devices: Sequence[int],
    forward_share: float = 1 / 3,
) -> float:
    """Seconds of ``schedule`` (apply-grad left out) when its meshes share a host's cores
    (module docstring): the tasks run in each mesh's order as soon as their inputs are
    ready, as ``plan_view.timeline`` runs them, but a task of a stage of ``n`` devices
    whose latency was priced with only its own mesh at work runs at ``g(D) / g(n)`` of
    that speed while ``D`` devices of the host work at once (``g`` the profile's
    concurrency, of matmuls and memory-bound work alike: their mean). With ``g = 1``
    (devices that own their compute) this is the timeline's makespan."""
    per_host = profile.num_devices_per_host

    def g(k: int) -> float:
        k = max(1, min(k, per_host))
        return 0.5 * (profile.concurrency_factor(k) + profile.concurrency_factor(k, True))

    S = schedule.num_stages
    split = schedule.split_stages()
    tasks = [t for t in schedule.tasks() if t.kind != "apply"]
    present = set(tasks)
    queues: dict[int, collections.deque] = {
        m: collections.deque() for m in range(schedule.num_meshes)
    }
    for task in tasks:
        queues[schedule.mesh_of(task.stage)].append(task)
    done: set = set()
    running: dict[int, list] = {}  # mesh -> [task, seconds left at its own speed]
    now = 0.0
    while True:
        for m, queue in queues.items():
            if m in running or not queue:
                continue
            task = queue[0]
            if all(d in done for d in task_dependencies(task, S) if d in present):
                queue.popleft()
                latency = float(latencies[task.stage])
                if task.kind == "forward":
                    work = forward_share * latency
                else:
                    work = (1 - forward_share) * latency / (2 if task.stage in split else 1)
                running[m] = [task, work]
        if not running:
            if any(queues.values()):
                raise ValueError(f"schedule {schedule.name} cannot proceed: a task waits forever")
            return now
        busy = sum(mesh_devices[m] for m in running)
        speed = {m: g(busy) / g(mesh_devices[m]) for m in running}
        step = min(left / speed[m] for m, (_, left) in running.items())
        now += step
        for m in list(running):
            running[m][1] -= step * speed[m]
            if running[m][1] <= 1e-15:
                done.add(running[m][0])
                del running[m]


@dataclass(frozen=True)
class StepBound:
    """A plan's step time raised to the host's and the driver's bounds (module
    docstring): ``bound(schedule_seconds)``. Without a cluster profile, the identity."""

    cluster: ClusterSpec
    latencies: tuple[float, ...]
    submesh_shapes: tuple[tuple[int, int], ...]
    num_micro_batches: int
    busy_devices: int
    schedule: PipelineSchedule | None = None

    def __call__(self, schedule_seconds: float, schedule: PipelineSchedule | None = None) -> float:
        profile = self.cluster.profile
        if profile is None or not self.latencies:
            return schedule_seconds
        schedule = schedule or self.schedule
        if schedule is None:
            schedule = make_schedule("1f1b", len(self.latencies), self.num_micro_batches)
        devices = [0] * schedule.num_meshes
        for s, (_, per) in enumerate(self.submesh_shapes):
            devices[schedule.mesh_of(s)] = per  # a host's devices of the stage's mesh
        shared = shared_makespan(profile, schedule, self.latencies, devices)
        instructions = estimated_instructions(len(self.latencies), self.num_micro_batches)
        return max(schedule_seconds, shared, profile.instruction_seconds * instructions)


def step_bound(
    cluster: ClusterSpec,
    latencies: Sequence[float],
    submesh_shapes: Sequence[Sequence[int]],
    num_micro_batches: int,
    busy_devices: int | None = None,
    schedule: PipelineSchedule | None = None,
) -> StepBound:
    """The :class:`StepBound` of stages of ``latencies`` on ``submesh_shapes`` under
    ``schedule`` (default 1F1B, a stage per mesh); the devices busy default to the
    stages' (each stage on a mesh of its own)."""
    shapes = tuple((int(h), int(d)) for h, d in submesh_shapes)
    busy = busy_devices if busy_devices is not None else sum(h * d for h, d in shapes)
    return StepBound(cluster, tuple(latencies), shapes, num_micro_batches, busy, schedule)
