"""PyTorch reference paged attention: the CPU backend and the oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def _plan(meta: AttentionMetadata, block_size: int):
    """Per sub-request (row range, first position, flat slot indices of its keys); cached per step."""
    key = ("torch_plan", block_size)
    if key not in meta.derived:
        starts = meta.query_start.tolist()
        pos = meta.query_pos.tolist()
        tables = meta.block_tables
        plan = []
        for s in range(len(pos)):
            q_len = starts[s + 1] - starts[s]
            kv_len = pos[s] + q_len
            n_blocks = -(-kv_len // block_size)
            blocks = tables[s, :n_blocks].long()
            slots = blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)
            plan.append((starts[s], starts[s + 1], pos[s], slots.reshape(-1)[:kv_len]))
        meta.derived[key] = plan
    return meta.derived[key]


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for start, end, pos, slots in _plan(meta, block_size):
        q_len = end - start
        if q_len == 0:
            continue
        k = k_flat.index_select(0, slots).transpose(0, 1)  # [kvh, L, d]
        v = v_flat.index_select(0, slots).transpose(0, 1)
        qs = q[start:end].transpose(0, 1)  # [h, q, d]
        kv_len = k.shape[1]
        if q_len == 1:
            mask = None
        else:
            # query i sits at position pos + i and sees keys [0, pos + i].
            qi = torch.arange(q_len, device=q.device)[:, None] + pos
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qi
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def write_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store new keys/values [T, kvh, d] at flat slots (block * block_size + offset)."""
    num_blocks, block_size, kvh, d = k_cache.shape
    k_cache.view(-1, kvh, d).index_copy_(0, slots.long(), k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slots.long(), v.to(v_cache.dtype))
