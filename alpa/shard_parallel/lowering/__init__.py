"""A ``ShardingPlan`` lowered to a JAX function and compiled by XLA.

Entry points: :func:`alpa.shard_parallel.lowering.step_function.build_step_function` (the
step evaluated with every value constrained to its planned sharding, the gradient
rewrites applied) and :func:`alpa.shard_parallel.lowering.compile.compile_plan` (that
function jitted and compiled, micro-batched where the plan accumulates gradients). The
modules: ``step_function``, ``plan_pins`` (a plan's pinned values, resharded operands and
partial sums as what the evaluation takes: the one lowering of a plan's pins, which the
pipeline's stage programs call too), ``constrained_eval`` (a jaxpr evaluated under sharding
constraints), ``compile``.

Imports the other sub-packages and its package's records; nothing imports it but the
package's entry and the layers above.
"""
