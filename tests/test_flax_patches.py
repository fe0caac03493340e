"""Alpa's additions to flax: installed by ``alpa.init()``, never by an import."""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa
from alpa.global_env import global_config
from alpa.testing import assert_allclose


def test_importing_alpa_patches_nothing_and_init_installs_the_patches():
    script = textwrap.dedent(
        """
        import flax.linen as nn
        import alpa, alpa.model.gpt_model, alpa.model.model_util, alpa.runtime.ray_worker
        before = (hasattr(nn.Module, "init_dummy"), hasattr(nn.Embed, "embedding_fp16"))
        alpa.init("local")
        print(before, (hasattr(nn.Module, "init_dummy"), hasattr(nn.Embed, "embedding_fp16")))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "(False, False) (True, True)"


@pytest.fixture
def patched():
    alpa.init("local")
    saved = global_config.flax_always_use_fp16_embedding
    yield
    global_config.flax_always_use_fp16_embedding = saved


class _Tied(nn.Module):
    """An embedding defined in ``setup`` and read by its parent, as Alpa's OPT does."""

    def setup(self):
        self.word = nn.Embed(10, 4)

    def __call__(self, ids):
        h = self.word(ids)
        return h, self.word.embedding_fp16


def test_embed_float16_table_and_lookups_under_the_setting(patched):
    ids = jnp.array([[1, 2, 9]])
    model = _Tied()
    params = model.init(jax.random.PRNGKey(0), ids)
    table = np.asarray(params["params"]["word"]["embedding"])
    h, fp16 = model.apply(params, ids)
    assert h.dtype == jnp.float32 and fp16.dtype == jnp.float16
    assert_allclose(h, table[np.asarray(ids)])  # flax's own lookup
    assert_allclose(fp16, table.astype(np.float16))
    global_config.flax_always_use_fp16_embedding = True
    h, _ = model.apply(params, ids)
    assert h.dtype == jnp.float16
    assert_allclose(h, table.astype(np.float16)[np.asarray(ids)])
    with pytest.raises(ValueError, match="Input type must be an integer"):
        model.apply(params, ids.astype(jnp.float32))


def test_every_module_has_init_dummy(patched):
    variables = nn.Dense(3).init_dummy(jax.random.PRNGKey(0), jnp.ones((1, 2)))
    assert_allclose(variables["params"]["kernel"], np.full((2, 3), 1e-8, np.float32))
    assert_allclose(variables["params"]["bias"], np.full((3,), 1e-8, np.float32))
