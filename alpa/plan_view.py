"""``python -m alpa.plan_view plan.json out.png``: the picture of a saved pipeline plan
(``executable.get_parallel_plan().save("plan.json")``): the cluster's devices coloured
by stage and the schedule as a timeline (``pipeline_parallel/scheduling/plan_view.py``). Needs
matplotlib (``pip install alpa[plot]``)."""

from __future__ import annotations

import argparse
import sys

from alpa.pipeline_parallel.scheduling.plan_view import Drawing, draw
from alpa.pipeline_parallel.scheduling.schedules import make_schedule
from alpa.record.parallel_plan import ParallelPlan


def draw_saved_plan(plan_path: str, out_path: str, dpi: int = 100) -> Drawing:
    """Draw the pipeline plan saved at ``plan_path`` into ``out_path``."""
    plan = ParallelPlan.load(plan_path)
    if plan.pipeline_plan is None:
        raise ValueError(
            f"{plan_path} is a one-mesh plan ({plan.method}); plan_view draws pipeline plans"
        )
    decisions = plan.pipeline_plan.decisions
    stages = decisions.stage_plan
    schedule = make_schedule(
        plan.pipeline_plan.pipeline_schedule,
        stages.num_stages,
        plan.num_micro_batches or 1,
        stages.num_meshes,
    )
    latencies, unit = stages.latencies, "s"
    if latencies is None:  # manual or uniform stages record no latency
        latencies, unit = [1.0] * stages.num_stages, "stage latencies (none recorded)"
    return draw(
        out_path,
        schedule,
        latencies,
        stages.device_ranges,
        plan.cluster_info.num_hosts,
        plan.cluster_info.num_devices_per_host,
        title=f"{plan.step_name} ({plan.method})",
        unit=unit,
        logical_shapes=[tuple(m.shape) for m in decisions.logical_meshes],
        dpi=dpi,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpa.plan_view", description=__doc__)
    parser.add_argument("plan", help="a plan saved by ParallelPlan.save (JSON)")
    parser.add_argument("out", help="the picture to write: .png or .svg")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        drawing = draw_saved_plan(args.plan, args.out, args.dpi)
    except (ValueError, OSError) as e:
        print(f"plan_view: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {drawing.path} ({drawing.width_px}x{drawing.height_px} px): "
        f"{drawing.devices} devices, blocks {drawing.blocks}, "
        f"timeline {drawing.makespan:.4g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
