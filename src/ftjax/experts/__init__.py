"""The routed-expert math shared by the model and the cache (``routed.py``).

``routed_experts(x, ids, weights, bank, layer, ffn_dim=, kernels=)``: the weighted sum of the
routed SwiGLU experts of one bank layer (``ExpertVariant``: the activation, e.g. gpt-oss's
clamped SwiGLU, and per-expert biases), in XLA or in the host kernel. ``BankExperts``: the
reference routed-experts function (every route from the host bank). ``split_block``: an
expert block's gate, up and down views.
"""

from ftjax.experts.routed import (KERNELS, BankExperts, activate, routed_experts, split_biases,
                                  split_block)
from ftjax.kernels.expert_ffn import SWIGLU, ExpertVariant

__all__ = ["KERNELS", "SWIGLU", "BankExperts", "ExpertVariant", "activate", "routed_experts",
           "split_biases", "split_block"]
