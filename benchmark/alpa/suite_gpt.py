"""GPT suites: Alpa's GPT benchmark sizes (OSDI 2022, Fig. 7a), and a tiny CPU suite.

Keys are numbers of devices. The model sizes, batch sizes, micro-batches, layer numbers and
the stage plans of ``perf_test_solution`` are those of Alpa's ``suite_manual_gpt.py`` and
``suite_auto_gpt.py`` (plans the search found on AWS p3.16xlarge, 8 V100s per node).

* ``perf_test_fast_2d``: 4-layer models, one stage, ``dp x op`` meshes (``UniformArgs``).
* ``perf_test_manual``: fixed data x operator x pipeline degrees (``UniformArgs``).
* ``perf_test_auto``: the weak-scaling series 350M..39B on 1..64 devices, layers clustered
  and stages chosen by the stage DP (``SearchArgs``).
* ``perf_test_solution``: the same cases with Alpa's published stage plans
  (``SolutionArgs``), to compare with the search.
* ``grid_search_auto``: the search over micro-batches and layer numbers.
* ``cpu_test``: a 4-layer GPT small enough for 8 virtual CPU devices, one case per mode.
"""

from __future__ import annotations

import benchmark_case
from benchmark_case import (
    FORCE_DP,
    BenchmarkCase,
    GPTModelConfig,
    SolutionArgs,
    Suite,
    UniformArgs,
)

gpt_specs: dict[str, GPTModelConfig] = {
    #                     S,    H,     L,  heads, V
    "125M": GPTModelConfig(1024, 768, 12, 12, 51200),
    "350M": GPTModelConfig(1024, 1024, 24, 16, 51200),
    "760M": GPTModelConfig(1024, 1536, 24, 16, 51200),
    "1.3B": GPTModelConfig(1024, 2048, 24, 32, 51200),
    "2.6B": GPTModelConfig(1024, 2560, 32, 32, 51200),
    "6.7B": GPTModelConfig(1024, 4096, 32, 32, 51200),
    "15B": GPTModelConfig(1024, 5120, 48, 40, 51200),
    "39B": GPTModelConfig(1024, 8192, 48, 64, 51200),
    "76B": GPTModelConfig(1024, 10240, 60, 80, 51200),
}

max_global_batch_size = 1024


def search_cases(model: str, num_micro_batches: list[int], layer_nums: list[int]):
    return benchmark_case.search_cases(
        gpt_specs[model], max_global_batch_size, num_micro_batches, layer_nums
    )


def solution_case(model: str, num_micro_batches: int, solution: SolutionArgs) -> BenchmarkCase:
    return BenchmarkCase(max_global_batch_size, gpt_specs[model], num_micro_batches, solution)


perf_test_fast_2d: Suite = {
    1: [
        BenchmarkCase(
            8,
            GPTModelConfig(1024, 1024, 4, 32, 51200),
            1,
            UniformArgs(1, 1, 1, prefer_reduce_scatter=False),
        )
    ],
    8: [
        BenchmarkCase(16, GPTModelConfig(1024, 8192, 4, 32, 51200), 1, UniformArgs(dp, op, 1))
        for dp, op in ((1, 8), (2, 4), (8, 1))
    ],
}

perf_test_manual: Suite = {
    1: [BenchmarkCase(16, gpt_specs["350M"], 1, UniformArgs(1, 1, 1))],
    8: [
        BenchmarkCase(32, gpt_specs["2.6B"], 4, UniformArgs(2, 2, 2, force_batch_dim_mapping=False))
    ],
}

# (model, micro-batches, Alpa's plan) per number of devices.
_solutions: dict[int, tuple[str, int, SolutionArgs]] = {
    1: ("350M", 512, SolutionArgs(1, [[0]], [(1, 1)], [(1, 1)], [{}])),
    2: (
        "760M",
        128,
        SolutionArgs(6, [[0, 1, 2], [3, 4, 5]], [(1, 1)] * 2, [(1, 1)] * 2, [FORCE_DP] * 2),
    ),
    4: (
        "1.3B",
        128,
        SolutionArgs(6, [[0, 1, 2], [3, 4, 5]], [(1, 2)] * 2, [(2, 1)] * 2, [FORCE_DP] * 2),
    ),
    8: (
        "2.6B",
        128,
        SolutionArgs(
            8,
            [[0, 1], [2, 3], [4, 5, 6, 7]],
            [(1, 2), (1, 2), (1, 4)],
            [(2, 1), (2, 1), (4, 1)],
            [FORCE_DP, {}, {}],
        ),
    ),
    16: (
        "6.7B",
        64,
        SolutionArgs(8, [[0, 1, 2, 3], [4, 5, 6, 7]], [(1, 8)] * 2, [(2, 4)] * 2, [FORCE_DP] * 2),
    ),
    32: (
        "15B",
        128,
        SolutionArgs(
            16,
            [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            [(1, 8)] * 4,
            [(2, 4)] * 4,
            [FORCE_DP] * 4,
        ),
    ),
    64: (
        "39B",
        1024,
        SolutionArgs(16, [[i] for i in range(16)], [(1, 4)] * 16, [(1, 4)] * 16, [FORCE_DP] * 16),
    ),
}

perf_test_solution: Suite = {
    n: [solution_case(model, micro_batches, solution)]
    for n, (model, micro_batches, solution) in _solutions.items()
}

perf_test_auto: Suite = {
    n: search_cases(model, [micro_batches], [solution.layer_num])
    for n, (model, micro_batches, solution) in _solutions.items()
}

grid_search_auto: Suite = {
    2: search_cases("760M", [32, 64, 128, 256], [6]) + search_cases("760M", [32, 64], [12]),
    4: search_cases("1.3B", [32, 64, 128], [6]) + search_cases("1.3B", [32, 64], [12]),
    8: search_cases("2.6B", [64, 128, 256], [8]) + search_cases("2.6B", [64, 128], [16]),
    16: search_cases("6.7B", [32, 64, 128, 256], [8]),
    32: search_cases("15B", [64, 128, 256, 512], [16]),
    64: search_cases("39B", [128, 256, 512, 1024], [8]),
}

_tiny = GPTModelConfig(
    seq_len=64, hidden_size=128, num_layers=4, num_heads=4, vocab_size=1024, dtype="float32"
)

cpu_test: Suite = {8: benchmark_case.transformer_cpu_cases(_tiny)}
