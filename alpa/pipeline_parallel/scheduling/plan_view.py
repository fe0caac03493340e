"""Pictures of a pipeline plan: the cluster's devices coloured by stage, and the schedule
as a timeline (stages x time) with its bubbles.

The timeline is the schedule run with each stage's predicted latency per micro-batch
(``StagePlan.latencies`` for automatic stages, the analytic model's
``PipeshardPlan.cost.latencies`` for the others): the forward takes ``forward_share`` of
it and the backward the rest (1/3 and 2/3, the FLOP ratio of a backward to a forward),
halved between ``B`` and ``W`` where a zero-bubble schedule splits it, and every task
starts as soon as its stage is free and the tasks it reads from
(``schedules.task_dependencies``) have ended, in the schedule's order. Apply-grad is not
priced by the stage model; it is drawn as a narrow block after each stage's last
backward, so that the picture shows where it runs, not how long.

``timeline`` is pure; ``draw`` needs matplotlib (``pip install alpa[plot]``) and writes a
PNG or an SVG, by the path's extension. ``PipeshardPlan.draw(path)`` and
``python -m alpa.plan_view plan.json out.png`` call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule, Task
from alpa.pipeline_parallel.scheduling.schedules import task_dependencies

# Width of an apply-grad block, as a fraction of its stage's latency (it is not priced).
APPLY_WIDTH = 0.05


@dataclass(frozen=True)
class Block:
    """One task of the timeline: ``stage`` runs ``kind`` on ``micro_batch`` from ``start``
    to ``end`` (seconds, or latency units), on ``mesh`` (``None``: the stage's own, where
    every mesh runs one stage)."""

    stage: int
    kind: str
    micro_batch: int | None
    start: float
    end: float
    mesh: int | None = None

    @property
    def row(self) -> int:
        """The timeline row it is drawn in: its mesh."""
        return self.stage if self.mesh is None else self.mesh


@dataclass(frozen=True)
class Drawing:
    """What :func:`draw` wrote: the file, its size in pixels, the blocks it drew by kind
    (counted from the figure's artists) and the timeline's length."""

    path: str
    width_px: int
    height_px: int
    blocks: dict
    devices: int
    makespan: float


def timeline(
    schedule: PipelineSchedule, latencies: Sequence[float], forward_share: float = 1 / 3
) -> list[Block]:
    """The blocks of ``schedule`` run with ``latencies[s]`` per micro-batch on stage ``s``
    (module docstring), in the schedule's order."""
    if len(latencies) != schedule.num_stages:
        raise ValueError(
            f"latencies has {len(latencies)} entries but the schedule has "
            f"{schedule.num_stages} stages"
        )
    if not 0 < forward_share < 1:
        raise ValueError(f"forward_share must be in (0, 1), got {forward_share!r}")
    several = bool(schedule.stage_meshes)
    free = [0.0] * schedule.num_meshes  # a mesh runs one task at a time
    ends: dict[Task, float] = {}
    blocks = []
    split = schedule.split_stages()  # the backward in B and W halves
    for task in schedule.tasks():
        s = task.stage
        latency = float(latencies[s])
        if task.kind == "forward":
            duration = forward_share * latency
        elif task.kind in ("backward", "weight"):
            duration = (1 - forward_share) * latency / (2 if s in split else 1)
        else:
            duration = APPLY_WIDTH * latency
        ready = max((ends[d] for d in task_dependencies(task, schedule.num_stages)), default=0.0)
        m = schedule.mesh_of(s)
        start = max(free[m], ready)
        ends[task] = free[m] = start + duration
        mesh = m if several else None
        blocks.append(Block(s, task.kind, task.micro_batch, start, start + duration, mesh))
    return blocks


_KIND_COLOURS = {
    "forward": "#4c8bd6",
    "backward": "#e0823d",
    "weight": "#c9a227",
    "apply": "#5aa469",
    "transfer": "#9a9a9a",
}


def draw(
    path: str,
    schedule: PipelineSchedule,
    latencies: Sequence[float],
    device_ranges: Sequence[Sequence[int]],
    num_hosts: int,
    num_devices_per_host: int,
    title: str = "",
    unit: str = "s",
    logical_shapes: Sequence[Sequence[int]] = (),
    dpi: int = 100,
) -> Drawing:
    """Write the picture of a plan to ``path`` (``.png`` or ``.svg``): left, the cluster's
    ``num_hosts x num_devices_per_host`` devices, each coloured by the stage whose
    ``device_ranges[s] = [start, stop)`` holds it; right, :func:`timeline`. ``unit`` names
    the time axis (``"s"``; ``"latency units"`` where no latency was recorded)."""
    blocks = timeline(schedule, latencies)
    heading = (
        f"{schedule.name}: {schedule.num_stages} stages x "
        f"{schedule.num_micro_batches} micro-batches"
    )
    if schedule.stage_meshes:
        heading += f" on {schedule.num_meshes} meshes"
    return draw_blocks(
        path,
        blocks,
        schedule.num_meshes,
        device_ranges,
        num_hosts,
        num_devices_per_host,
        title=title,
        heading=heading,
        unit=unit,
        logical_shapes=logical_shapes,
        dpi=dpi,
        label_micro_batches=schedule.num_stages * schedule.num_micro_batches <= 256,
    )


def draw_blocks(
    path: str,
    blocks: Sequence[Block],
    num_rows: int,
    device_ranges: Sequence[Sequence[int]],
    num_hosts: int,
    num_devices_per_host: int,
    title: str = "",
    heading: str = "",
    unit: str = "s",
    logical_shapes: Sequence[Sequence[int]] = (),
    dpi: int = 100,
    label_micro_batches: bool = True,
) -> Drawing:
    """:func:`draw` of any ``blocks`` (a planned :func:`timeline` or a measured run's):
    kinds ``forward``, ``backward``, ``weight``, ``apply`` and, for a run, ``transfer``
    (loads, reshards, allocations), in ``num_rows`` rows (``Block.row``: a stage, or a
    mesh where the schedule places several stages on one)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as e:  # pragma: no cover - the optional extra
        raise ImportError(
            "drawing a plan needs matplotlib: pip install 'alpa[plot]' (or matplotlib)"
        ) from e
    if not str(path).lower().endswith((".png", ".svg")):
        raise ValueError(f"path must end in .png or .svg, got {path!r}")
    makespan = max((b.end for b in blocks), default=0.0)
    S = num_rows
    several = any(b.mesh is not None for b in blocks)
    stage_colours = plt.get_cmap("tab20")
    fig, (devices_ax, time_ax) = plt.subplots(
        1,
        2,
        figsize=(12, 1.2 + 0.5 * max(S, num_hosts)),
        gridspec_kw={"width_ratios": [1, 3]},
    )
    drawn: dict[str, int] = {}
    devices = 0
    # Coloured by mesh: stages that share one (interleaved 1F1B, DualPipeV) share its devices.
    for s, (start, stop) in enumerate(dict.fromkeys(tuple(r) for r in device_ranges)):
        for d in range(start, stop):
            host, local = divmod(d, num_devices_per_host)
            cell = Rectangle(
                (local, num_hosts - 1 - host), 0.9, 0.9, color=stage_colours(s % 20), gid="device"
            )
            devices_ax.add_patch(cell)
            devices_ax.text(
                local + 0.45, num_hosts - 0.55 - host, str(s), ha="center", va="center", fontsize=7
            )
            devices += 1
    devices_ax.set_xlim(0, num_devices_per_host)
    devices_ax.set_ylim(0, num_hosts)
    devices_ax.set_aspect("equal")
    devices_ax.set_xticks([])
    devices_ax.set_yticks([])
    shapes = "".join(
        f"\nstage {s}: {tuple(r)} logical {tuple(shape)}"
        for s, (r, shape) in enumerate(zip(device_ranges, logical_shapes, strict=False))
    )
    devices_ax.set_title(f"{num_hosts} x {num_devices_per_host} devices", fontsize=9)
    if shapes:
        devices_ax.set_xlabel(shapes.strip(), fontsize=7)
    for b in blocks:
        rect = Rectangle(
            (b.start, S - 1 - b.row + 0.1),
            b.end - b.start,
            0.8,
            facecolor=_KIND_COLOURS[b.kind],
            edgecolor="white",
            linewidth=0.5,
            gid=f"task-{b.kind}",
        )
        time_ax.add_patch(rect)
        drawn[b.kind] = drawn.get(b.kind, 0) + 1
        if b.micro_batch is not None and label_micro_batches and b.kind != "transfer":
            time_ax.text(
                (b.start + b.end) / 2,
                S - 1 - b.row + 0.5,
                f"{b.micro_batch}:{b.stage}" if several else str(b.micro_batch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    time_ax.set_xlim(0, makespan * 1.01 or 1.0)
    time_ax.set_ylim(0, S)
    row_name = "mesh" if several else "stage"
    time_ax.set_yticks([S - 1 - s + 0.5 for s in range(S)], [f"{row_name} {s}" for s in range(S)])
    time_ax.set_xlabel(f"time ({unit}); step {makespan:.4g} {unit}")
    busy = sum(b.end - b.start for b in blocks)
    bubble = 1 - busy / (S * makespan) if makespan else 0.0
    weight = ", W gold" if any(b.kind == "weight" for b in blocks) else ""
    time_ax.set_title(
        f"{heading}, bubble {bubble:.0%} (F blue, B orange{weight}, apply green, transfers grey)",
        fontsize=9,
    )
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    width, height = (int(round(x * dpi)) for x in fig.get_size_inches())
    counted = {kind: sum(p.get_gid() == f"task-{kind}" for p in time_ax.patches) for kind in drawn}
    plt.close(fig)
    return Drawing(str(path), width, height, counted, devices, makespan)
