"""ZeRO-3's parameter all-gathers: packed up to a bound, and done again for the backward.

ZeRO-3 keeps every parameter split over the data axes; the step reads each one whole.
Gathering all of them once before the step (and keeping them whole until the update)
would hold every parameter whole through the forward and the backward pass: ZeRO-2's
memory. Instead, as Alpa's rewrite did (an all-gather before the forward's and again
before the backward's use of each parameter, combined by XLA up to
``force_zero_stage_3_all_gather_threshold`` bytes):

* a parameter is gathered before its first use in the forward pass (up to the loss, the
  first operand of the ``alpa.grad`` marker; below, without it) and, where the backward
  pass reads it again (a kernel, for its input's gradient), gathered again before that:
  between the two only its split value need stay live. After the marker the update
  reads the split value;
* gathers are packed in the order of first use, per dtype, each pack at most
  ``bound`` bytes of whole tensors (a tensor larger than that is a pack of its own), and
  issued before the first use of any of its members;
* a pack of the backward pass first passes the split values through an optimization
  barrier with a value the backward computed, so that XLA does not move it into the
  forward pass, and carries one element more per device (dropped after), so that it is
  never the same all-gather as a forward pack, which XLA's CSE would merge (on CPU the
  barrier is expanded before CSE runs).

Where the marker does not hold the loss (a step differentiated with ``jax.grad``, its
gradients marked by ``parallelize``), the forward pass is taken to end at the last of the
parameters' first uses. Without a marker there is one pass: each parameter is gathered
once, packed alike, and kept. The micro-batched lowering does not use this schedule:
each micro-batch gathers every parameter in one packed all-gather and keeps it through
its backward pass. Here the schedule; the lowering (``lowering._gather_rebinds``) writes
it out, ``gradient_sync.written_sync`` prices it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var

from alpa.tracing import StepJaxpr


@dataclass(frozen=True)
class Pack:
    """Step inputs (``inputs``, positions) gathered together before equation ``at``,
    after the value ``wait`` (``None``: no barrier); ``backward``: a gather again, for
    the backward pass."""

    at: int
    inputs: tuple[int, ...]
    wait: Var | None
    backward: bool = False


@dataclass(frozen=True)
class GatherSchedule:
    """The packs of both passes, and ``release``: the index of the equation (the
    marker) from which the split parameters are read again, ``None`` where they are not."""

    packs: tuple[Pack, ...]
    release: int | None

    def pack_bytes(self, jaxpr: Jaxpr, backward: bool = True) -> list[float]:
        """Bytes of the whole tensors of each pack (one all-gather each), the backward
        pass's included where ``backward``."""
        return [
            sum(_nbytes(jaxpr.invars[i].aval) for i in p.inputs)
            for p in self.packs
            if backward or not p.backward
        ]


def gather_schedule(traced: StepJaxpr, gathered: Sequence[int], bound: int) -> GatherSchedule:
    """Where the step inputs at positions ``gathered`` (ZeRO-3's parameters) are gathered
    (module docstring); ``bound``: the bytes of whole tensors one pack may hold."""
    jaxpr, marker = traced.jaxpr, traced.grad_marker()
    loss_at, marker_at = None, None
    if marker is not None:
        marker_at = next(j for j, e in enumerate(jaxpr.eqns) if e is marker)
        loss = _loss(traced, marker)
        loss_at = next((j for j, e in enumerate(jaxpr.eqns[:marker_at]) if loss in e.outvars), None)
        if loss_at is None:
            loss_at = _last_first_use(jaxpr, gathered, marker_at)
    end = len(jaxpr.eqns) if marker_at is None else marker_at
    phases = [(0, end)] if loss_at is None else [(0, loss_at + 1), (loss_at + 1, marker_at)]
    packs = []
    for start, stop in phases:
        first_use = _first_uses(jaxpr, gathered, start, stop)
        users = sorted(
            (first_use[jaxpr.invars[i]], i) for i in gathered if jaxpr.invars[i] in first_use
        )
        for members in _bounded(users, jaxpr, bound):
            at = first_use[jaxpr.invars[members[0]]]
            wait = _computed_operand(jaxpr, jaxpr.eqns[at]) if start > 0 else None
            packs.append(Pack(at, tuple(members), wait, start > 0))
    return GatherSchedule(tuple(packs), None if loss_at is None else marker_at)


def _last_first_use(jaxpr: Jaxpr, gathered: Sequence[int], stop: int) -> int | None:
    """Where the forward pass ends when the loss is not marked (``jax.grad``): at the last
    of the gathered parameters' first uses (every parameter is read in the forward pass
    before the backward pass reads any; a parameter that the forward pass reads again
    after that, a tied embedding, is then gathered again for it)."""
    return max(_first_uses(jaxpr, gathered, 0, stop).values(), default=None)


def _first_uses(jaxpr: Jaxpr, gathered: Sequence[int], start: int, stop: int) -> dict:
    """Per step input at a position in ``gathered``, the index of the first of the
    equations ``start .. stop - 1`` that reads it (absent where none does)."""
    wanted = {jaxpr.invars[i] for i in gathered}
    first = {}
    for j in range(start, stop):
        for v in jaxpr.eqns[j].invars:
            if isinstance(v, Var) and v in wanted:
                first.setdefault(v, j)
    return first


def _loss(traced: StepJaxpr, marker: JaxprEqn) -> Var | None:
    """The value ``alpa.grad`` differentiated (its marker's first operand: the marker holds
    the value's leaves, then one gradient per leaf it differentiated), ``None`` where the
    marker holds gradients only (one ``parallelize`` put on a ``jax.grad`` step)."""
    differentiated = sum(traced.grad_invars)
    if not differentiated or len(marker.invars) <= differentiated:
        return None
    first = marker.invars[0]
    return first if isinstance(first, Var) else None


def _bounded(users: list[tuple[int, int]], jaxpr: Jaxpr, bound: int) -> list[list[int]]:
    """``users`` (first use, input position), in order, cut into packs of one dtype of at
    most ``bound`` bytes each, as XLA's combiner packs: a pack is closed when the next
    member of its dtype would pass the bound."""
    open_packs: dict = {}
    packs: list[list[int]] = []
    for _, i in users:
        aval = jaxpr.invars[i].aval
        size = _nbytes(aval)
        pack = open_packs.get(aval.dtype)
        if pack is None or pack[1] + size > bound:
            pack = open_packs[aval.dtype] = [[], 0]
            packs.append(pack[0])
        pack[0].append(i)
        pack[1] += size
    return packs  # in the order of their first members' first use


def _computed_operand(jaxpr: Jaxpr, eqn: JaxprEqn) -> Var | None:
    """An operand of ``eqn`` computed by the step (not an input or constant)."""
    given = set(jaxpr.invars) | set(jaxpr.constvars)
    return next((v for v in eqn.invars if isinstance(v, Var) and v not in given), None)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
