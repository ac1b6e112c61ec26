# The hot ops of every forward: paged KV store, unified varlen paged attention, RMSNorm, rotary,
# SiLU-and-mul, and the rejection-sampling steps. Each op has a plain-torch reference (`torch_*`) and,
# where it pays on a GPU, a Triton kernel (`triton_*`) with the same signature; one public function per
# op picks. Never pick Triton for a CPU tensor unless forced (tests under TRITON_INTERPRET=1).
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Tests set this (or NANOSPEC_TRITON=1) to run the Triton kernels on CPU under TRITON_INTERPRET=1.
FORCE_TRITON = os.environ.get("NANOSPEC_TRITON") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or FORCE_TRITON


# ---------------------------------------------------------------------------------------------
# Per-step attention metadata. Set once per forward; every attention layer reads it, so nothing
# has to be threaded through the model's call signatures.
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor     # [T] cache slot of each new token (-1: do not store)
    block_tables: torch.Tensor     # [B, max_blocks] block ids per sequence (-1 padded)
    seq_lens: torch.Tensor         # [B] context length including this step's tokens
    query_start_loc: torch.Tensor  # [B+1] cu_seqlens of the packed queries
    max_q_len: int                 # host-side maxima, so no op needs a device->host sync
    max_seq_len: int


_context: AttentionContext | None = None


def set_context(ctx: AttentionContext | None):
    global _context
    _context = ctx


def get_context() -> AttentionContext:
    assert _context is not None, "attention called outside an engine step (no AttentionContext set)"
    return _context


# ---------------------------------------------------------------------------------------------
# Torch reference ops (also the fast CPU path: batched across sequences, no per-token loops).
# ---------------------------------------------------------------------------------------------
def torch_store_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot -1 = skip."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def torch_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          max_q_len, max_seq_len):
    """Causal attention of packed queries q [T, Hq, D] over the paged cache -> [T, Hq, D].

    Query j of sequence b sits at position seq_lens[b] - q_len_b + j and sees cached positions <= it.
    The CPU path gathers each sequence's context once, pads queries to [B, max_q_len] and runs one
    batched SDPA with a position mask (GQA handled by SDPA).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size = k_cache.shape[1]
    if num_tokens == 0:
        return q.new_empty(q.shape)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # Gather context K/V: [B, L, Hkv, D] with L = max_seq_len.
    pos = torch.arange(max_seq_len, device=q.device)
    blocks = block_tables[:, pos // block_size].clamp_min(0).long()
    slots = blocks * block_size + pos % block_size
    k = k_cache.view(-1, *k_cache.shape[2:])[slots].transpose(1, 2)
    v = v_cache.view(-1, *v_cache.shape[2:])[slots].transpose(1, 2)
    # Pad queries into [B, max_q_len]: token t is query j of sequence b.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens,
                                           output_size=num_tokens)
    j_of_token = torch.arange(num_tokens, device=q.device) - query_start_loc[seq_of_token]
    row = seq_of_token * max_q_len + j_of_token
    q_pad = q.new_zeros(num_seqs * max_q_len, num_heads, head_dim)
    q_pad[row] = q
    q_pad = q_pad.view(num_seqs, max_q_len, num_heads, head_dim).transpose(1, 2)
    # Position mask: key l visible to query j of b iff l <= seq_lens[b] - q_len_b + j.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q_len, device=q.device)[None, :]
    mask = pos[None, None, :] <= q_pos[:, :, None]
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=num_heads != k.shape[1])
    return out.transpose(1, 2).reshape(num_seqs * max_q_len, num_heads, head_dim)[row]


def torch_rms_norm(x, weight, eps, residual=None):
    """RMSNorm computed in fp32 (as HF does). With residual: x += residual first; returns (normed, sum)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return normed if residual is None else (normed, residual)


def torch_rotary(q, k, positions, cos_sin_cache):
    """Neox-style rotary on q [T, Hq, D] and k [T, Hkv, D]; cos_sin_cache [max_pos, D] = [cos | sin]."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def torch_silu_mul(x):
    """x: [T, 2I] = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts, uniform, exp_noise):
    """Lossless speculative acceptance for a padded batch.

    target_probs [B, K+1, V]; draft_tokens [B, K]; draft_probs [B, K, V], or None for one-hot drafts
    (n-gram); num_drafts [B] (rows past it are padding); uniform [B, K] in [0, 1); exp_noise [B, V] Exp(1).
    Accept d_i with prob min(1, p(d_i) / q(d_i)) up to the first rejection; then emit one token: from
    norm(max(p - q, 0)) at a rejection (the "recovered" token) or from p at row K_b when every draft
    was accepted (the "bonus" token), sampled as argmax(dist / Exp(1)), which needs no normalisation.
    Returns (num_accepted [B], next_token [B]).
    """
    num_seqs, max_k = draft_tokens.shape
    batch = torch.arange(num_seqs, device=target_probs.device)
    if max_k == 0:
        return torch.zeros_like(num_drafts), (target_probs[:, 0] / exp_noise).argmax(-1)
    p_draft = target_probs[:, :max_k].gather(2, draft_tokens[..., None]).squeeze(-1)
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)
    accepted = (uniform * q_draft < p_draft) & (torch.arange(max_k, device=batch.device) < num_drafts[:, None])
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    p_next = target_probs[batch, num_accepted]
    at = num_accepted.clamp(max=max_k - 1)  # the rejected position (clamped when all were accepted)
    if draft_probs is None:  # one-hot q: max(p - q, 0) is p with the rejected token zeroed
        residual = p_next.scatter(1, draft_tokens[batch, at][:, None], 0.0)
    else:
        residual = (p_next - draft_probs[batch, at]).clamp_min(0)
    # A residual that rounds to all-zero can only come from p == q, where rejection had probability 0.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    dist = torch.where((num_accepted < num_drafts)[:, None], residual, p_next)
    return num_accepted, (dist / exp_noise).argmax(-1)


# ---------------------------------------------------------------------------------------------
# Public ops: one dispatch point each.
# ---------------------------------------------------------------------------------------------
def store_kv(k, v, k_cache, v_cache, slot_mapping):
    fn = triton_store_kv if use_triton(k) else torch_store_kv
    return fn(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_q_len, max_seq_len):
    fn = triton_paged_attention if use_triton(q) else torch_paged_attention
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
              max_q_len, max_seq_len)


def rms_norm(x, weight, eps, residual=None):
    fn = triton_rms_norm if use_triton(x) else torch_rms_norm
    return fn(x, weight, eps, residual)


def rotary(q, k, positions, cos_sin_cache):
    fn = triton_rotary if use_triton(q) else torch_rotary
    return fn(q, k, positions, cos_sin_cache)


def silu_mul(x):
    fn = triton_silu_mul if use_triton(x) else torch_silu_mul
    return fn(x)


def rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts, uniform, exp_noise):
    return torch_rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts, uniform, exp_noise)


def attention(q, k, v, k_cache, v_cache, scale):
    """What a model's attention layer calls: store this step's K/V, then attend over the cache."""
    ctx = get_context()
    store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    return paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                           ctx.query_start_loc, scale, ctx.max_q_len, ctx.max_seq_len)


# ---------------------------------------------------------------------------------------------
# Triton kernels (same signatures as the torch references above).
# ---------------------------------------------------------------------------------------------
def _triton_missing(*args, **kwargs):
    raise NotImplementedError("Triton kernels are not implemented yet")


triton_store_kv = triton_paged_attention = triton_rms_norm = triton_rotary = triton_silu_mul = _triton_missing
