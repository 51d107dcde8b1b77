"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over the paged KV cache.

QKV and gate/up projections are fused into one matmul each at load time; every op goes through `kernels.Ops`.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.context import get_context
from engine.model_config import ModelConfig
from kernels import Ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.ops = ops
        self.k_cache = self.v_cache = torch.empty(0)  # bound to this layer's slice of the pool by the runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = self.ops.rotary_embedding(q, k, positions, cos_sin_cache)
        self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                     ctx.query_start_loc, self.scale, max_query_len=ctx.max_query_len,
                                     max_seq_len=ctx.max_seq_len, num_splits=ctx.num_splits,
                                     num_decodes=ctx.num_decodes)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.self_attn = Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, x, residual, cos_sin_cache):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", rotary_cos_sin_cache(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the flattened batch."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x

    def logits_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.logits_weight()).float()


def rotary_cos_sin_cache(cfg: ModelConfig) -> torch.Tensor:
    """[max_position_embeddings, head_dim] float32, on the default device: the cosines of every position times
    every rotary frequency in the first half of each row, the sines in the second (computed in float64)."""
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
    freqs = torch.outer(positions, cfg.rope_inv_freq())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
