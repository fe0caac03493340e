"""Each compiled stage program performs the collectives its stage's ILP plan priced: the
stages are lowered with their whole plan, as ``ShardParallel`` lowers its one plan.

The oracle re-solves each stage's forward-and-backward ILP (deterministic; its objective
must be the plan's) and reads off it, per stage program, what it prices:

* each equation whose chosen strategy reduces partial results (``reduce_axes``): an
  all-reduce of its result, as many bytes as a device holds of it. A gradient reduction
  the pipeline defers to apply-grad (``program.deferred``: summed over the data axes once
  per step) is in the backward only for its other axes. Two partial results added and
  reduced alike (``ShardingPlan.partial_sums``) are priced, and reduced, once;
* each resharding edge (an operand read in another spec than its producer's), once per
  value and spec in each program: the collectives ``resharding_collectives`` prices for it.

The compiled programs' HLO must hold exactly these, counted by kind and bytes per device
(``alpa.util.collective_shapes``; XLA's tuple all-reduce counts once per value). Scalar
all-reduces (the loss) are left out on both sides: XLA reduces a scalar split over two
axes in two steps, one per axis, where the plan prices one reduction.

Before the stages took their plans' specs inside bodies and on operands, the remat case
failed: the
last stage's forward all-gathered an activation (16 KiB per device) inside the checkpoint body
where its plan priced an all-reduce of it. Without ``partial_sums``, the first stage's
backward all-reduced two of the input gradients of query, key and value each on its own,
one all-reduce (16 KiB per device) more than its plan priced.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jax
import numpy as np
import pytest
from conftest import PINS_OF_FORMAT_1, devices_or_skip, plan_in_older_layout
from jax.extend.core import Literal

import alpa
from alpa.pipeline_parallel.program.stage_sharding import merged_step
from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.strategies.sharding_spec import resharding_collectives
from alpa.testing import assert_allclose, program_text
from alpa.tracing.jaxpr_util import nested_eqns, planned_bodies
from alpa.util import collective_shapes

_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter")
_SHAPE_RE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1}


def _gpt(remat: bool):
    """``(state, batch, step)`` of a 2-block GPT with a pipeline marker between blocks."""
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    config = GPTConfig(
        seq_len=16,
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        add_manual_pipeline_markers=True,
        tie_word_embeddings=False,
        remat_layers=remat,
    )
    return get_gpt_train_state_and_step(config, 32, grad_func=alpa.value_and_grad)


def _parallel(remat: bool):
    """The GPT in two one-block stages on logical (2, 2) submeshes, 2 micro-batches:
    ``(parallelized step, (state, batch), serial step)``."""
    devices_or_skip(8)
    state, batch, step = _gpt(remat)
    method = alpa.PipeshardParallel(
        num_micro_batches=2,
        stage_option=ManualStageOption(
            [[0], [1]], [(1, 4), (1, 4)], submesh_logical_shapes=[(2, 2), (2, 2)]
        ),
    )
    return alpa.parallelize(step, method=method), (state, batch), step


def _executable(remat: bool):
    parallel, args, _ = _parallel(remat)
    return parallel.get_executable(*args), args


def _hlo_collectives(text: str) -> Counter:
    """``(kind, bytes per device of the result)`` of every collective in ``text``."""
    counts = Counter()
    for kind in _KINDS:
        for shape in collective_shapes(text, kind):
            match = _SHAPE_RE.fullmatch(shape)
            dims = [int(d) for d in match.group("dims").split(",") if d]
            counts[(kind, int(np.prod(dims)) * _ITEMSIZE[match.group("dtype")])] += 1
    return counts


def _all_eqn_ids(eqns) -> set[int]:
    """``eqns`` and the equations of their bodies, by ``id``."""
    inside = [x for e in eqns for _, body in planned_bodies(e) for x in nested_eqns(body)]
    return {id(e) for e in [*eqns, *inside]}


def _ways(dims, mesh) -> int:
    """Into how many blocks the mesh axes named in ``dims`` (a spec's entries) split."""
    names = [a for axes in dims if axes is not None for a in np.atleast_1d(axes)]
    return int(np.prod([mesh.shape[mesh.axis_names.index(a)] for a in names]))


def _stage_solutions(executable, stage: int) -> list:
    """The ILP solutions of ``stage``'s computations, solved again as
    ``stage_sharding.plan_stage_shardings`` solves them: forward and backward as one, then
    each apply level with the inputs the earlier ones placed fixed. ``[(comps, solution)]``;
    each objective must be the plan's."""
    plan, program = executable.plan, executable.program
    mesh, option = plan.logical_meshes[stage], plan.options[stage]
    groups = [[program.computation(stage, "forward"), program.computation(stage, "backward")]]
    groups += [[c] for c in program.computations if c.stage == stage and c.kind == "apply"]
    table, solved = {}, []
    for i, comps in enumerate(groups):
        sub, produced = merged_step(
            plan.traced, program, comps, mesh.num_devices, plan.names, "stage"
        )
        jaxpr = sub.closed_jaxpr.jaxpr
        solution = solve_auto_sharding(
            sub,
            mesh,
            option,
            fixed_in_specs=[table.get(v) for v in jaxpr.invars],
            comm_first=False,
            shared_reshardings=False,
        )
        assert solution.objective == plan.objectives[stage][i], (stage, i)
        sharding = solution.to_sharding_plan()
        for v, spec in zip(jaxpr.invars, sharding.in_specs, strict=True):
            table.setdefault(v, spec)
        for v, spec in sharding.var_specs.items():
            if v in produced:
                table.setdefault(v, spec)
        for v, spec in zip(jaxpr.outvars, sharding.out_specs, strict=True):
            table.setdefault(v, spec)
        if i == 0:
            for out, operand in program.accumulated.items():
                if program.home[out] == stage and operand in table:
                    table[out] = table[operand]
        solved.append((comps, solution))
    return solved


def _priced_collectives(executable, stage: int) -> dict[str, Counter]:
    """Per program of ``stage``: what its ILP plan prices (module docstring), as
    ``(kind, bytes per device of the result)`` counts."""
    program = executable.program
    mesh = executable.plan.logical_meshes[stage]
    deferred = program.deferred
    data_axes = set()
    if deferred is not None and stage in deferred.stage_axes:
        data_axes = {mesh.axis_names.index(a) for a in deferred.stage_axes[stage]}
    priced: dict[str, Counter] = {}
    for comps, solution in _stage_solutions(executable, stage):
        graph, choice = solution.graph, solution.solution.choice
        eqn_of = {}
        for e, sources in zip(graph.jaxpr.eqns, graph.eqn_sources, strict=True):
            eqn_of.update((n, e) for n, _ in sources)
        reductions = [(n, c) for n, reduces, c in ilp_solver.collectives(graph, choice) if reduces]
        for comp in comps:
            mine = _all_eqn_ids(comp.eqns)
            counts, edges = Counter(), set()
            for eqn, sources in zip(graph.jaxpr.eqns, graph.eqn_sources, strict=True):
                if id(eqn) in mine and sources:
                    node = graph.nodes[sources[0][0]]
                    needs = node.strategies[choice[node.id]].in_specs
                    for v, need in zip(eqn.invars, needs, strict=False):
                        if not isinstance(v, Literal) and need is not None:
                            edges.add((v, need))
            for node, c in reductions:
                eqn = eqn_of[node]
                if id(eqn) not in mine:
                    continue
                if deferred is not None and eqn.outvars[0] in deferred.values:
                    if c.axis in data_axes:
                        continue  # summed once per step, in apply-grad
                scattered = c.kind == "reduce-scatter"
                counts[(c.kind, int(c.nbytes / mesh.shape[c.axis] if scattered else c.nbytes))] += 1
            for v, need in edges:  # the lowering reshards a value once per spec
                nbytes = np.prod(v.aval.shape) * v.aval.dtype.itemsize
                for c in resharding_collectives(solution.spec_of(v), need, nbytes, mesh):
                    counts[(c.kind, int(c.nbytes))] += 1
            priced[comp.name] = counts
    if deferred is not None:  # one all-reduce per gradient sum, by its first reader
        for marked, partial in deferred.partials.items():
            reader = next(c for c in program.computations if marked in c.invars)
            if reader.stage == stage:
                spec = deferred.partial_specs[partial]  # [n, ...]: n over the data axes
                nbytes = np.prod(marked.aval.shape) * marked.aval.dtype.itemsize
                nbytes /= _ways(spec[1:], mesh)
                priced[reader.name][("all-reduce", int(nbytes))] += 1
    return priced


@pytest.mark.parametrize("remat", [False, True])
def test_stage_programs_perform_the_collectives_their_plans_priced(remat):
    parallel, args, step = _parallel(remat)
    executable = parallel.get_executable(*args)
    texts = dict(zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True))
    kinds = set()
    for stage in range(executable.plan.num_stages):
        for name, priced in _priced_collectives(executable, stage).items():
            compiled = _hlo_collectives(texts[name])
            assert compiled == priced, (name, dict(priced - compiled), dict(compiled - priced))
            kinds |= {kind for kind, _ in priced}
    # Not vacuous: the plans split the model (all-reduces of activations and gradients)
    # and reshard activations (all-gathers) inside the stages.
    assert kinds == {"all-reduce", "all-gather"}, kinds
    if remat:  # the checkpoint bodies' values and operands are pinned too
        assert _pinned(executable.plan, "var_specs") and _pinned(executable.plan, "operand_specs")
    else:
        # An add of two partial results priced as one reduction (two of the input
        # gradients of query, key and value, split by heads over "y") and lowered so: both
        # computed on each device, added, all-reduced once. The same numbers as serial.
        ((eqn, stage), partial_sum), *_ = _pinned(executable.plan, "partial_sums").items()
        assert (eqn.primitive.name, stage, partial_sum.reduce_axes) == ("add_any", 0, ("y",))
        expected = jax.jit(step)(*args)  # first: the parallel step donates the state
        assert_allclose(parallel(*args), expected, rtol=1e-4, atol=1e-4)


