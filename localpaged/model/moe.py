"""A mixture of experts in place of the MLP (Qwen3-MoE): a router picks each token's top-k
experts, whose outputs are summed weighted by the router's probabilities.

The step's tokens are sorted by expert, so each chosen expert runs once over all of its
tokens (one matmul per expert and projection, whatever the number of tokens); the experts
are ordinary MLP layers, so 4-bit and 8-bit experts run on the same kernels as any layer.
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.model.config import ModelConfig


class SparseMoE(nn.Module):
    """`gate` (the router, hidden -> num_experts) and `experts` (MLPs), HF's names."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        from localpaged.model.llama import MLP

        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=dtype,
                              device=device)
        self.experts = nn.ModuleList(
            MLP(config, dtype, device, intermediate_size=config.moe_intermediate_size)
            for _ in range(config.num_experts))

    def fuse_projections(self) -> None:
        for expert in self.experts:
            expert.fuse_projections()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]): softmax over the router's logits in
        float32, its top k, renormalized to sum 1 where the config says so."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if x.shape[0] == 1:  # one token (a lone chat's decode step): no sorting, no scatter
            out = torch.zeros_like(x)
            for expert, j in sorted(zip(chosen[0].tolist(), range(self.top_k))):
                out += self.experts[expert](x) * weights[0, j]
            return out
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        token_weights = weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        start = 0
        # Experts in increasing order, each adding into `out`: transformers' summation order.
        for expert, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count:
                rows = tokens[start:start + count]
                y = self.experts[expert](x.index_select(0, rows))
                out.index_add_(0, rows, y * token_weights[start:start + count])
                start += count
        return out
