"""Wide-ResNet suites: Alpa's WResNet benchmark sizes (OSDI 2022, Fig. 7c), and a tiny CPU
suite.

Keys are numbers of devices. Sizes, batch sizes, micro-batches, layer numbers (16 for the
16 residual blocks of a 50-layer net, 33 for 101 layers) and the stage plans of
``perf_test_solution`` are those of Alpa's ``suite_wresnet.py`` (plans found on AWS
p3.16xlarge). The names are Alpa's; the parameter counts differ, because the bottleneck
block of ``alpa.model.wide_resnet`` widens its first 1x1 convolution too (WRN-50-2 as
published, 68.9M parameters), where Alpa's widened only the 3x3 one. The benchmark reports
the count of the model it ran.

* ``perf_test_2d``: one mesh, data parallel (``ShardArgs``).
* ``perf_test_auto``: the weak-scaling series on 1..64 devices, stages chosen by the stage
  DP (``SearchArgs``).
* ``perf_test_solution``: the same cases with Alpa's stage plans (``SolutionArgs``).
* ``grid_search_auto``: the search over micro-batches.
* ``cpu_test``: a 10-layer net on 32x32 images for 8 virtual CPU devices, one case per
  mode but ``uniform`` (the model marks no block boundaries).
"""

from __future__ import annotations

from benchmark_case import (
    FORCE_DP,
    BenchmarkCase,
    SearchArgs,
    ShardArgs,
    SolutionArgs,
    Suite,
    WResNetModelConfig,
)

wresnet_specs: dict[str, WResNetModelConfig] = {
    #                          I,   L,   C,   W
    "250M": WResNetModelConfig(224, 50, 160, 2),
    "500M": WResNetModelConfig(224, 50, 224, 2),
    "1B": WResNetModelConfig(224, 50, 320, 2),
    "2B": WResNetModelConfig(224, 50, 448, 2),
    "4B": WResNetModelConfig(224, 50, 640, 2),
    "6.8B": WResNetModelConfig(224, 50, 320, 16),
    "13B": WResNetModelConfig(224, 101, 320, 16),
}

#: Alpa's search space for WResNet.
auto_stage_option = {
    "submesh_physical_shape_space": "small_power_of_two",
    "submesh_logical_shape_space": "single_node_model_parallel",
}


def num_auto_layers(model: str) -> int:
    """The number of residual blocks: one layer per block."""
    return {50: 16, 101: 33}[wresnet_specs[model].num_layers]


def search_cases(model: str, batch_size: int, num_micro_batches: list[int]):
    return [
        BenchmarkCase(
            batch_size,
            wresnet_specs[model],
            micro_batches,
            SearchArgs(num_auto_layers(model), auto_stage_option),
        )
        for micro_batches in num_micro_batches
    ]


def solution_case(model, batch_size, num_micro_batches, stage_layer_ids, physical, logical, dicts):
    solution = SolutionArgs(num_auto_layers(model), stage_layer_ids, physical, logical, dicts)
    return BenchmarkCase(batch_size, wresnet_specs[model], num_micro_batches, solution)


perf_test_2d: Suite = {
    1: [
        BenchmarkCase(32, wresnet_specs["250M"], 1, ShardArgs((1, 1))),
        BenchmarkCase(1536, wresnet_specs["250M"], 48, ShardArgs((1, 1))),
    ],
    4: [
        BenchmarkCase(32, wresnet_specs["1B"], 1, ShardArgs((4, 1))),
        BenchmarkCase(1536, wresnet_specs["1B"], 48, ShardArgs((4, 1))),
        BenchmarkCase(64, wresnet_specs["1B"], 1, ShardArgs((4, 1))),
        BenchmarkCase(1536, wresnet_specs["1B"], 24, ShardArgs((4, 1))),
    ],
    8: [BenchmarkCase(64, wresnet_specs["1B"], 1, ShardArgs((8, 1)))],
}

_all16 = [list(range(16))]

perf_test_solution: Suite = {
    1: [solution_case("250M", 1536, 24, _all16, [(1, 1)], [(1, 1)], [{}])],
    2: [solution_case("500M", 1536, 24, _all16, [(1, 2)], [(1, 2)], [{}])],
    4: [solution_case("1B", 1536, 24, _all16, [(1, 4)], [(1, 4)], [{}])],
    8: [
        solution_case(
            "2B",
            1536,
            24,
            [list(range(8)), list(range(8, 16))],
            [(1, 4), (1, 4)],
            [(4, 1), (1, 4)],
            [{}, FORCE_DP],
        )
    ],
    16: [
        solution_case(
            "4B",
            1536,
            32,
            [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]],
            [(1, 4), (1, 4), (1, 8)],
            [(4, 1), (4, 1), (8, 1)],
            [FORCE_DP, FORCE_DP, {}],
        )
    ],
    32: [
        solution_case(
            "6.8B",
            1536,
            32,
            [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]],
            [(1, 8)] * 4,
            [(8, 1)] * 4,
            [FORCE_DP, {}, {}, {}],
        )
    ],
    64: [
        solution_case(
            "13B",
            1520,
            38,
            [
                [0, 1, 2, 3],
                [4, 5, 6, 7],
                [8, 9, 10, 11],
                [12, 13, 14, 15],
                [16, 17, 18, 19],
                [20, 21, 22, 23],
                [24, 25, 26, 27, 28],
                [29, 30, 31, 32],
            ],
            [(1, 8)] * 8,
            [(8, 1), (1, 8), (8, 1), (1, 8), (8, 1), (8, 1), (1, 8), (8, 1)],
            [{}, FORCE_DP, {}, FORCE_DP, {}, {}, FORCE_DP, {}],
        )
    ],
}

perf_test_auto: Suite = {
    n: [
        BenchmarkCase(
            case.batch_size,
            case.model_config,
            case.num_micro_batches,
            SearchArgs(case.parallel_args.layer_num, auto_stage_option),
        )
        for case in cases
    ]
    for n, cases in perf_test_solution.items()
}

grid_search_auto: Suite = {
    1: search_cases("250M", 1536, [24, 32]),
    2: search_cases("500M", 1536, [24, 32]),
    4: search_cases("1B", 1536, [24, 32]),
    8: search_cases("2B", 1536, [24, 32]),
    16: search_cases("4B", 1536, [24, 32]),
    32: search_cases("6.8B", 1520, [38]) + search_cases("6.8B", 1512, [42]),
    64: search_cases("13B", 1520, [38]),
}

_tiny = WResNetModelConfig(
    image_size=32, num_layers=10, num_channels=8, width_factor=2, num_classes=10
)

cpu_test: Suite = {
    8: [
        BenchmarkCase(32, _tiny, 2, ShardArgs((8, 1))),
        BenchmarkCase(
            32,
            _tiny,
            2,
            SolutionArgs(4, [[0, 1], [2, 3]], [(1, 4)] * 2, [(4, 1), (1, 4)], [FORCE_DP, {}]),
        ),
        BenchmarkCase(32, _tiny, 2, SearchArgs(4, remat_mode="none")),
    ],
}
