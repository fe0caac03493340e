"""Small public helpers that Alpa's users call (DESIGN §9)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from alpa.global_env import global_config

# ----------------------------------------------------------------------------- HLO

_COLLECTIVE_RE = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all)"
    r"(?:-start)?\("
)
_SCALAR_SHAPE_RE = re.compile(r"^\(?\s*\w+\[\](\{[^}]*\})?\s*\)?$")


class CollectiveCounts(NamedTuple):
    total: int
    all_reduce: int
    all_gather: int
    reduce_scatter: int
    all_to_all: int


def count_communication_primitives(
    hlo_text: str, ignore_scalar_all_reduce: bool = False
) -> CollectiveCounts:
    """Count collective operations in HLO text.

    Returns ``(total, all_reduce, all_gather, reduce_scatter, all_to_all)``. An operation
    that XLA merged over a tuple of tensors counts once; an async ``-start``/``-done`` pair
    counts once (only the start is counted). With ``ignore_scalar_all_reduce``, all-reduces
    of one scalar (a loss, a global norm) are not counted.
    """
    counts = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_RE.search(line)
        if match is None or line.lstrip().startswith("ROOT %tuple"):
            continue
        op = match.group("op")
        if (
            ignore_scalar_all_reduce
            and op == "all-reduce"
            and _SCALAR_SHAPE_RE.match(match.group("shape").strip())
        ):
            continue
        counts[op] += 1
    return CollectiveCounts(
        sum(counts.values()),
        counts["all-reduce"],
        counts["all-gather"],
        counts["reduce-scatter"],
        counts["all-to-all"],
    )


def collective_shapes(hlo_text: str, op: str) -> list[str]:
    """The result shapes (``"f32[512,64]"``) of every ``op`` collective in HLO text, where
    ``op`` is ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"`` or ``"all-to-all"``;
    a tuple collective (XLA's merged gradient all-reduce) gives each element's shape."""
    shapes = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_RE.search(line)
        if match is not None and match.group("op") == op:
            shapes += _ARRAY_SHAPE_RE.findall(match.group("shape"))
    return shapes


_ARRAY_SHAPE_RE = re.compile(r"[a-z]+\d*\[[\d,]*\]")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEE_RE = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations)=\{?(?P<names>%?[\w.\-]+"
    r"(?:,\s*%?[\w.\-]+)*)\}?"
)


def _split_computations(hlo_text: str) -> dict[str, list[str]]:
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and not line.startswith(" "):
            current = header.group("name")
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    return computations


def count_loop_communication_primitives(hlo_text: str) -> CollectiveCounts:
    """Like :func:`count_communication_primitives`, counting only the collectives that run
    inside the body of a ``while`` loop (e.g. once per micro-batch)."""
    computations = _split_computations(hlo_text)
    pending = [
        m.group(1)
        for line in hlo_text.splitlines()
        if " while(" in line
        for m in [re.search(r"body=%?([\w.\-]+)", line)]
        if m
    ]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            for match in _CALLEE_RE.finditer(line):
                pending += [n.strip().lstrip("%") for n in match.group("names").split(",")]
    body_text = "\n".join(line for name in sorted(seen) for line in computations[name])
    return count_communication_primitives(body_text)


# ----------------------------------------------------------------------------- progress


def disable_tqdm_globally() -> None:
    """Turn off alpa's progress bars (``global_config.use_tqdm``)."""
    global_config.use_tqdm = False


def progress(iterable: Iterable, **kwargs) -> Iterable:
    """``tqdm(iterable)`` when progress bars are on, else the iterable itself."""
    if not global_config.use_tqdm:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


# ----------------------------------------------------------------------------- threads


def map_on_threads(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int | None = None, name: str = "alpa"
) -> list[Any]:
    """``[fn(x) for x in items]``, ``workers`` at a time on threads (default: one per CPU;
    in this thread when that is one). For work that leaves the GIL part of the time, such
    as the auto-sharding ILPs: CBC solves in its own process."""
    workers = min(len(items), workers or os.cpu_count() or 1)
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        return list(pool.map(fn, items))


# ----------------------------------------------------------------------------- benchmarks


def benchmark_func(
    run_func: Callable[[], Any],
    sync_func: Callable[[], Any] | None = None,
    warmup: int = 1,
    repeat: int = 3,
    number: int = 5,
    min_repeat_second: float | None = None,
) -> np.ndarray:
    """Seconds per call of ``run_func``: ``repeat`` measurements, each the mean of
    ``number`` calls, after ``warmup`` calls. ``sync_func`` waits for the device. With
    ``min_repeat_second``, ``number`` grows so each measurement lasts at least that long."""
    sync = sync_func or (lambda: None)
    for _ in range(warmup):
        run_func()
    sync()
    if min_repeat_second:
        tic = time.perf_counter()
        run_func()
        sync()
        one = max(time.perf_counter() - tic, 1e-9)
        number = max(number, int(np.ceil(min_repeat_second / one)))
    costs = []
    for _ in range(repeat):
        tic = time.perf_counter()
        for _ in range(number):
            run_func()
        sync()
        costs.append((time.perf_counter() - tic) / number)
    return np.array(costs)


def compute_gpt_tflops(
    batch_size: int,
    seq_len: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    num_gpus: int,
    latency: float,
    backward: bool = True,
    checkpoint_activations: bool = False,
) -> float:
    """Achieved TFLOP/s per device of a GPT step.

    FLOPs of one forward pass over ``B`` sequences of ``s`` tokens (dense matmuls, 2 FLOPs
    per multiply-add): per layer, QKV and output projections ``8Bsh^2``, the MLP ``16Bsh^2``
    and attention scores plus the weighted sum ``4Bs^2h``, i.e. ``24Bsh^2 (1 + s/(6h))``;
    the LM head ``2BshV``. The backward pass costs twice the forward pass, activation
    checkpointing one more forward pass.
    """
    forward = (
        24 * batch_size * seq_len * hidden_size**2 * num_layers * (1 + seq_len / (6 * hidden_size))
        + 2 * batch_size * seq_len * hidden_size * vocab_size
    )
    passes = 1 + (2 if backward else 0) + (1 if checkpoint_activations else 0)
    return forward * passes / latency / num_gpus / 1e12


def compute_param_number(pytree: Any) -> int:
    """Number of scalars in all array leaves of ``pytree``."""
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(pytree)))


