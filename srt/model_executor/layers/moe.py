"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and each expert
is a SwiGLU MLP whose weights are stacked with the others' (`w13`: gate rows then up rows, `w2`: down).

The step's tokens are grouped by expert (one sort of the (token, choice) pairs), and each expert that got any
tokens runs one matmul pair over all of them: a Python loop over the experts, never over tokens. Experts are
visited in ascending order and their weighted outputs summed into the tokens' rows in that order, as Hugging
Face's implementation does, so fp32 results match it.

Routing follows the checkpoint's family: softmax in fp32, top-k, then renormalized over the k chosen
(Mixtral always, Qwen3-MoE when `norm_topk_prob`); Qwen3-MoE casts the weights back to the model's dtype.
Each expert's projections multiply through the layer's linear method (`linear_method.py`) under the keys
`w13.E` and `w2.E`, so `--quantization w8a8_int8` gives every expert its int8 weights, calibrated on the
tokens routed to it, as it does a dense layer's. The router stays fp32 (its top-k choice is sensitive, its
matmul small).
Tensor parallelism splits every expert's inner dimension, like a dense MLP: each rank computes a partial
output for every token and one all-reduce sums them. The router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.model_executor.layers.linear import split_size
from srt.model_executor.layers.linear_method import LinearMethod
from srt.model_executor.parallel_state import TensorParallelGroup

GATE, UP, DOWN = "gate", "up", "down"


class FusedMoE(nn.Module):
    # the runner records no decode CUDA graph for a model with such a layer (seen failing on an H200)
    HOST_SYNC_REASON = "mixture-of-experts layers read each expert's token count on the host"

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_model_dtype: bool,
        tp: TensorParallelGroup,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={num_experts}]")
        self.tp = tp
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.inter = split_size(intermediate_size, tp, "the experts' intermediate size")
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, replicated
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))
        self.method = method or LinearMethod()
        self._keys = [(f"w13.{e}", f"w2.{e}") for e in range(num_experts)]

    # ---- the linear method's view (`LinearWeights`) ----
    def weight_keys(self) -> list[str]:
        return [key for pair in self._keys for key in pair]

    def dense_weight(self, key: str) -> torch.Tensor:
        param, expert = key.split(".")
        return getattr(self, param)[int(expert)]

    def drop_dense_weights(self) -> None:
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)

    # ---- loading: one checkpoint tensor per (expert, projection) ----
    def checkpoint_shards(self, param: str) -> set:
        if param == "w13":
            return {(GATE, e) for e in range(self.num_experts)} | {(UP, e) for e in range(self.num_experts)}
        if param == "w2":
            return {(DOWN, e) for e in range(self.num_experts)}
        return {None}

    def checkpoint_slice(self, param: str, shard, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(our region, the checkpoint part that belongs in it) for one expert's projection."""
        if shard is None:  # the router
            return getattr(self, param).data, tensor
        kind, expert = shard
        mine = tensor.narrow(0 if kind != DOWN else 1, self.tp.rank * self.inter, self.inter)
        if kind == DOWN:
            return self.w2.data[expert], mine
        offset = 0 if kind == GATE else self.inter
        return self.w13.data[expert].narrow(0, offset, self.inter), mine

    # ---- forward ----
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(router_logits.dtype)
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        rows_by_pair = order // self.top_k
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            rows = rows_by_pair[start : start + n]
            start += n
            key13, key2 = self._keys[expert]
            gate, up = self.method.apply(self, x[rows], None, key13).split(self.inter, dim=-1)
            y = self.method.apply(self, F.silu(gate) * up, None, key2) * flat_weights[pairs, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return self.tp.all_reduce(out)
