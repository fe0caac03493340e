"""A wider sweep of the kill test of tests/test_serialization.py: re-saves of a step
killed with SIGKILL at every rename and at many timed offsets, each followed by a
bit-exact restore (tests/killed_save.py does the save and the kill).

    python benchmark/alpa/checkpoint_kills.py [--offsets 24] [--max-s 0.5]

Writes ``benchmark/alpa/results/checkpoint_kills.json`` and prints how many kills landed
inside the save and how many steps were lost (a step lost fails the run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offsets", type=int, default=24)
    parser.add_argument("--max-s", type=float, default=0.5)
    parser.add_argument(
        "--output",
        default=os.path.join(os.path.dirname(__file__), "results", "checkpoint_kills.json"),
    )
    args = parser.parse_args()

    import killed_save

    import alpa

    root = tempfile.mkdtemp(prefix="alpa_kills_")
    ckpt = os.path.join(root, "ckpt")
    kills = [("op", at) for at in range(1, 6)]
    kills += [("time", round(float(t), 3)) for t in np.linspace(0.0, args.max_s, args.offsets)]
    runs, lost = [], 0
    try:
        for seed, (mode, at) in enumerate(kills, start=1):
            alpa.save_checkpoint(ckpt, killed_save.state(1000 + seed), 1)
            code = killed_save.run(ckpt, 1, seed, mode, at)
            in_save = code != 0 and any(n != "checkpoint_1" for n in os.listdir(ckpt))
            try:
                new = killed_save.restored_seed(ckpt, 1, {1000 + seed, seed}) == seed
                outcome = "new" if new else "old"
            except Exception as e:  # a lost or unreadable step: what must never happen
                outcome, lost = f"lost: {type(e).__name__}: {e}", lost + 1
            runs.append(
                {
                    "mode": mode,
                    "at": at,
                    "killed": code != 0,
                    "in_save": in_save,
                    "outcome": outcome,
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "kills": sum(r["killed"] for r in runs),
        "in_save": sum(r["in_save"] for r in runs),
        "outcomes": dict(collections.Counter(r["outcome"][:4] for r in runs)),
        "steps_lost": lost,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=1)
    print(
        f"{len(runs)} saves, {summary['kills']} killed, {summary['in_save']} while the save "
        f"had files out; outcomes {summary['outcomes']}; steps lost: {lost}"
    )
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    main()
