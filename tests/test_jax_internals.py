"""``alpa.jax_internals``: the one module that reads JAX's version-sensitive internals.

Two parts: the rule (no other module of alpa imports ``jax._src`` / ``jax.core`` /
``jax.interpreters``, reads a control-flow or call primitive's parameters by name, or
matches such a primitive by its name string), checked on the source with ``ast``; and the
accessors, checked on small jaxprs of each primitive.
"""

from __future__ import annotations

import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from alpa import jax_internals as ji
from alpa.tracing import new_jaxpr

_ALPA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "alpa")
_THE_MODULE = os.path.join(_ALPA, "jax_internals.py")

# ----------------------------------------------------------------------------- the rule

_INTERNAL_MODULES = ("jax._src", "jax.core", "jax.interpreters")

#: Names of the control-flow and call primitives (JAX 0.10 and 0.11).
_PRIMITIVE_NAMES = frozenset(
    {
        "scan", "while", "cond", "jit", "pjit", "closed_call", "core_call", "eval_jaxpr",
        "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
        "shard_map", "xla_call", "xla_pmap",
    }
)  # fmt: skip
#: Names that are nothing else in alpa's code: flagged wherever they stand as a string.
_UNAMBIGUOUS_NAMES = frozenset(
    {
        "pjit", "closed_call", "core_call", "eval_jaxpr", "remat2", "custom_jvp_call",
        "custom_vjp_call", "custom_vjp_call_jaxpr", "xla_call", "xla_pmap",
    }
)  # fmt: skip
#: Parameters of those primitives.
_PRIMITIVE_PARAMS = frozenset(
    {
        "num_consts", "num_carry", "ft_in", "ft_out", "jaxpr", "length", "reverse", "unroll",
        "linear", "branches", "cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts",
        "call_jaxpr", "fun_jaxpr", "prevent_cse", "differentiated", "policy",
        "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "out_trees",
        "symbolic_zeros", "donated_invars", "in_shardings", "out_shardings", "keep_unused",
        "inline", "ctx_mesh", "compiler_options_kvs",
    }
)  # fmt: skip


def _internal(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _INTERNAL_MODULES)


def _is_params(node: ast.expr) -> bool:
    """``node`` names an equation's parameters: ``<x>.params`` or a variable ``*params``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "params"
    return isinstance(node, ast.Name) and node.id.endswith("params")


def _param_key(node: ast.expr | None) -> bool:
    """``node`` is a primitive parameter's name, or a name built at run time (f-string)."""
    if isinstance(node, ast.JoinedStr):
        return True
    return isinstance(node, ast.Constant) and node.value in _PRIMITIVE_PARAMS


def _primitive_name(node: ast.expr) -> bool:
    """``node`` is a control-flow or call primitive's name, or a literal collection of
    constants holding one."""
    if isinstance(node, ast.Constant):
        return node.value in _PRIMITIVE_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(isinstance(e, ast.Constant) for e in node.elts) and any(
            _primitive_name(e) for e in node.elts
        )
    return False


