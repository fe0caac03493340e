"""Alpa's BERT at Alpa's path: ``alpa.model.bert_model``, its config and modules by their names.

Alpa's benchmarks and examples build BERT (and GPT, :mod:`alpa.model.gpt_model`) as
``BertConfig(vocab_size=, hidden_size=, num_hidden_layers=, num_attention_heads=, ...)``
and ``FlaxBertForMaskedLMModule(config, dtype=)``, called as
``apply(params, input_ids, attention_mask, token_type_ids, position_ids,
deterministic=True)`` and read as ``output[0]`` / ``output.logits``. The modules here are
thin: the maths is :mod:`alpa.model.bert`'s (post-LN layers, the embeddings' LayerNorm, the
masked-LM head with the tied word embedding), the config is translated field by field
(:meth:`BertConfig.to_config`), the module's ``dtype`` is the compute dtype, and outputs
are Alpa's ``ModelOutput`` records.

What is not here, and raises rather than running differently: dropout (alpa's layers have
none: a call with ``deterministic=False`` and a dropout probability above 0 raises),
another ``initializer_range`` than 0.02 or ``position_embedding_type`` than
``"absolute"``, ``output_attentions`` and ``output_hidden_states``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa.model import bert
from alpa.model.layers import ACTIVATIONS, INIT_STD
from alpa.model.model_output import FlaxBaseModelOutput, FlaxMaskedLMOutput
from alpa.model.model_util import DType, TrainState  # noqa: F401 (Alpa's path of TrainState)
from alpa.model.train_state import DummyInit


@dataclass(frozen=True)
class BertConfig:
    """Alpa's (and Hugging Face's) BERT configuration, by its field names and defaults.

    ``gradient_checkpointing`` rematerializes every layer; ``add_manual_pipeline_markers``
    marks a pipeline boundary after every ``num_hidden_layers / pipeline_mp_size`` layers
    (every layer when ``pipeline_mp_size`` is 0); ``type_vocab_size=0`` drops the
    token-type embedding. ``None`` for a flag means off, as Alpa's benchmarks pass it.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    gradient_checkpointing: bool | None = False
    position_embedding_type: str = "absolute"
    use_cache: bool = True
    classifier_dropout: float | None = None
    num_labels: int | None = None
    tie_word_embeddings: bool = True
    add_manual_pipeline_markers: bool | None = False
    pipeline_mp_size: int | None = 0

    def __post_init__(self) -> None:
        if self.initializer_range != INIT_STD:
            raise ValueError(
                f"initializer_range={self.initializer_range!r}: alpa.model's layers "
                f"initialize with N(0, {INIT_STD}^2); expected {INIT_STD}"
            )
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r}: only "
                "'absolute' (learned positions) is implemented"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}"
            )
        self.to_config(jnp.float32)  # every size checked now, in the user's terms

    def to_config(self, dtype: DType) -> bert.BertConfig:
        """The same model as :class:`alpa.model.bert.BertConfig`, computing in ``dtype``."""
        return bert.BertConfig(
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            type_vocab_size=self.type_vocab_size,
            layer_norm_epsilon=self.layer_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            dtype=dtype,
            add_manual_pipeline_markers=bool(self.add_manual_pipeline_markers),
            gradient_checkpointing=bool(self.gradient_checkpointing),
            hidden_act=self.hidden_act,
            pipeline_mp_size=self.pipeline_mp_size or None,
        )


def check_call(
    config: BertConfig, deterministic: bool, output_attentions: bool, output_hidden_states: bool
) -> None:
    """Refuse what the modules of this file do not compute (see the module docstring)."""
    dropout = max(config.hidden_dropout_prob, config.attention_probs_dropout_prob)
    if not deterministic and dropout > 0:
        raise NotImplementedError(
            f"deterministic=False with dropout (hidden_dropout_prob="
            f"{config.hidden_dropout_prob}, attention_probs_dropout_prob="
            f"{config.attention_probs_dropout_prob}): alpa.model's layers have no dropout; "
            "pass deterministic=True or set both probabilities to 0"
        )
    if output_attentions or output_hidden_states:
        raise NotImplementedError(
            "output_attentions / output_hidden_states: alpa.model's BERT layers return the "
            "last hidden state only"
        )


class FlaxBertLayerCollection(DummyInit, nn.Module):
    """Alpa's stack of ``num_hidden_layers`` encoder layers:
    ``hidden_states[batch, seq, hidden] -> FlaxBaseModelOutput(last_hidden_state=...)``."""

    config: BertConfig
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(
        self,
        hidden_states: jax.Array,
        attention_mask: jax.Array | None,
        deterministic: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ) -> Any:
        check_call(self.config, deterministic, output_attentions, output_hidden_states)
        layers = bert.FlaxBertLayerCollection(self.config.to_config(self.dtype), name="layer")
        out = layers(hidden_states, attention_mask, deterministic)
        return FlaxBaseModelOutput(last_hidden_state=out) if return_dict else (out,)


class FlaxBertForMaskedLMModule(DummyInit, nn.Module):
    """Alpa's BERT with its masked-LM head:
    ``input_ids[batch, seq] -> FlaxMaskedLMOutput(logits[batch, seq, vocab])``."""

    config: BertConfig
    dtype: DType = jnp.float32

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
        check_call(self.config, deterministic, output_attentions, output_hidden_states)
        model = bert.FlaxBertForMaskedLM(self.config.to_config(self.dtype), name="bert")
        logits = model(input_ids, attention_mask, token_type_ids, position_ids, deterministic)
        return FlaxMaskedLMOutput(logits=logits) if return_dict else (logits,)
