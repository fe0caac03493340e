"""How alpa hands its programs to XLA: ``compile_lowered(lowered, platform)`` is
``lowered.compile()`` with the options alpa compiles every step program with.

On CPU, XLA removes optimization barriers (the ``cse_barrier_expander`` pass) early in
its pipeline, before its all-reduce combiner and its scheduler; on GPU the barriers live
until the end of the pipeline. A ``jax.checkpoint`` (remat) places its recomputation
behind such a barrier, one that also holds the incoming cotangent, so that the forward
pass is recomputed where the backward pass needs it. With the barrier gone, nothing
orders the recomputation after the forward pass any more: XLA's CPU combiner merges a
recomputed all-reduce with one of the forward pass (Alpa's remat BERT layers counted 11
all-reduces; CPU made 9 of them) and the scheduler recomputes early, keeping the
activations remat was meant to drop (``tests/test_xla_compile.py`` measures both). alpa's
programs therefore compile on CPU with that pass off, as the GPU pipeline runs it: the
barriers then reach the scheduler, which honours them, and are dropped at emission.

``hlo_text(compiled)`` is the optimized HLO that ``get_hlo_text()`` returns, printed as
Alpa's XLA printed it: each operand with its shape (``gather(f32[64,32]{1,0} %p, ...)``,
where XLA's printer now writes ``gather(%p, ...)``), so that programs that read shapes
off Alpa's HLO text read them here too.
"""

from __future__ import annotations

import os
import re

import jax

#: Per platform, the XLA passes alpa's programs compile without.
DISABLED_PASSES: dict[str, tuple[str, ...]] = {"cpu": ("cse_barrier_expander",)}

_FLAG_RE = re.compile(r"--xla_disable_hlo_passes=(\S+)")


def compiler_options(platform: str) -> dict[str, str] | None:
    """The ``compiler_options`` of alpa's programs on ``platform`` (``None``: none). The
    passes ``XLA_FLAGS`` already disables stay disabled (an option replaces the flag)."""
    passes = DISABLED_PASSES.get(platform)
    if not passes:
        return None
    from_env = _FLAG_RE.findall(os.environ.get("XLA_FLAGS", ""))
    names = [n for flag in from_env for n in flag.split(",") if n]
    names += [p for p in passes if p not in names]
    return {"xla_disable_hlo_passes": ",".join(names)}


def hlo_text(compiled: jax.stages.Compiled) -> str:
    """The optimized HLO of ``compiled``, each operand printed with its shape (module
    docstring); ``compiled.as_text()`` where the executable keeps no HLO modules."""
    try:
        from jaxlib._hlo import HloPrintOptions

        modules = compiled.runtime_executable().hlo_modules()
    except (ImportError, AttributeError, NotImplementedError):
        return compiled.as_text()
    options = HloPrintOptions()
    options.print_operand_shape = True
    return "\n\n".join(m.to_string(options) for m in modules)


def compile_lowered(lowered: jax.stages.Lowered, platform: str) -> jax.stages.Compiled:
    """``lowered`` compiled for ``platform`` (the platform of the devices it runs on)."""
    return lowered.compile(compiler_options=compiler_options(platform))
