"""Format versions of what alpa saves as JSON.

A saved plan outlives the alpa that wrote it: ``ParallelPlan.save`` (replayed by
``plan_to_method``, drawn by ``python -m alpa.plan_view``) and ``PipeshardPlan.to_json``
(the summary of a pipeline plan) are read back by later processes, possibly by another
version of alpa; so are a checkpoint's records (its checksum file, and the record of
which part holds which leaf when Ray meshes saved it) and the measured stage-cost cache
(``measured_stage_cost.MeasuredStageCost``). Each such JSON object carries a
field ``"format"``, the version of its layout, an integer from 1, raised whenever the
layout changes in a way an older reader cannot read.

A reader takes every version up to the one it writes. A plan without the field was written
before the field existed and is read as version 1 (the layout those plans have). A plan of
a newer version is refused, with an error that names where the plan came from (the file, or
the argument), the version found and the version this alpa reads: guessing at fields it
does not know would replay a plan other than the one saved.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The key of the version field in every saved plan.
FORMAT_KEY = "format"

#: The version a plan without the field is read as.
UNVERSIONED = 1


class NewerFormatError(ValueError):
    """A saved plan whose format is newer than this alpa reads."""


def read_format(
    data: Mapping,
    supported: int,
    what: str,
    source: str,
    remedy: str = "load it with that version, or make the plan again with this one",
) -> int:
    """The format version of the saved ``what`` (``"ParallelPlan"``) in ``data``.

    ``supported`` is the newest version the caller reads; ``source`` names where ``data``
    came from in the errors (``"'plan.json'"``, ``"the text"``), ``remedy`` what to do
    about a newer one. A missing field reads as
    :data:`UNVERSIONED`. Raises :class:`NewerFormatError` for a version above
    ``supported`` and ``ValueError`` for a field that is not a version."""
    if FORMAT_KEY not in data:
        return UNVERSIONED
    version = data[FORMAT_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(
            f"{source} is not a {what} this alpa reads: its {FORMAT_KEY!r} is {version!r}, "
            f"where a format version (an int from 1 to {supported}) was expected"
        )
    if version > supported:
        raise NewerFormatError(
            f"{source} is a {what} of format {version}, newer than this alpa reads "
            f"(format {supported} and older): it was saved by a newer alpa; {remedy}"
        )
    return version
