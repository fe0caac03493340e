"""MoE suites: Alpa's GShard-MoE benchmark sizes (OSDI 2022, Fig. 7b), and a tiny CPU suite.

Keys are numbers of devices. Sizes, batch sizes, micro-batches, layer numbers and the stage
plans of ``perf_test_solution`` are those of Alpa's ``suite_manual_moe.py`` and
``suite_auto_moe.py`` (plans found on AWS p3.16xlarge). As in Alpa's MoE benchmark, the
experts' hidden layer is ``8 * hidden_size`` wide, embeddings are not tied, and the expert
group size is cut to the tokens of one micro-batch when that is smaller.

* ``perf_test_fast_2d``: few-layer models, one stage, ``dp x op`` meshes (``UniformArgs``).
* ``perf_test_auto``: the weak-scaling series 380M..70B on 1..64 devices, stages chosen by
  the stage DP (``SearchArgs``).
* ``perf_test_solution``: the same cases with Alpa's stage plans (``SolutionArgs``), with
  fine-grained rematerialization as in Alpa's MoE runs.
* ``grid_search_auto``: the search over micro-batches and layer numbers.
* ``cpu_test``: a 4-layer, 8-expert model for 8 virtual CPU devices, one case per mode.
"""

from __future__ import annotations

import benchmark_case
from benchmark_case import (
    FORCE_DP,
    BenchmarkCase,
    MoEModelConfig,
    SolutionArgs,
    Suite,
    UniformArgs,
)

moe_specs: dict[str, MoEModelConfig] = {
    #                      S,    H,    L,  heads, V,    E,   S_
    "380M": MoEModelConfig(1024, 768, 8, 16, 32000, 8, 2048),
    "690M": MoEModelConfig(1024, 768, 8, 16, 32000, 16, 2048),
    "1.3B": MoEModelConfig(1024, 768, 16, 16, 32000, 16, 2048),
    "2.4B": MoEModelConfig(1024, 1024, 16, 16, 32000, 16, 2048),
    "10B": MoEModelConfig(1024, 1536, 16, 16, 32000, 32, 2048),
    "27B": MoEModelConfig(1024, 2048, 16, 16, 32000, 48, 2048),
    "70B": MoEModelConfig(1024, 2048, 32, 16, 32000, 64, 2048),
    "140B": MoEModelConfig(1024, 2048, 32, 16, 32000, 128, 2048),
}

max_global_batch_size = 1024


def search_cases(model: str, num_micro_batches: list[int], layer_nums: list[int]):
    return benchmark_case.search_cases(
        moe_specs[model], max_global_batch_size, num_micro_batches, layer_nums
    )


perf_test_fast_2d: Suite = {
    1: [
        BenchmarkCase(8, MoEModelConfig(1024, 1024, 8, 32, 25600, 8, 1024), 1, UniformArgs(1, 1, 1))
    ],
    8: [
        BenchmarkCase(
            16,
            MoEModelConfig(1024, 1024, 4, 32, 25600, 32, 1024),
            1,
            UniformArgs(dp, op, 1, prefer_reduce_scatter=False, force_batch_dim_mapping=False),
        )
        for dp, op in ((8, 1), (4, 2), (2, 4))
    ],
}

_halves = [[0, 1, 2, 3], [4, 5, 6, 7]]
_eighths = [[i] for i in range(8)]


def _plan(*stages) -> SolutionArgs:
    """A stage plan of Alpa's MoE suite, which rematerializes at a fine grain."""
    return SolutionArgs(*stages, remat_mode="fine_grained_remat")


# (model, micro-batches, Alpa's plan) per number of devices.
_solutions: dict[int, tuple[str, int, SolutionArgs]] = {
    1: ("380M", 512, _plan(1, [[0]], [(1, 1)], [(1, 1)], [{}])),
    2: ("690M", 32, _plan(8, [list(range(8))], [(1, 2)], [(2, 1)], [FORCE_DP])),
    4: ("1.3B", 32, _plan(8, _halves, [(1, 2)] * 2, [(2, 1)] * 2, [FORCE_DP] * 2)),
    8: ("2.4B", 32, _plan(8, _halves, [(1, 4)] * 2, [(4, 1)] * 2, [FORCE_DP] * 2)),
    16: ("10B", 16, _plan(8, _halves, [(1, 8)] * 2, [(8, 1)] * 2, [{}] * 2)),
    32: ("27B", 128, _plan(8, _eighths, [(1, 4)] * 8, [(4, 1)] * 8, [{}] * 8)),
    64: ("70B", 64, _plan(8, _eighths, [(1, 8)] * 8, [(8, 1)] * 8, [{}] * 8)),
}

perf_test_solution: Suite = {
    n: [BenchmarkCase(max_global_batch_size, moe_specs[model], micro_batches, solution)]
    for n, (model, micro_batches, solution) in _solutions.items()
}

perf_test_auto: Suite = {
    n: search_cases(model, [micro_batches], [solution.layer_num])
    for n, (model, micro_batches, solution) in _solutions.items()
}

grid_search_auto: Suite = {
    2: search_cases("690M", [16, 32, 64], [8]),
    4: search_cases("1.3B", [16, 32, 64], [8]),
    8: search_cases("2.4B", [16, 32, 64], [8]),
    16: search_cases("10B", [16, 32, 64], [8]),
    32: search_cases("27B", [32, 64, 128], [4, 8, 16]),
    64: search_cases("70B", [64], [8, 16, 32]),
}

_tiny = MoEModelConfig(
    seq_len=64,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    vocab_size=1024,
    num_experts=8,
    expert_group_size=64,
    dtype="float32",
)

cpu_test: Suite = {8: benchmark_case.transformer_cpu_cases(_tiny)}
