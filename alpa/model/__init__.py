"""Flax linen models shared by alpa's users, tests and benchmarks.

Each model module offers its modules, a frozen config, and a factory
``get_<model>_train_state_and_step(...) -> (state, batch, train_step)``; see
:mod:`alpa.model.model_util` for what the factories share (``grad_func``, ``abstract``).
"""

from alpa.model.bert import (
    BertConfig,
    FlaxBertForMaskedLM,
    FlaxBertLayer,
    FlaxBertLayerCollection,
    get_bert_train_state_and_step,
)
from alpa.model.gpt import (
    GPT_PRESETS,
    FlaxGPTForLMModule,
    GPTBlock,
    GPTConfig,
    get_gpt_train_state_and_step,
    gpt_lm_loss,
)
from alpa.model.layers import FeedForward, MultiHeadAttention, dot_product_attention
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.model.model_util import (
    TrainState,
    count_params,
    make_optimizer,
    softmax_cross_entropy,
)
from alpa.model.moe import (
    FlaxMoEForLMModule,
    MoEConfig,
    MoELayer,
    Top2Routing,
    expert_capacity,
    get_moe_train_state_and_step,
    top2_gating,
)
from alpa.model.wide_resnet import (
    WRESNET_PRESETS,
    WResNet,
    WResNetConfig,
    get_wresnet_train_state_and_step,
)

__all__ = [
    "GPT_PRESETS",
    "WRESNET_PRESETS",
    "BertConfig",
    "FeedForward",
    "FlaxBertForMaskedLM",
    "FlaxBertLayer",
    "FlaxBertLayerCollection",
    "FlaxGPTForLMModule",
    "FlaxMoEForLMModule",
    "GPTBlock",
    "GPTConfig",
    "MLPModel",
    "MoEConfig",
    "MoELayer",
    "MultiHeadAttention",
    "Top2Routing",
    "TrainState",
    "WResNet",
    "WResNetConfig",
    "count_params",
    "dot_product_attention",
    "expert_capacity",
    "get_bert_train_state_and_step",
    "get_gpt_train_state_and_step",
    "get_mlp_train_state_and_step",
    "get_moe_train_state_and_step",
    "get_wresnet_train_state_and_step",
    "gpt_lm_loss",
    "make_optimizer",
    "softmax_cross_entropy",
    "top2_gating",
]
