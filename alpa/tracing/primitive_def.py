"""The pipeline marker: an identity primitive that marks where a program may be cut.

``pipeline_p`` returns its operands unchanged. It carries two parameters: ``name`` (a
layer or purpose) and ``mark_type``:

* ``"start"`` / ``"end"``: the inputs and outputs of a pipeline layer;
* ``"boundary"``: a user's ``mark_pipeline_boundary()``: a cut between two layers;
* ``"grad"``: the gradients that ``alpa.grad`` returns: everything before it is the
  compute-grad part of a training step, everything after it the apply-grad part.

Because it is a real primitive with AD rules, the markers survive ``jax.grad`` and
``jax.jit``: its JVP marks the tangents too, and its transpose marks the cotangents with
the mirrored type (an ``end`` of the forward pass becomes a ``start`` of the backward pass),
so the backward program inherits the forward program's cuts (``docs/pipeline.md``, How the
backward pass is cut; ``docs/design.md``, Facts of JAX 0.10).
"""

from __future__ import annotations

from jax.extend.core import Primitive

from alpa.jax_internals import ad, batching, mlir

pipeline_p = Primitive("pipeline_marker")
pipeline_p.multiple_results = True

MARK_TYPES = ("start", "end", "boundary", "grad", "jvp_start", "jvp_end")
_MIRROR = {
    "start": "end",
    "end": "start",
    "boundary": "boundary",
    "grad": "grad",
    "jvp_start": "end",
    "jvp_end": "start",
}


def mark_pipeline_jaxpreqn(values, name: str, mark_type: str):
    """Bind the marker on a flat list of arrays and return the marked arrays."""
    if mark_type not in MARK_TYPES:
        raise ValueError(f"mark_type must be one of {MARK_TYPES}, got {mark_type!r}")
    return pipeline_p.bind(*values, name=name, mark_type=mark_type)


def passes_through(eqn) -> bool:
    """Whether ``eqn`` is a marker: output ``i`` is operand ``i``, so what holds of an
    operand (it depends on the batch, it is a partial sum) holds of its output alone."""
    return eqn.primitive is pipeline_p and len(eqn.invars) == len(eqn.outvars)


def _impl(*args, name, mark_type):
    del name, mark_type
    return list(args)


def _abstract_eval(*avals, name, mark_type):
    del name, mark_type
    return list(avals)


def _lowering(ctx, *args, name, mark_type):
    del ctx, name, mark_type
    return list(args)


def _jvp(primals, tangents, *, name, mark_type):
    # Only tangents that are not symbolic zeros are marked: a value without a tangent (the
    # batch, a constant) then leaves no marker operand, hence no wasted cotangent, in the
    # backward pass.
    primals_out = pipeline_p.bind(*primals, name=name, mark_type=mark_type)
    tangent_type = {"start": "jvp_start", "end": "jvp_end"}.get(mark_type, mark_type)
    nonzero = [type(t) is not ad.Zero for t in tangents]
    if not any(nonzero):
        return primals_out, list(tangents)
    marked = iter(
        pipeline_p.bind(
            *[t for t, nz in zip(tangents, nonzero, strict=True) if nz],
            name=name,
            mark_type=tangent_type,
        )
    )
    # The marker is the identity, so a zero tangent stays the same zero.
    tangents_out = [next(marked) if nz else t for t, nz in zip(tangents, nonzero, strict=True)]
    return primals_out, tangents_out


def _transpose(cts, *args, name, mark_type):
    cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]
    del args
    return pipeline_p.bind(*cts, name=name, mark_type=_MIRROR[mark_type])


def _batch(batched_args, batch_dims, *, name, mark_type):
    return pipeline_p.bind(*batched_args, name=name, mark_type=mark_type), batch_dims


pipeline_p.def_impl(_impl)
pipeline_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(pipeline_p, _lowering)
ad.primitive_jvps[pipeline_p] = _jvp
ad.primitive_transposes[pipeline_p] = _transpose
batching.primitive_batchers[pipeline_p] = _batch


def mark_pipeline_boundary() -> None:
    """Cut the program here into two pipeline layers (``ManualLayerOption``).

    Call it between layers in the forward pass of a model; the backward pass inherits the
    cut. It binds a marker with no operands: the cut is its position in the traced program.
    """
    pipeline_p.bind(name="boundary", mark_type="boundary")