def _violation(node: ast.AST) -> str | None:  # noqa: PLR0911 (one rule a branch)
    """What ``node`` reads of JAX's internals, if anything."""
    if isinstance(node, ast.Import):
        bad = [a.name for a in node.names if _internal(a.name)]
        return f"import {bad[0]}" if bad else None
    if isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        names = [f"{module}.{a.name}" for a in node.names]
        bad = [n for n in [module, *names] if _internal(n)]
        return f"from {module} import ..." if bad else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "jax" and _internal(f"jax.{node.attr}"):
            return f"jax.{node.attr}"
    if isinstance(node, ast.Subscript) and _is_params(node.value) and _param_key(node.slice):
        return "a primitive's parameter read by name"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "get" and _is_params(node.func.value) and node.args:
            if _param_key(node.args[0]):
                return "a primitive's parameter read by name"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        if any(k.arg in _PRIMITIVE_PARAMS for k in node.keywords):
            return "a primitive's parameter written by name"
    if isinstance(node, ast.Dict):
        spread = any(k is None for k in node.keys)
        if spread and any(k is not None and _param_key(k) for k in node.keys):
            return "a primitive's parameter written by name"
        if any(k is not None and _primitive_name(k) for k in node.keys):
            return "a primitive matched by its name"
    if isinstance(node, ast.Compare):
        if any(_primitive_name(x) for x in [node.left, *node.comparators]):
            return "a primitive matched by its name"
    if isinstance(node, ast.Set | ast.Tuple | ast.List) and _primitive_name(node):
        return "a primitive matched by its name"
    if isinstance(node, ast.Constant) and node.value in _UNAMBIGUOUS_NAMES:
        return f"the primitive name {node.value!r}"
    if isinstance(node, ast.Attribute) and node.attr == "get_bind_params":
        return "a primitive's bind parameters (ji.bind_params)"
    if isinstance(node, ast.Attribute) and node.attr == "manager":
        if isinstance(node.value, ast.Attribute) and node.value.attr == "ctx":
            return "an equation's context (ji.eqn_context)"
    return None


def internal_reads(source: str, filename: str = "<string>") -> list[str]:
    """The lines of ``source`` that read JAX's version-sensitive internals, each as
    ``file:line: what`` (docstrings and comments aside: they are not code)."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source, filename)):
        what = _violation(node)
        if what is not None:
            found.setdefault(node.lineno, what)
    return [f"{filename}:{line}: {what}" for line, what in sorted(found.items())]


def test_no_module_but_jax_internals_reads_jax_internals():
    found = []
    for folder, _, files in os.walk(_ALPA):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != _THE_MODULE:
                with open(path, encoding="utf-8") as f:
                    found += internal_reads(f.read(), os.path.relpath(path, _ALPA))
    assert found == [], "read these through alpa.jax_internals:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "from jax._src import core",
        "from jax._src.lax.control_flow import loops",
        "import jax.core",
        "import jax.interpreters.ad as ad",
        "from jax import core",
        "from jax import interpreters",
        "from jax.core import ShapedArray",
        "from jax.interpreters import mlir",
        "x = jax.core.ShapedArray((1,), 'f')",
        "y = isinstance(x, jax.interpreters.ad.Zero)",
        "n = eqn.params['num_consts']",
        "b = eqn.params.get('jaxpr')",
        "c = params[f'{part}_jaxpr']",
        "p = {**eqn.params, 'num_consts': 3}",
        "p = dict(params, length=2)",
        "ok = eqn.primitive.name == 'scan'",
        "ok = name in ('jit', 'pjit')",
        "ok = eqn.primitive.name not in {'while', 'cond'}",
        "CALLS = ('jit', 'closed_call')",
        "f = {'scan': add_scan}[name]",
        "register('remat2')",
        "params = eqn.primitive.get_bind_params(eqn.params)",
        "cm = eqn.ctx.manager",
    ],
)
def test_the_rule_finds_a_planted_read(line):
    # The control: each kind of read, planted in a module, is found.
    assert len(internal_reads(line)) == 1, line


def test_the_rule_leaves_public_jax_and_other_parameters_alone():
    source = """
from jax.extend.core import ClosedJaxpr, Var, jaxprs_in_params
from jax import lax
ok = eqn.primitive is lax.scan_p
dims = eqn.params["dimension_numbers"]
shape = eqn.params.get("shape")
name = eqn.params["name"]  # alpa's own marker
piece = ("scan", first, end)
for part, jaxpr in (("cond", cond), ("body", body)):
    pass