def _pinned(plan, table: str) -> dict:
    """``(key, stage) -> entry`` of one table of a plan's (or its decisions') per-stage
    records of pins (``stage_pins``)."""
    return {
        (k, s): x for s, pins in enumerate(plan.stage_pins) for k, x in getattr(pins, table).items()
    }


def test_stage_partial_sums_survive_a_saved_plan():
    """The partial sums travel in the plan's JSON: a replay compiles the same stage
    programs. A plan saved before they did (no ``partial_sums`` in its JSON; priced without
    them) still loads, and its stages are lowered without them: each add's operands
    reduced on their own, one all-reduce more."""
    executable, args = _executable(remat=False)
    saved = executable.get_parallel_plan().to_json()
    loaded = alpa.ParallelPlan.from_json(saved)
    recorded = _pinned(loaded.pipeline_plan.decisions, "partial_sums")
    assert len(recorded) == len(_pinned(executable.plan, "partial_sums")) == 1
    _, _, step = _gpt(remat=False)
    replayed = alpa.parallelize(step, method=alpa.plan_to_method(loaded)).get_executable(*args)
    assert program_text(replayed.get_hlo_text()) == program_text(executable.get_hlo_text())

    data = json.loads(saved)
    for pins in data["pipeline_plan"]["stage_pins"]:
        pins["partial_sums"] = {}
    older = alpa.ParallelPlan.from_json(json.dumps(data))
    assert _pinned(older.pipeline_plan.decisions, "partial_sums") == {}
    parallel = alpa.parallelize(step, method=alpa.plan_to_method(older))
    compiled = parallel.get_executable(*args)
    assert not _pinned(compiled.plan, "partial_sums")
    names = executable.get_hlo_names()
    texts = [dict(zip(names, e.get_hlo_text(), strict=True)) for e in (executable, compiled)]
    now, before = (_hlo_collectives(t["stage0_backward"]) for t in texts)
    assert before - now == Counter({("all-reduce", 16384): 1}), (before, now)
    expected = jax.jit(step)(*args)  # first: the parallel step donates the state
    assert_allclose(parallel(*args), expected, rtol=1e-4, atol=1e-4)


