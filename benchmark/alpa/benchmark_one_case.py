"""Run one benchmark case: build the model, parallelize its train step, compile, time, measure.

A case (``benchmark_case.BenchmarkCase``) goes through five steps:

1. **Method.** The case's parallel arguments become an alpa parallel method (the table in
   ``benchmark_case``); a method that does not fit the cluster fails here, before any
   model is built.
2. **Model.** The train state (flax, optax adam, parameters in float32, computation in the
   model's ``dtype``) and a batch of synthetic data, from the factories of ``alpa.model``,
   with ``alpa.value_and_grad`` so that the step can be micro-batched and pipelined
   (``init_s``).
3. **Compile.** ``parallelize(step, method).get_executable(state, batch)``: trace, plan,
   XLA compilation (``compile_s``).
4. **Time.** ``alpa.util.benchmark_func``: ``warmup`` steps, then ``niter`` measurements of
   one step each, every step waited for (``latencies_s``).
5. **Measure.** Parameters (``alpa.util.compute_param_number``), TFLOP/s per device, the
   peak memory of every mesh (``executable.get_peak_memory_per_mesh()``, bytes per device)
   and the plan that ran.

**FLOPs.** GPT: Alpa's closed form, ``alpa.util.compute_gpt_tflops`` (dense matmuls,
backward = 2x forward). MoE and Wide-ResNet have no closed form in ``alpa.util``: their FLOPs
are those of the serial train step traced at the full batch size, counted by
``alpa.tracing.flops.jaxpr_flops`` (exact for ``dot_general`` and convolutions, one FLOP per
element of the largest operand for every other equation, so the router, the one-hot
dispatch and combine einsums, batch normalization and the optimizer count too).
``tflops`` never counts recomputation; ``tflops_ckpt`` adds one forward pass when the case
rematerializes, a third of forward + backward (the ratio ``compute_gpt_tflops`` assumes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from benchmark_case import (
    BenchmarkCase,
    GPTModelConfig,
    MoEModelConfig,
    SearchArgs,
    ShardArgs,
    SolutionArgs,
    UniformArgs,
    WResNetModelConfig,
)

import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.moe import MoEConfig, get_moe_train_state_and_step
from alpa.model.wide_resnet import (
    WIDE_RESNET_DEPTHS,
    WResNetConfig,
    get_wresnet_train_state_and_step,
)
from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption, submesh_shape
from alpa.tracing.flops import jaxpr_flops
from alpa.util import benchmark_func, compute_gpt_tflops, compute_param_number

OPTIMIZER = "adam"

# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Workload:
    """A model's train state, batch and step, and its TFLOP/s per device:
    ``tflops(latency_s, num_devices, checkpoint_activations)``."""

    state: Any
    batch: Mapping[str, jax.Array]
    train_step: Callable
    tflops: Callable[[float, int, bool], float]
    flops_source: str


def _counted_tflops(step_flops: float) -> Callable[[float, int, bool], float]:
    def tflops(latency: float, num_devices: int, checkpoint_activations: bool) -> float:
        flops = step_flops * (4 / 3 if checkpoint_activations else 1)
        return flops / latency / num_devices / 1e12

    return tflops


def _serial_step_flops(factory: Callable, config: Any, batch_size: int) -> float:
    """``jaxpr_flops`` of the unparallelized step on abstract inputs (nothing allocated)."""
    state, batch, step = factory(config, batch_size, optimizer=OPTIMIZER, abstract=True)
    return jaxpr_flops(jax.make_jaxpr(step)(state, batch).jaxpr.eqns)


def _gpt(config: GPTModelConfig, batch_size: int, num_micro_batches: int, markers: bool):
    gpt = GPTConfig(
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        dtype=jnp.dtype(config.dtype),
        add_manual_pipeline_markers=markers,
    )
    state, batch, step = get_gpt_train_state_and_step(
        gpt, batch_size, optimizer=OPTIMIZER, grad_func=alpa.value_and_grad
    )

    def tflops(latency: float, num_devices: int, checkpoint_activations: bool) -> float:
        return compute_gpt_tflops(
            batch_size,
            config.seq_len,
            config.num_layers,
            config.hidden_size,
            config.vocab_size,
            num_devices,
            latency,
            checkpoint_activations=checkpoint_activations,
        )

    return Workload(state, batch, step, tflops, "alpa.util.compute_gpt_tflops")


def _moe(config: MoEModelConfig, batch_size: int, num_micro_batches: int, markers: bool):
    # Alpa's MoE benchmark: 8x wide experts, untied embeddings, and groups no larger than
    # the tokens of one micro-batch.
    tokens_per_micro_batch = batch_size * config.seq_len // num_micro_batches
    moe = MoEConfig(
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_experts=config.num_experts,
        intermediate_size=8 * config.hidden_size,
        expert_group_size=min(config.expert_group_size, tokens_per_micro_batch),
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        tie_word_embeddings=False,
        dtype=jnp.dtype(config.dtype),
        add_manual_pipeline_markers=markers,
    )
    state, batch, step = get_moe_train_state_and_step(
        moe, batch_size, optimizer=OPTIMIZER, grad_func=alpa.value_and_grad
    )
    unmarked = dataclasses.replace(moe, add_manual_pipeline_markers=False)
    flops = _serial_step_flops(get_moe_train_state_and_step, unmarked, batch_size)
    return Workload(state, batch, step, _counted_tflops(flops), "alpa.tracing.flops.jaxpr_flops")


#: ResNet depth -> (residual blocks per stage, block kind): the layouts of He et al. (2016)
#: as Alpa's ``get_wide_resnet`` names them, and 10 layers (one basic block per stage) for
#: quick runs on CPU.
WRESNET_LAYOUTS: dict[int, tuple[tuple[int, ...], str]] = {
    10: ((1, 1, 1, 1), "basic"),
    **{depth: layout for depth, layout in WIDE_RESNET_DEPTHS.items() if depth},
}


def _wresnet(config: WResNetModelConfig, batch_size: int, num_micro_batches: int, markers: bool):
    if markers:
        raise ValueError(
            "UniformArgs cuts the model at its block boundaries, and alpa.model.wide_resnet "
            "marks none: run Wide-ResNet with SolutionArgs, SearchArgs or ShardArgs"
        )
    if config.num_layers not in WRESNET_LAYOUTS:
        raise ValueError(
            f"WResNetModelConfig.num_layers={config.num_layers}: expected one of "
            f"{sorted(WRESNET_LAYOUTS)}"
        )
    stage_sizes, block = WRESNET_LAYOUTS[config.num_layers]
    wresnet = WResNetConfig(
        stage_sizes,
        num_filters=config.num_channels,
        width_factor=config.width_factor,
        num_classes=config.num_classes,
        image_size=config.image_size,
        block=block,
        imagenet_stem=True,
        dtype=jnp.dtype(config.dtype),
    )
    state, batch, step = get_wresnet_train_state_and_step(
        wresnet, batch_size, optimizer=OPTIMIZER, grad_func=alpa.value_and_grad
    )
    flops = _serial_step_flops(get_wresnet_train_state_and_step, wresnet, batch_size)
    return Workload(state, batch, step, _counted_tflops(flops), "alpa.tracing.flops.jaxpr_flops")


@dataclass(frozen=True)
class ModelFamily:
    """A model family's name in result rows, and its workload builder
    ``build(config, batch_size, num_micro_batches, markers)``; ``markers`` asks for a
    pipeline boundary after every block."""

    name: str
    build: Callable[[Any, int, int, bool], Workload]


MODEL_FAMILIES: dict[type, ModelFamily] = {
    GPTModelConfig: ModelFamily("gpt", _gpt),
    MoEModelConfig: ModelFamily("moe", _moe),
    WResNetModelConfig: ModelFamily("wresnet", _wresnet),
}

# ----------------------------------------------------------------------------- methods


def _sharding_option(
    prefer_reduce_scatter: bool, force_batch_dim_mapping: bool = False, **fields: Any
) -> alpa.AutoShardingOption:
    return alpa.AutoShardingOption(
        prefer_reduce_scatter=prefer_reduce_scatter,
        force_batch_dim_to_mesh_dim=0 if force_batch_dim_mapping else None,
        **fields,
    )


def _shard_method(args: ShardArgs, num_micro_batches: int, num_hosts: int, per_host: int):
    option = _sharding_option(
        args.prefer_reduce_scatter,
        args.force_batch_dim_mapping,
        logical_mesh_shape=tuple(args.logical_mesh_shape),
    )
    return alpa.ShardParallel(num_micro_batches=num_micro_batches, auto_sharding_option=option)


def _uniform_method(args: UniformArgs, num_micro_batches: int, num_hosts: int, per_host: int):
    num_devices = num_hosts * per_host
    if args.dp * args.op * args.pp != num_devices:
        raise ValueError(
            f"UniformArgs(dp={args.dp}, op={args.op}, pp={args.pp}) needs "
            f"{args.dp * args.op * args.pp} devices, the cluster has {num_devices}"
        )
    physical = submesh_shape(args.dp * args.op, per_host)
    return alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        default_auto_sharding_option=_sharding_option(
            args.prefer_reduce_scatter, args.force_batch_dim_mapping
        ),
        layer_option=alpa.ManualLayerOption(remat_layer=args.use_remat),
        stage_option=alpa.UniformStageOption(
            num_stages=args.pp,
            submesh_physical_shape=physical,
            submesh_logical_shape=(args.dp, args.op),
        ),
    )


def _auto_layer_method(args: SolutionArgs | SearchArgs, num_micro_batches: int, stage_option):
    return alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        default_auto_sharding_option=_sharding_option(args.prefer_reduce_scatter),
        layer_option=alpa.AutoLayerOption(layer_num=args.layer_num, remat_mode=args.remat_mode),
        stage_option=stage_option,
    )


def _solution_method(args: SolutionArgs, num_micro_batches: int, num_hosts: int, per_host: int):
    stage_option = alpa.ManualStageOption(
        forward_stage_layer_ids=args.forward_stage_layer_ids,
        submesh_physical_shapes=args.submesh_physical_shapes,
        submesh_logical_shapes=args.submesh_logical_shapes,
        submesh_autosharding_option_dicts=[dict(d) for d in args.submesh_autosharding_option_dicts],
    )
    return _auto_layer_method(args, num_micro_batches, stage_option)


def _search_method(args: SearchArgs, num_micro_batches: int, num_hosts: int, per_host: int):
    stage_option = AutoStageOption(**args.auto_stage_option)
    return _auto_layer_method(args, num_micro_batches, stage_option)


def _shard_plan(executable) -> dict:
    return {
        "logical_mesh_shape": list(executable.plan.logical_mesh.shape),
        "ilp_objective": executable.auto_sharding_objective,
    }


def _pipeshard_plan(executable) -> dict:
    summary = executable.plan.summary()
    keys = ("layers", "submesh", "logical_shape", "autosharding_option")
    return {
        "num_layers": summary["num_layers"],
        "schedule": summary["schedule"],
        "stages": [{k: stage[k] for k in keys} for stage in summary["stages"]],
    }


@dataclass(frozen=True)
class ParallelMode:
    """How one kind of parallel arguments runs: Alpa's name for it, the method, whether it
    rematerializes, whether the model must mark its block boundaries, and what of the
    compiled plan a result row records."""

    name: str
    make_method: Callable[[Any, int, int, int], Any]
    remat: Callable[[Any], bool]
    needs_markers: bool
    describe_plan: Callable[[Any], dict]


PARALLEL_MODES: dict[type, ParallelMode] = {
    ShardArgs: ParallelMode("2d_shard", _shard_method, lambda a: False, False, _shard_plan),
    UniformArgs: ParallelMode(
        "uniform", _uniform_method, lambda a: a.use_remat, True, _pipeshard_plan
    ),
    SolutionArgs: ParallelMode(
        "load_solution", _solution_method, lambda a: a.remat_mode != "none", False, _pipeshard_plan
    ),
    SearchArgs: ParallelMode(
        "search", _search_method, lambda a: a.remat_mode != "none", False, _pipeshard_plan
    ),
}

# ----------------------------------------------------------------------------- one case


def run_case(
    case: BenchmarkCase, niter: int, warmup: int, num_hosts: int, num_devices_per_host: int
) -> dict:
    """Compile and time ``case`` on the cluster of ``alpa.init``; the measurements as a
    JSON-able dict (module docstring)."""
    mode = PARALLEL_MODES[type(case.parallel_args)]
    method = mode.make_method(
        case.parallel_args, case.num_micro_batches, num_hosts, num_devices_per_host
    )

    tic = time.perf_counter()
    family = MODEL_FAMILIES[type(case.model_config)]
    workload = family.build(
        case.model_config, case.batch_size, case.num_micro_batches, mode.needs_markers
    )
    jax.block_until_ready(workload.state)
    init_s = time.perf_counter() - tic
    num_params = compute_param_number(workload.state.params)

    step = alpa.parallelize(workload.train_step, method=method)
    tic = time.perf_counter()
    executable = step.get_executable(workload.state, workload.batch)
    compile_s = time.perf_counter() - tic

    state = workload.state

    def run_step() -> None:
        nonlocal state
        state, _ = step(state, workload.batch)

    latencies = benchmark_func(
        run_step, lambda: jax.block_until_ready(state), warmup=warmup, repeat=niter, number=1
    )
    latency = float(np.mean(latencies))
    num_devices = num_hosts * num_devices_per_host
    return {
        "num_params": num_params,
        "init_s": init_s,
        "compile_s": compile_s,
        "latencies_s": latencies.tolist(),
        "mean_s": latency,
        "std_s": float(np.std(latencies)),
        "tflops": workload.tflops(latency, num_devices, False),
        "tflops_ckpt": workload.tflops(latency, num_devices, mode.remat(case.parallel_args)),
        "flops_source": workload.flops_source,
        "peak_memory_per_mesh": [int(b) for b in executable.get_peak_memory_per_mesh()],
        "plan": mode.describe_plan(executable),
    }


def describe_case(case: BenchmarkCase) -> dict:
    """The case as JSON-able data: its model family, configuration and method."""
    return {
        "model": MODEL_FAMILIES[type(case.model_config)].name,
        "model_config": dataclasses.asdict(case.model_config),
        "batch_size": case.batch_size,
        "num_micro_batches": case.num_micro_batches,
        "parallel_mode": PARALLEL_MODES[type(case.parallel_args)].name,
        "parallel_args": dataclasses.asdict(case.parallel_args),
    }
