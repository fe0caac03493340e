"""Small public helpers that Alpa's users call (``docs/design.md``, Helpers Alpa's users call)."""

from __future__ import annotations

import math
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


#: The name scope of the gradients' once-per-step reduction
#: (``shard_parallel.packed_collectives.reduce_partials``): its collectives carry it in their
#: HLO metadata.
GRAD_SYNC_SCOPE = "alpa_grad_sync"


def grad_sync_channel_ids(hlo_text: str) -> str:
    """Alpa's ``executable.grad_sync_channel_ids``: the channel ids of the collectives that
    reduce the step's gradients once per step (those the lowering emits under
    :data:`GRAD_SYNC_SCOPE`, which XLA keeps in each op's metadata), written
    ``".1.4."``; ``""`` when the gradients are reduced by XLA's partitioner (not deferred
    to the marker) or there are none."""
    ids = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_RE.search(line)
        if match is None or match.group("op") not in ("all-reduce", "reduce-scatter"):
            continue
        channel = re.search(r"channel_id=(\d+)", line)
        if channel and f"/{GRAD_SYNC_SCOPE}/" in line and channel.group(1) not in ids:
            ids.append(channel.group(1))
    return "." + ".".join(ids) + "." if ids else ""


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


def count_micro_batch_communication(
    program_texts: dict[str, str],
) -> tuple[CollectiveCounts, CollectiveCounts, CollectiveCounts]:
    """``(per_micro_batch, per_step, layout)``: the collectives of a micro-batched
    one-mesh step (``MeshExecutable.get_program_texts()``, a program per part) that run in
    every micro-batch (the ``accumulate`` program's), the further ones that run once per
    step (``accumulate_last``'s beyond ``accumulate``'s, and ``apply``'s), and those of
    the batch's change of layout into micro-batches (``prepare``'s)."""
    count = {name: count_communication_primitives(text) for name, text in program_texts.items()}
    zero = CollectiveCounts(0, 0, 0, 0, 0)
    per_micro_batch = count.get("accumulate", zero)
    per_step = CollectiveCounts(
        *(
            last - each + after
            for last, each, after in zip(
                count["accumulate_last"], per_micro_batch, count["apply"], strict=True
            )
        )
    )
    return per_micro_batch, per_step, count["prepare"]


def replica_groups(line: str) -> frozenset[frozenset[int]]:
    """The replica groups (device ids) of one HLO collective, in any of XLA's three
    spellings: explicit (``{{0,2},{1,3}}``), iota (``[2,2]<=[2,2]T(1,0)``) and mesh
    axes (``mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``)."""
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        groups = re.findall(r"\{([\d,]*)\}", explicit.group(1))
        return frozenset(frozenset(int(d) for d in g.split(",") if d) for g in groups)
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        rows = ids.reshape(shape).reshape(shape[0], -1)
        return frozenset(frozenset(int(d) for d in row) for row in rows)
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", line
    )
    if mesh:
        axes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))]
        names, sizes = [a for a, _ in axes], [n for _, n in axes]
        ids = np.arange(int(np.prod(sizes)))
        if mesh.group(2):  # the devices at the mesh's positions, as an iota or a list
            perm = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", mesh.group(2))
            if perm:
                ids = ids.reshape([int(d) for d in perm.group(1).split(",")])
                if perm.group(2):
                    ids = ids.transpose([int(d) for d in perm.group(2).split(",")])
            else:
                ids = np.array([int(d) for d in mesh.group(2).split(",")])
        ids = ids.reshape(sizes)
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(3))]
        kept = [i for i in range(len(names)) if i not in reduced]
        size = int(np.prod([sizes[i] for i in reduced]))
        rows = ids.transpose(kept + reduced).reshape(-1, size)
        return frozenset(frozenset(int(d) for d in row) for row in rows)
    raise ValueError(f"no replica groups in {line!r}")


_BYTES_COLLECTIVE_RE = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?P<start>-start)?\("
)
_TYPED_SHAPE_RE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "c64": 8, "c128": 16}