def test_stage_constraints_survive_a_saved_plan():
    """The operand and body specs travel in the plan's JSON: a replay compiles the same
    stage programs."""
    executable, args = _executable(remat=True)
    loaded = alpa.ParallelPlan.from_json(executable.get_parallel_plan().to_json())
    decisions = loaded.pipeline_plan.decisions
    for table in ("operand_specs", "var_specs"):
        assert len(_pinned(decisions, table)) == len(_pinned(executable.plan, table)) > 0
    _, _, step = _gpt(remat=True)
    replayed = alpa.parallelize(step, method=alpa.plan_to_method(loaded)).get_executable(*args)
    assert program_text(replayed.get_hlo_text()) == program_text(executable.get_hlo_text())


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("remat", [False, True])
def test_a_plan_saved_in_an_older_layout_replays_the_same_programs(remat, version):
    """A plan saved in format 1 (the stages' records in ``(ref, stage)`` tables) or 2 (the
    specs of the stage computations' values in one such table) loads into the same
    per-stage records as the plan saved now, and (with its checkpoint bodies' and
    operands' pins) compiles to the same stage programs."""
    executable, args = _executable(remat=remat)
    saved = executable.get_parallel_plan().to_json()
    old = json.dumps(plan_in_older_layout(json.loads(saved), version))
    pipeline = json.loads(old)["pipeline_plan"]
    assert pipeline["stage_specs"] and ("stage_pins" in pipeline) == (version == 2)
    now, before = (alpa.ParallelPlan.from_json(t).pipeline_plan.decisions for t in (saved, old))
    assert len(before.stage_pins) == len(now.stage_pins) == executable.plan.num_stages
    tables = ("partial_sums",) if not remat else ("var_specs", "operand_specs")
    for table in PINS_OF_FORMAT_1:
        assert _pinned(before, table) == _pinned(now, table)
    for table in ("var_specs", *tables):  # not vacuous
        assert _pinned(now, table)
    if remat:
        _, _, step = _gpt(remat=True)
        method = alpa.plan_to_method(alpa.ParallelPlan.from_json(old))
        replayed = alpa.parallelize(step, method=method).get_executable(*args)
        assert program_text(replayed.get_hlo_text()) == program_text(executable.get_hlo_text())