def map_to_shape(pytree: Any) -> Any:
    """The pytree with every leaf replaced by its shape (``None`` for a leaf without one)."""
    return jax.tree.map(lambda x: getattr(x, "shape", None), pytree)


def map_to_nparray(pytree: Any) -> Any:
    """The pytree with every array (jax, numpy or ``DistributedArray``) as a numpy array,
    fetched in one round per Ray mesh worker; other leaves unchanged."""
    from alpa.runtime.ray_mesh import prefetch

    leaves = jax.tree.leaves(pytree)
    prefetch(leaves)
    return jax.tree.map(lambda x: np.asarray(x) if hasattr(x, "__array__") else x, pytree)


def get_shard_shape(aval: Any, sharding: Any) -> tuple[int, ...]:
    """The shape of one device's shard of a value of ``aval``'s shape under ``sharding``
    (a ``jax.sharding.Sharding``, e.g. from ``executable.get_input_placement_specs()``'s
    mesh and spec through ``NamedSharding``)."""
    return tuple(sharding.shard_shape(tuple(aval.shape)))


# ----------------------------------------------------------------------------- benchmarks
# Alpa's benchmark scripts import these from alpa.util: results as TSV lines, rounded
# strings, and the per-iteration costs a timer recorded.

GB = 1 << 30


def write_tsv(heads: Sequence[str], values: Sequence[Any], filename, print_line: bool = True):
    """Append ``values`` as one tab-separated line to ``filename``; with ``print_line``,
    also print ``head: value`` pairs."""
    if len(heads) != len(values):
        raise ValueError(f"write_tsv got {len(heads)} heads but {len(values)} values")
    cells = [str(v) for v in values]
    with open(filename, "a", encoding="utf-8") as out:
        out.write("\t".join(cells) + "\n")
    if print_line:
        print("  ".join(f"{h}: {c}" for h, c in zip(heads, cells, strict=True)))


def to_str_round(x: Any, decimal: int = 6) -> str:
    """``x`` (a number, string, or nested list / tuple / array of them) as a string with
    floats rounded to ``decimal`` places."""
    if isinstance(x, str):
        return x
    if isinstance(x, list | tuple | np.ndarray):
        return "[" + ", ".join(to_str_round(y, decimal) for y in x) + "]"
    if isinstance(x, dict):
        return str({k: to_str_round(v, decimal) for k, v in x.items()})
    if isinstance(x, int | np.integer):
        return str(x)
    if isinstance(x, float | np.floating):
        return f"{x:.{decimal}f}"
    raise TypeError(f"to_str_round: cannot format {x!r} ({type(x).__name__})")


_last_print_time = [time.time()]


def print_used_time(message: str) -> None:
    """Print the seconds since the previous call (the first: since alpa.util's import);
    Alpa's coarse progress timer."""
    now = time.time()
    print(f"{message}: {now - _last_print_time[0]:.2f} s")
    _last_print_time[0] = now


def get_execution_time_costs(
    warmup: int = 2, timer_name: str = "overall", return_all_costs: bool = False
) -> list[float]:
    """The seconds each measured interval of timer ``timer_name`` took (``alpa.timers``),
    without the first ``warmup`` ones unless ``return_all_costs``."""
    from alpa.timer import timers

    if timer_name not in timers:
        raise KeyError(
            f"no timer named {timer_name!r}; the timers are {', '.join(timers.names()) or 'none'}"
        )
    costs = list(timers(timer_name).costs)
    return costs if return_all_costs else costs[warmup:]