"""
    assert internal_reads(source) == []


# ----------------------------------------------------------------------------- the accessors


def _eqn(fun, *args, name: str):
    eqns = [e for e in jax.make_jaxpr(fun)(*args).eqns if e.primitive.name == name]
    assert len(eqns) == 1, [e.primitive.name for e in jax.make_jaxpr(fun)(*args).eqns]
    return eqns[0]


def _scan_fn(w, c0, xs):
    def body(c, x):
        return c * w + x, c + 1.0

    return lax.scan(body, c0, xs, reverse=True)


def test_scan_parts():
    w, c0, xs = jnp.float32(2.0), jnp.float32(1.0), jnp.arange(5.0)
    eqn = _eqn(_scan_fn, w, c0, xs, name="scan")
    parts = ji.scan_parts(eqn)
    assert ji.is_scan(eqn) and not ji.is_while(eqn) and not ji.is_cond(eqn)
    assert (parts.num_consts, parts.num_carry, parts.length, parts.reverse) == (1, 1, 5, True)
    assert parts.first_stacked == 2 == len(eqn.invars) - 1
    assert isinstance(parts.body, ClosedJaxpr) and isinstance(parts.jaxpr, Jaxpr)
    assert len(parts.jaxpr.invars) == len(eqn.invars)
    assert ji.scan_parts(eqn.params) == parts  # the parameters alone serve too


def test_scan_params_adds_leading_constants_and_changes_the_trip_count():
    w, c0, xs = jnp.float32(2.0), jnp.float32(1.0), jnp.arange(5.0)
    eqn = _eqn(_scan_fn, w, c0, xs, name="scan")
    parts = ji.scan_parts(eqn)
    body, consts = ji.open_jaxpr(parts.body)
    unused = Var(jax.typeof(jnp.float32(0)))  # the new body's one more leading constant
    new_body = new_jaxpr(body, body.constvars, [unused, *body.invars], body.outvars, body.eqns)
    params = ji.scan_params(eqn.params, body=ClosedJaxpr(new_body, consts), num_new_consts=1)
    assert ji.scan_parts(params).num_consts == 2 and ji.scan_parts(params).num_carry == 1
    got = lax.scan_p.bind(jnp.float32(7.0), w, c0, xs, **params)
    want = _scan_fn(w, c0, xs)
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1])
    shorter = ji.scan_params(eqn.params, length=3)
    assert ji.scan_parts(shorter).length == 3 and ji.scan_parts(eqn).length == 5
    c3, ys3 = lax.scan_p.bind(w, c0, xs[2:], **shorter)
    assert ys3.shape == (3,)


def test_while_parts_and_params():
    def f(limit, step, x):
        return lax.while_loop(lambda c: c < limit, lambda c: c + step, x)

    args = (jnp.float32(10.0), jnp.float32(3.0), jnp.float32(0.0))
    eqn = _eqn(f, *args, name="while")
    parts = ji.while_parts(eqn)
    assert ji.is_while(eqn) and (parts.cond_nconsts, parts.body_nconsts) == (1, 1)
    assert isinstance(parts.cond, ClosedJaxpr) and isinstance(parts.body, ClosedJaxpr)
    params = ji.while_params(eqn.params, parts.cond, parts.body, 0, 0)
    assert ji.while_parts(params) == parts
    assert float(lax.while_p.bind(*args, **params)[0]) == 12.0


def test_cond_branches_and_params():
    def f(p, x):
        return lax.cond(p, lambda a: a + 1.0, lambda a: a * 3.0, x)

    eqn = _eqn(f, True, jnp.float32(2.0), name="cond")
    branches = ji.cond_branches(eqn)
    assert ji.is_cond(eqn) and len(branches) == 2
    assert all(isinstance(b, ClosedJaxpr) for b in branches)
    swapped = ji.cond_params(eqn.params, branches[::-1])
    assert ji.cond_branches(swapped) == branches[::-1]
    assert float(lax.cond_p.bind(np.int32(1), jnp.float32(2.0), **swapped)[0]) == 6.0


def test_remat_body_and_params():
    eqn = _eqn(jax.checkpoint(lambda x: jnp.sin(x) * 2.0), jnp.float32(1.0), name="remat2")
    body = ji.remat_body(eqn)
    assert ji.is_remat(eqn) and isinstance(body, Jaxpr) and not body.constvars
    assert "remat2" in ji.REMAT_PRIMITIVES
    params = ji.remat_params(eqn.params, body, 0)
    assert ji.remat_body(params) is body
    assert params["prevent_cse"] == eqn.params["prevent_cse"]
    flags = ji.remat_params({**eqn.params, "prevent_cse": (True,)}, body, 2)
    assert flags["prevent_cse"] == (True, False, False)


@pytest.mark.parametrize("kind", ["jit", "custom_jvp_call", "custom_vjp_call"])
def test_call_body(kind):
    if kind == "jit":
        fun = jax.jit(lambda x: jnp.sin(x) + 1.0)
    elif kind == "custom_jvp_call":
        fun = jax.custom_jvp(lambda x: jnp.sin(x) + 1.0)
        fun.defjvp(lambda p, t: (fun(*p), jnp.cos(p[0]) * t[0]))
    else:
        fun = jax.custom_vjp(lambda x: jnp.sin(x) + 1.0)
        fun.defvjp(lambda x: (fun(x), x), lambda x, g: (jnp.cos(x) * g,))
    eqn = _eqn(lambda x: fun(x) * 2.0, jnp.float32(1.0), name=kind)
    body, consts = ji.open_jaxpr(ji.call_body(eqn))
    assert [e.primitive.name for e in body.eqns] == ["sin", "add"]
    assert consts == []
    transparent = ji.call_body(eqn, ji.TRANSPARENT_CALLS)
    assert (transparent is not None) == (kind == "jit")
    assert not ji.is_remat(eqn) and not ji.is_scan(eqn)


def test_call_body_of_other_equations_is_none():
    eqn = _eqn(lambda x: jnp.sin(x), jnp.float32(1.0), name="sin")
    assert ji.call_body(eqn) is None


def test_open_jaxpr_of_open_and_closed():
    closed = jax.make_jaxpr(lambda x: x + np.arange(3.0))(jnp.zeros(3))
    jaxpr, consts = ji.open_jaxpr(closed)
    assert jaxpr is closed.jaxpr and len(consts) == len(closed.consts)
    assert ji.open_jaxpr(closed.jaxpr) == (closed.jaxpr, [])


def test_an_accessor_given_another_equation_says_what_it_expected():
    eqn = _eqn(lambda x: jnp.sin(x), jnp.float32(1.0), name="sin")
    with pytest.raises(
        ValueError, match=r"scan_parts: eqn is a `sin` equation; expected one of \['scan'\]"
    ):
        ji.scan_parts(eqn)
    with pytest.raises(ValueError, match=r"while_parts: eqn is a `sin` equation"):
        ji.while_parts(eqn)
    with pytest.raises(ValueError, match=r"cond_branches: eqn is a `sin` equation"):
        ji.cond_branches(eqn)
    with pytest.raises(ValueError, match=r"expected one of \['checkpoint', 'remat2'\]"):
        ji.remat_body(eqn)
    with pytest.raises(
        ValueError,
        match=r"scan_parts: expected an equation or the parameters of one of \['scan'\], "
        r"got dict \['length'\]",
    ):
        ji.scan_parts({"length": 3})


def test_an_equation_binds_again_with_its_params_under_its_context():
    closed = jax.make_jaxpr(lambda x: jnp.cumsum(x * 2.0))(jnp.arange(4.0))
    x = jnp.arange(4.0)
    env = {closed.jaxpr.invars[0]: x}
    for eqn in closed.jaxpr.eqns:
        params = ji.bind_params(eqn)
        params["__probe__"] = 1  # a copy: the equation's own parameters are left alone
        assert "__probe__" not in eqn.params
        del params["__probe__"]
        with ji.eqn_context(eqn):
            out = eqn.primitive.bind(
                *[env[v] if isinstance(v, Var) else v.val for v in eqn.invars], **params
            )
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))
    np.testing.assert_allclose(env[closed.jaxpr.outvars[0]], np.cumsum(np.arange(4.0) * 2))