def test_a_plan_holds_its_decisions_and_a_replay_keeps_the_ones_it_is_given():
    """A plan's decisions are one record, ``PipeshardPlan.decisions``, not a copy: its
    stage records name the traced step's equations, and the stage programs are lowered
    from the same records on the split program's equations at the same positions
    (``program_pins``). ``plan_pipeshard(decisions=...)`` keeps the record it is given as
    its plan's, and lowers from the same pins."""
    from alpa.pipeline_parallel.pipeshard_passes import PipeshardOptions, plan_pipeshard

    executable, args = _executable(remat=True)
    plan = executable.plan
    assert plan.stage_pins is plan.decisions.stage_pins
    assert plan.stage_plan is plan.decisions.stage_plan
    traced_eqns = nested_eqns(plan.traced.jaxpr)
    program_eqns = nested_eqns(plan.program.closed_jaxpr.jaxpr)
    position = {id(e): i for i, e in enumerate(traced_eqns)}
    rewritten = sum(a is not b for a, b in zip(traced_eqns, program_eqns, strict=True))
    assert rewritten, "the split rewrote no equation: the positions are not exercised"
    for pins, bound in zip(plan.stage_pins, plan.program_pins, strict=True):
        assert pins.operand_specs  # not vacuous (a remat GPT's stages reshard operands)
        assert bound.var_specs == pins.var_specs
        for table in ("operand_specs", "partial_sums"):
            mine, theirs = getattr(pins, table), getattr(bound, table)
            assert {program_eqns[position[id(e)]]: x for e, x in mine.items()} == theirs
    options = PipeshardOptions(
        plan.cluster, plan.num_micro_batches, pipeline_schedule=plan.schedule.name
    )
    replayed = plan_pipeshard(plan.traced, options, args, decisions=plan.decisions)
    assert replayed.decisions is plan.decisions
    new_program = nested_eqns(replayed.program.closed_jaxpr.jaxpr)
    old_position = {id(e): i for i, e in enumerate(program_eqns)}
    for mine, theirs in zip(plan.program_pins, replayed.program_pins, strict=True):
        assert mine.var_specs == theirs.var_specs
        for table in ("operand_specs", "partial_sums"):
            moved = {new_program[old_position[id(e)]]: x for e, x in getattr(mine, table).items()}
            assert moved == getattr(theirs, table)
