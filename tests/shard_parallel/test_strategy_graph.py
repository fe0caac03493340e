"""The strategy graph's shared work judged against computing everything afresh.

``build_strategy_graph`` runs each strategy rule once per distinct (primitive, parameters,
shapes, operand specs) and fills each distinct resharding matrix once; repeated layers
reuse both. The oracle: every node's strategies equal what its rule returns when called on
that very equation, and every edge matrix equals ``resharding_cost`` element by element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from alpa.device_mesh import LogicalDeviceMesh
from alpa.shard_parallel.strategies.sharding_spec import resharding_cost
from alpa.shard_parallel.strategies.strategy_costs import priced_strategies
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions
from alpa.shard_parallel.strategies.strategy_rules import (
    RuleContext,
    lookup_rule,
    replicated_strategy,
)


def stacked_mlp_jaxpr(num_layers: int = 3, batch: int = 16, hidden: int = 32):
    def step(params, x):
        def loss_fn(p):
            h = x
            for w, b in p:
                h = jnp.tanh(h @ w + b)
            return jnp.mean(h**2)

        grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    layer = (
        jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
        jax.ShapeDtypeStruct((hidden,), jnp.float32),
    )
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    return jax.make_jaxpr(step)([layer] * num_layers, x)


@pytest.mark.parametrize("options", [GraphOptions(), GraphOptions(allow_all_to_all=False)])
def test_shared_rules_and_matrices_equal_fresh_ones(options):
    closed = stacked_mlp_jaxpr()
    mesh = LogicalDeviceMesh((2, 4), (1, 1), (1, 0.1))
    num_params = len(closed.jaxpr.outvars)
    pairs = tuple((i, i) for i in range(num_params))
    graph = build_strategy_graph(closed, mesh, options, state_pairs=pairs)

    def specs_of(source):
        node_id, k = source
        return [s.out_specs[k] for s in graph.nodes[node_id].strategies]

    # Nodes: the rule called on each equation itself.
    node_of_eqn = {}
    for t, sources in enumerate(graph.eqn_sources):
        if sources:
            node_of_eqn[t] = sources[0][0]
    checked = 0
    for t, eqn in enumerate(graph.jaxpr.eqns):  # the live equations (the loss is dead)
        if t not in node_of_eqn:
            continue
        operand_specs = tuple(
            None if isinstance(v, Literal) else tuple(specs_of(graph.sources[v]))
            for v in eqn.invars
        )
        ctx = RuleContext(
            mesh,
            options.allow_mixed_mesh_shape,
            options.allow_recompute_heavy_op,
            options.prefer_reduce_scatter,
            operand_specs,
        )
        rule = lookup_rule(eqn.primitive)
        fresh = rule(eqn, ctx) if rule is not None else replicated_strategy(eqn)
        if not fresh.strategies:
            fresh = replicated_strategy(eqn)
        node = graph.nodes[node_of_eqn[t]]
        expected = priced_strategies(mesh, eqn, fresh.strategies, node.combined)
        assert node.strategies == expected, str(eqn)
        checked += 1
    assert checked > 30

    # Edges: the scalar resharding cost of every (producer spec, consumer spec) pair.
    by_dst: dict[int, list] = {}
    for edge in graph.edges:
        by_dst.setdefault(edge.dst, []).append(edge)
    eqn_of_node = {n: t for t, n in node_of_eqn.items()}
    # Resharding nodes (shared_resharding): each holds its value in the producer's specs
    # and those several readers may read; its readers' edges start from it.
    resharding = {n.id for n in graph.nodes if n.label.startswith("resharding of")}
    assert resharding
    value_of: dict[int, object] = {}
    num_edges = 0
    for dst, edges in sorted(by_dst.items(), key=lambda item: item[0] in resharding):
        if dst in eqn_of_node:
            eqn = graph.jaxpr.eqns[eqn_of_node[dst]]
            operands = [(j, v) for j, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
            reads = []
            for edge, (j, v) in zip(edges, operands, strict=True):
                src_specs = specs_of(graph.sources[v])
                if edge.src in resharding:
                    value_of[edge.src] = v
                    held = [s.in_specs[0] for s in graph.nodes[edge.src].strategies]
                    distinct = list(dict.fromkeys(src_specs))
                    assert held[: len(distinct)] == distinct
                    src_specs = held
                needs = [s.in_specs[j] for s in graph.nodes[dst].strategies]
                reads.append((src_specs, needs, v.aval))
        elif dst in resharding:
            v = value_of[dst]
            held = [s.in_specs[0] for s in graph.nodes[dst].strategies]
            reads = [(specs_of(graph.sources[v]), held, v.aval)]
        else:  # state edges into an input node
            i = graph.input_nodes.index(dst)
            out = closed.jaxpr.outvars[pairs[i][1]]
            reads = [(specs_of(graph.sources[out]), specs_of((dst, 0)), out.aval)]
        for edge, (src_specs, dst_specs, aval) in zip(edges, reads, strict=True):
            total = float(np.prod(aval.shape)) * aval.dtype.itemsize
            expected = np.array(
                [
                    [
                        0.0 if d is None or s == d
                        else resharding_cost(s, d, total, mesh, options.allow_all_gather,
                                             options.allow_all_to_all)
                        for d in dst_specs
                    ]
                    for s in src_specs
                ]
            )  # fmt: skip
            np.testing.assert_array_equal(edge.cost, expected)
            num_edges += 1
    assert num_edges == len(graph.edges)
    # The layers do share: fewer distinct matrices than edges.
    assert len({id(e.cost) for e in graph.edges}) < len(graph.edges)
