"""Model outputs as Alpa's (and Hugging Face's) models return them: ``ModelOutput``.

A model output is a record of named arrays, some of which a call leaves out
(``hidden_states`` when they were not asked for). Alpa's models, and the models its users
wrote on top of ``alpa.model.model_util.ModelOutput`` (the OPT model of Alpa's serving
example), return one, and their callers read it three ways:

* by position, as a tuple of the fields that are not ``None``: ``model.apply(...)[0]`` is
  the logits;
* by name, as a dict: ``output["logits"]``;
* by attribute: ``output.logits``.

A ``ModelOutput`` is an ``OrderedDict`` of its non-``None`` fields, in field order. Its
subclasses are ``flax.struct.dataclass`` es, hence pytrees (they cross ``jax.jit`` and
``alpa.parallelize``; jax rebuilds them through their constructor, which fills the dict
again). They are frozen: ``replace`` makes a new one, and the dict cannot be edited.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Any

import flax


class ModelOutput(OrderedDict):
    """The base of a model's output record (see the module docstring).

    Subclass it with ``@flax.struct.dataclass`` and fields that default to ``None``.
    """

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self):
            raise TypeError(
                f"{type(self).__name__} must be a dataclass: decorate it with "
                "@flax.struct.dataclass and give it fields"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                OrderedDict.__setitem__(self, f.name, value)

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return OrderedDict.__getitem__(self, key)
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        """The fields that are not ``None``, in field order."""
        return tuple(self.values())

    def __reduce__(self):
        # OrderedDict's own reduction refills the dict item by item, which is frozen here.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return functools.partial(type(self), **fields), ()

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            f"a {type(self).__name__} cannot be changed in place; make a new one with "
            ".replace(field=value)"
        )

    __setitem__ = __delitem__ = setdefault = pop = popitem = update = clear = _frozen  # type: ignore[assignment]


@flax.struct.dataclass
class FlaxBaseModelOutput(ModelOutput):
    """An encoder's output: ``last_hidden_state[batch, seq, hidden]`` and, when asked
    for, every layer's input (``hidden_states``) and attention weights."""

    last_hidden_state: Any = None
    hidden_states: Any = None
    attentions: Any = None


@flax.struct.dataclass
class FlaxBaseModelOutputWithPooling(ModelOutput):
    """An encoder's output with the pooled first token (``pooler_output[batch, hidden]``)."""

    last_hidden_state: Any = None
    pooler_output: Any = None
    hidden_states: Any = None
    attentions: Any = None


@flax.struct.dataclass
class FlaxMaskedLMOutput(ModelOutput):
    """A language model's output: ``logits[batch, seq, vocab]``."""

    logits: Any = None
    hidden_states: Any = None
    attentions: Any = None


@flax.struct.dataclass
class FlaxBertForPreTrainingOutput(ModelOutput):
    """BERT pre-training: masked-LM ``prediction_logits`` and next-sentence
    ``seq_relationship_logits``."""

    prediction_logits: Any = None
    seq_relationship_logits: Any = None
    hidden_states: Any = None
    attentions: Any = None


@flax.struct.dataclass
class FlaxSequenceClassifierOutput(ModelOutput):
    """A classifier's ``logits[batch, num_labels]``."""

    logits: Any = None
    hidden_states: Any = None
    attentions: Any = None
