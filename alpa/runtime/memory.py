"""Device memory figures shared by the executables and the Ray mesh workers."""

from __future__ import annotations

import functools
from typing import Any

from alpa.device_memory import device_peak_bytes  # noqa: F401 (the executables' path)


def allocation_bytes(compiled: Any) -> int:
    """Bytes one device allocates for a compiled program (arguments + outputs +
    temporaries, less what outputs alias), from XLA's memory analysis."""
    stats = compiled.memory_analysis()
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def step_peak_bytes(
    instructions: Any, buffer_bytes: Any, run_bytes: Any, donated: dict | None = None
) -> list[int]:
    """Per mesh, the most bytes one device holds at once during a step, from XLA's figures.

    At every ``RUN``, the device holds what XLA allocates for the program it runs
    (``run_bytes(kernel index)``: arguments, outputs and temporaries, less aliased
    outputs) plus every other buffer the step keeps on that mesh at that point: the
    step's inputs placed there (parameters, optimizer state; the caller owns them for the
    whole step) and what earlier instructions wrote and later ones still read (the
    activations of micro-batches in flight, gradient sums, ...). ``buffer_bytes(key)``
    is one device's share of buffer ``key``. Between ``RUN``s a device holds no more
    than at the ``RUN`` before or after it, bar a transfer's received buffer.

    ``instructions`` is a ``PipelineInstructions``; buffers are freed after their last
    reading instruction (``Instruction.free``), as both runtimes free them, and the
    inputs a ``RUN`` of kernel ``k`` consumes (``donated[k]``, positions of its
    arguments: ``instructions.donated_inputs``) after it.
    """
    from alpa.runtime.instructions import Op

    bytes_of = functools.cache(buffer_bytes)  # each buffer's bytes, asked once per step

    live: list[set] = [set() for _ in range(instructions.num_meshes)]
    for key in instructions.persistent:
        live[key[2]].add(key)
    peak = [0] * instructions.num_meshes
    for ins in instructions.instructions:
        if ins.op is Op.RUN:
            reads_or_writes = set(ins.inputs) | set(ins.outputs)
            held = sum(bytes_of(k) for k in live[ins.mesh] if k not in reads_or_writes)
            peak[ins.mesh] = max(peak[ins.mesh], int(held + run_bytes(ins.computation)))
        for key in ins.outputs:
            live[key[2]].add(key)
        for key in ins.free:
            if key not in instructions.persistent:
                live[key[2]].discard(key)
        if ins.op is Op.RUN:
            for position in (donated or {}).get(ins.computation, ()):
                live[ins.mesh].discard(ins.inputs[position])
    return peak
