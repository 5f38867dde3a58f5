"""Tensor parallelism (Megatron style) for the target model: each rank of a group holds a slice
of every layer and the layers' outputs are summed with one all-reduce after attention and one
after the MLP.

- Attention: GQA groups (one K/V head and its H/Hkv query heads) are split across ranks:
  q/k/v are column slices, o_proj a row slice. Each rank keeps only its K/V heads in its cache.
- MLP: gate/up are column slices of the intermediate dimension, down a row slice.
- Embeddings, norms and lm_head are replicated (the all-reduced hidden state is the same on
  every rank, so every rank computes the same logits and can verify on its own).

Where a split does not divide (Hkv groups or the intermediate size by the group size), the last
rank's slice is padded with zero weights. A zero query/key/value head attends uniformly to zero
values and its o_proj columns are zero; a zero gate/up row gives silu(0) * 0 = 0: the padding
adds exactly nothing (SwiftSpec zero-pads the same way for splits like 6 GPUs).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from tandem.models.transformer import Transformer


def _take(w: torch.Tensor, blocks: list[int | None], size: int, dim: int) -> torch.Tensor:
    """Concatenate blocks of `size` along `dim` (block index, or None for a zero block)."""
    parts = []
    for b in blocks:
        if b is None:
            shape = list(w.shape)
            shape[dim] = size
            parts.append(torch.zeros(shape, dtype=w.dtype, device=w.device))
        else:
            parts.append(w.narrow(dim, b * size, size))
    return torch.cat(parts, dim=dim).contiguous()


def _span(w: torch.Tensor, start: int, length: int, dim: int) -> torch.Tensor:
    """w[start:start + length] along `dim`, zero-padded where it runs past the end."""
    real = max(0, min(length, w.shape[dim] - start))
    part = w.narrow(dim, start, real) if real else w.narrow(dim, 0, 0)
    if real == length:
        return part.contiguous()
    shape = list(w.shape)
    shape[dim] = length - real
    return torch.cat([part, torch.zeros(shape, dtype=w.dtype, device=w.device)], dim=dim)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


@torch.no_grad()
def shard_model(model: Transformer, rank: int, size: int, group: dist.ProcessGroup | None) -> Transformer:
    """A copy of `model` holding rank `rank`'s shard of a `size`-way split; its attention and MLP
    all-reduce over `group` (None only for tests that sum shards by hand)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
    m = copy.deepcopy(model)
    cfg = m.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qpg = H // Hkv  # query heads per K/V group
    g_per = -(-Hkv // size)  # groups per rank, padded
    groups = [g if g < Hkv else None for g in range(rank * g_per, (rank + 1) * g_per)]
    q_heads = [None if g is None else g * qpg + j for g in groups for j in range(qpg)]
    inter = cfg.intermediate_size
    i_per = -(-inter // size)  # this rank's intermediate columns [rank * i_per, (rank + 1) * i_per), padded
    for layer in m.model.layers:
        a = layer.self_attn
        a.q_proj = _linear(_take(a.q_proj.weight, q_heads, D, 0),
                           None if a.q_proj.bias is None else _take(a.q_proj.bias, q_heads, D, 0))
        a.k_proj = _linear(_take(a.k_proj.weight, groups, D, 0),
                           None if a.k_proj.bias is None else _take(a.k_proj.bias, groups, D, 0))
        a.v_proj = _linear(_take(a.v_proj.weight, groups, D, 0),
                           None if a.v_proj.bias is None else _take(a.v_proj.bias, groups, D, 0))
        a.o_proj = _linear(_take(a.o_proj.weight, q_heads, D, 1), None)
        a.n_heads, a.n_kv = len(q_heads), len(groups)
        # NOTE: a runner may have fused the full model's projections (the separate weights stay
        # valid views); the shard starts unfused and its own runner fuses it
        a.qkv_weight = a.qkv_bias = layer.mlp.gate_up_weight = None
        a.tp_group = group
        mlp = layer.mlp
        mlp.gate_proj = _linear(_span(mlp.gate_proj.weight, rank * i_per, i_per, 0), None)
        mlp.up_proj = _linear(_span(mlp.up_proj.weight, rank * i_per, i_per, 0), None)
        mlp.down_proj = _linear(_span(mlp.down_proj.weight, rank * i_per, i_per, 1), None)
        mlp.tp_group = group
    m.config = dataclasses.replace(cfg, num_attention_heads=len(q_heads), num_key_value_heads=len(groups),
                                   intermediate_size=i_per)
    m.tp = (rank, size)
    return m
