r"""Alpa's GPT at Alpa's path: ``alpa.model.gpt_model.FlaxGPTForLMModule(BertConfig, dtype=)``.

Alpa's benchmark GPT is its BERT body with a language-model head and no masked-LM
transform: the embeddings and ``num_hidden_layers`` post-LN encoder layers
(:func:`alpa.model.bert.bert_encode`, the maths of :mod:`alpa.model.bert`), then

.. math::
    \mathrm{logits} = h \, E_{\mathrm{word}}^\top + b

with the word embedding :math:`E_{\mathrm{word}}` tied (an untied ``decoder`` kernel with
``tie_word_embeddings=False``) and a bias ``b`` initialized by ``bias_init``. As in Alpa,
attention is masked by ``attention_mask`` (padding) only: there is no causal mask. The
causal, pre-LN GPT-2 of this package is :class:`alpa.model.gpt.FlaxGPTForLMModule`.

The module takes Alpa's :class:`alpa.model.bert_model.BertConfig` and its call
``apply(params, input_ids, attention_mask, token_type_ids, position_ids,
deterministic=True)``; it returns a ``FlaxMaskedLMOutput`` (``output[0]`` is the logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa.model.bert import bert_encode
from alpa.model.bert_model import BertConfig, check_call
from alpa.model.layers import dense
from alpa.model.model_output import FlaxMaskedLMOutput
from alpa.model.model_util import DType, TrainState  # noqa: F401 (Alpa's path of TrainState)
from alpa.model.train_state import DummyInit


class FlaxGPTForLMModule(DummyInit, nn.Module):
    """``input_ids[batch, seq] -> FlaxMaskedLMOutput(logits[batch, seq, vocab])`` (see the
    module docstring)."""

    config: BertConfig
    dtype: DType = jnp.float32
    bias_init: Callable[..., jax.Array] = nn.initializers.zeros

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ) -> Any:
        cfg = self.config
        check_call(cfg, deterministic, output_attentions, output_hidden_states)
        hidden, word_embeddings = bert_encode(
            cfg.to_config(self.dtype),
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            deterministic,
        )
        if cfg.tie_word_embeddings:
            logits = word_embeddings.attend(hidden)
        else:
            logits = dense(cfg.vocab_size, self.dtype, "decoder", use_bias=False)(hidden)
        bias = self.param("bias", self.bias_init, (cfg.vocab_size,), jnp.float32)
        logits = logits + jnp.asarray(bias, logits.dtype)
        return FlaxMaskedLMOutput(logits=logits) if return_dict else (logits,)
