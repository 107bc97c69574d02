"""The routed-expert math shared by the model and the cache (``routed.py``).

``routed_experts(x, ids, weights, bank, layer, ffn_dim=, impl=)``: the weighted sum of the
routed SwiGLU experts of one bank layer, in XLA or in the host kernel. ``BankExperts``: the
reference routed-experts function (every route from the host bank). ``split_block``: an
expert block's gate, up and down views.
"""

from ftjax.experts.routed import KERNELS, BankExperts, routed_experts, split_block

__all__ = ["KERNELS", "BankExperts", "routed_experts", "split_block"]