def _shape_bytes(shapes: list[tuple[str, str]]) -> int:
    total = 0
    for dtype, dims in shapes:
        itemsize = _ITEMSIZE.get(dtype) or int(re.sub(r"\D", "", dtype) or 8) // 8
        total += math.prod(int(d) for d in dims.split(",") if d) * itemsize
    return total


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per device of the collectives in HLO text, by kind: ``all-reduce``,
    ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``.

    The convention is the cost model's (``sharding_spec.Collective``): an all-reduce
    counts the buffer it reduces, an all-gather the result it gathers, a reduce-scatter
    the operand it scatters (its result times the group size), an all-to-all the tensor
    its group exchanges (its buffer times the group size), a collective-permute the buffer
    it sends. A tuple collective (XLA's combined reductions) counts each element; a
    collective over groups of one device moves nothing and is not counted. Each collective
    counts once where it appears in the text: one in a loop body counts once, not once per
    trip."""
    total = dict.fromkeys(
        ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"), 0
    )
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    for line in hlo_text.splitlines():
        match = _BYTES_COLLECTIVE_RE.search(line)
        if match is None:
            continue
        op, shapes = match.group("op"), _TYPED_SHAPE_RE.findall(match.group("shape"))
        if match.group("start") and op in ("all-gather", "collective-permute"):
            # (operands, results[, contexts]): an all-gather's results are the second half,
            # a permute's operand the first element.
            arrays = [s for s in shapes if s[0] not in ("u32", "s32") or s[1]]
            shapes = arrays[len(arrays) // 2 :] if op == "all-gather" else arrays[:1]
        if op == "collective-permute":
            if "source_target_pairs={}" in line:
                continue
            total[op] += _shape_bytes(shapes)
            continue
        groups = replica_groups(line) if "replica_groups=" in line else ()
        size = max((len(g) for g in groups), default=0)
        if not size:  # one group of every device
            if op in ("reduce-scatter", "all-to-all") and partitions is None:
                raise ValueError(f"a {op} over an unknown group size: {line!r}")
            size = int(partitions.group(1)) if partitions else 0
        if size == 1:
            continue
        nbytes = _shape_bytes(shapes)
        total[op] += nbytes * size if op in ("reduce-scatter", "all-to-all") else nbytes
    return total


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
    if x is None:
        return "None"
    raise TypeError(f"to_str_round: cannot format {x!r} ({type(x).__name__})")


_last_print_time = [time.time()]


def print_used_time(message: str | None) -> None:
    """Alpa's coarse progress timer: print ``" - {message}: {s:.2f} s"``, the seconds since
    the previous call (the first: since alpa.util's import), and restart it; with
    ``message=None``, only restart it."""
    now = time.time()
    if message:
        print(f" - {message}: {now - _last_print_time[0]:.2f} s")
    _last_print_time[0] = now


def get_num_hosts_and_num_devices(args: Any) -> tuple[int, int]:
    """``(num_hosts, num_devices_per_host)`` of Alpa's benchmark scripts, from their parsed
    command line ``args``: ``args.num_hosts`` and ``args.num_devices_per_host`` when given
    (both, or neither); else with ``args.local``, one host and this process's devices; else
    the cluster of ``alpa.init("ray")``, or the Ray cluster (``ray.init(address="auto")``
    unless Ray is initialized): its alive nodes, each with its GPUs, or on CPU-only nodes
    the virtual devices a Ray mesh gives a node by default
    (``alpa.runtime.ray_mesh.DEFAULT_CPU_DEVICES_PER_NODE``)."""
    num_hosts = getattr(args, "num_hosts", None)
    per_host = getattr(args, "num_devices_per_host", None)
    if (num_hosts is None) != (per_host is None):
        raise ValueError(
            f"num_hosts={num_hosts!r} and num_devices_per_host={per_host!r}: give both or "
            "neither (neither: they are read off the cluster)"
        )
    if num_hosts is not None:
        return int(num_hosts), int(per_host)
    if getattr(args, "local", False):
        return 1, len(jax.local_devices())
    import ray

    from alpa.cluster import get_ray_cluster
    from alpa.runtime.ray_mesh import DEFAULT_CPU_DEVICES_PER_NODE

    cluster = get_ray_cluster()
    if cluster is not None:  # alpa.init("ray") decided them
        return cluster.num_hosts, cluster.num_devices_per_host
    if not ray.is_initialized():
        ray.init(address="auto")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
    if nodes and all(gpus):
        return len(nodes), min(gpus)
    return len(nodes), DEFAULT_CPU_DEVICES_PER_NODE


def get_metrics(device_metrics: Sequence[Any]) -> Any:
    """Alpa's ``get_metrics``: a list of per-step metric pytrees (arrays, or
    ``DistributedArray`` s a step on Ray returned) fetched to the driver in one round
    (``alpa.prefetch``) and stacked leaf by leaf into one pytree of numpy arrays with a
    leading step axis, as ``flax.training.common_utils.get_metrics`` does for ``pmap``."""
    from alpa.runtime.ray_mesh import prefetch

    device_metrics = list(device_metrics)
    if not device_metrics:
        raise ValueError("get_metrics: device_metrics is empty; expected one pytree per step")
    prefetch(device_metrics)
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *device_metrics)


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


# ----------------------------------------------------------------------------- warnings


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called from inside alpa that names the
    first frame outside the ``alpa`` package: the user's line, however deep in alpa the
    warning is raised and whichever entry (``__call__``, ``plan()``, ``lower()``) led to
    it."""
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # the caller of this function: warn's level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def forward_to(module: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` that read every name from ``module``
    (imported now): what the modules at Alpa's import paths are, so that a script
    written for Alpa imports from there the objects alpa's own code uses."""
    import importlib

    real = importlib.import_module(module)

    def getattr_(name: str) -> Any:
        return getattr(real, name)

    def dir_() -> list[str]:
        return dir(real)

    return getattr_, dir_
