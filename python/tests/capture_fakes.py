"""Stand-ins, on the CPU, for the attention APIs cpgold.capture records on a GPU: TransformerEngine's
DotProductAttention (a class of that name from a transformer_engine module, with the attributes and forward arguments
TE 2.x gives it), FlashAttention-3's flash_attn_interface.flash_attn_varlen_func (its signature; pad rows left
unwritten, as FA3 with seqused_q/k leaves them) and PyTorch's torch.nn.attention.varlen.varlen_attn (packed tokens,
LSE +inf on rows without keys, as FlashAttention-2). Their arithmetic is a float32 attention in torch; what the tests
exercise is how the capture reads their arguments and outputs."""
import math
import sys
import types
from collections import namedtuple

import numpy as np
import torch

import capture_ring


def reference_attention(q, k, v, cu_q, cu_kv, off_q=None, off_kv=None, causal=False, scale=None, window=(-1, -1)):
    """Attention of a THD batch whose sequence b holds the rows [off[b], off[b] + len[b]) (off None: packed at cu):
    o [Tq, hq, dv] (0 on every other row) in q's dtype, lse [hq, Tq] float32 (-inf there and on rows without keys)."""
    cu_q, cu_kv = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_kv, dtype=np.int64)
    off_q = cu_q if off_q is None else np.asarray(off_q, dtype=np.int64)
    off_kv = cu_kv if off_kv is None else np.asarray(off_kv, dtype=np.int64)

    def rows(cu, off, total):
        seq = np.full(total, -1)
        pos = np.full(total, -1)
        for b in range(len(cu) - 1):
            n = cu[b + 1] - cu[b]
            seq[off[b]:off[b] + n] = b
            pos[off[b]:off[b] + n] = np.arange(n)
        return torch.as_tensor(seq), torch.as_tensor(pos)

    seq_q, pos_q = rows(cu_q, off_q, q.shape[0])
    seq_k, pos_k = rows(cu_kv, off_kv, k.shape[0])
    lens_q, lens_k = torch.as_tensor(np.diff(cu_q)), torch.as_tensor(np.diff(cu_kv))
    visible = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)
    delta = lens_k[seq_k.clamp(min=0)][None, :] - lens_q[seq_q.clamp(min=0)][:, None]
    left, right = window
    if causal:
        right = 0
    if right is not None and right >= 0:
        visible &= pos_k[None, :] <= pos_q[:, None] + delta + right
    if left is not None and left >= 0:
        visible &= pos_k[None, :] >= pos_q[:, None] + delta - left
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    valid_q, valid_k = seq_q >= 0, seq_k >= 0
    qf = torch.where(valid_q[:, None, None], q.float(), torch.zeros(()))
    kf = torch.where(valid_k[:, None, None], k.float(), torch.zeros(()))
    vf = torch.where(valid_k[:, None, None], v.float(), torch.zeros(()))
    o, lse = capture_ring._partial(qf, kf, vf, visible, scale)
    return o.to(q.dtype), lse


class DotProductAttention(torch.nn.Module):
    """TransformerEngine's DotProductAttention as far as the capture reads it (constructor arguments, attributes,
    set_context_parallel_group, forward's argument names, O as [t, h * dv]); CP through capture_ring's ring."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="thd", attn_mask_type="padding_causal", window_size=None, softmax_scale=None):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.attention_dropout = attention_dropout
        self.softmax_type = "vanilla"
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = None, None, None, "p2p"
        d = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        # TE keeps the scale in its backends, not on the module
        self.fused_attention = types.SimpleNamespace(softmax_scale=scale)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (cp_group, cp_global_ranks,
                                                                                  cp_stream, cp_comm_type)

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                checkpoint_core_attention=False, core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill=True, inference_params=None, pad_between_seqs=None,
                qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3):
        if qkv_layer is not None:   # TE 2.20's declared packed input
            query_layer, key_layer, value_layer = (qkv_layer.select(qkv_interleave_dim, i) for i in range(3))
        elif kv_layer is not None:
            key_layer, value_layer = (kv_layer.select(qkv_interleave_dim, i) for i in range(2))
        fmt = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        causal = "causal" in mask
        scale = self.fused_attention.softmax_scale
        if fmt != "thd":   # a BSHD call: [b, s, h, d], no padding handled here
            b, s, h, d = query_layer.shape
            q = query_layer.reshape(b * s, h, d)
            cu = torch.arange(0, b * s + 1, s)
            o, _ = reference_attention(q, key_layer.reshape(b * s, -1, d), value_layer.reshape(b * s, -1, d), cu, cu,
                                       causal=causal, scale=scale)
            return o.reshape(b, s, -1)
        if self.cp_group is None:
            o, _ = reference_attention(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                       cu_seqlens_q_padded, cu_seqlens_kv_padded, causal=causal, scale=scale)
        else:
            o, _ = capture_ring.ring_attention(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                               cu_seqlens_q_padded, cu_seqlens_kv_padded, self.cp_group,
                                               causal=causal, scale=scale)
        return o.reshape(o.shape[0], -1)


DotProductAttention.__module__ = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
DotProductAttention.__qualname__ = "DotProductAttention"


UNWRITTEN = 7.0   # what the stand-in of FlashAttention-3 leaves on pad rows (a real kernel leaves whatever was there)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """flash_attn_interface.flash_attn_varlen_func's signature (FlashAttention-3): with seqused_q/k the sequences start
    at cu_seqlens_q/k and hold seqused tokens; pad rows of O hold UNWRITTEN. Returns out, or (out, lse [h, t])."""
    if seqused_q is not None:
        cu_q = np.concatenate([[0], np.cumsum(np.asarray(seqused_q))])
        cu_k = np.concatenate([[0], np.cumsum(np.asarray(seqused_k))])
        off_q, off_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    else:
        cu_q, cu_k, off_q, off_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k), None, None
    o, lse = reference_attention(q, k, v, cu_q, cu_k, off_q, off_k, causal=causal, scale=softmax_scale,
                                 window=window_size)
    if seqused_q is not None:
        written = torch.zeros(q.shape[0], dtype=torch.bool)
        for b in range(len(cu_q) - 1):
            written[int(off_q[b]):int(off_q[b]) + int(cu_q[b + 1] - cu_q[b])] = True
        o = torch.where(written[:, None, None], o, torch.full((), UNWRITTEN, dtype=o.dtype))
    return (o, lse) if return_attn_probs else o


AuxRequest = namedtuple("AuxRequest", ["lse"], defaults=[False])


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn's arguments: packed tokens, window_size (-1, 0) for causal, LSE +inf on
    rows without keys (FlashAttention-2). Returns out, or (out, lse [h, t]) with return_aux=AuxRequest(lse=True)."""
    window = tuple(window_size) if window_size is not None else (-1, -1)
    o, lse = reference_attention(query, key, value, cu_seq_q, cu_seq_k, scale=scale, window=window)
    lse = torch.where(torch.isinf(lse), torch.tensor(float("inf")), lse)
    if return_aux is not None and return_aux.lse:
        return o, lse
    return o


def install_flash(monkeypatch):
    """flash_attn_interface as a module of this file's stand-in (removed again by monkeypatch)."""
    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    return module


def install_varlen(monkeypatch):
    """torch.nn.attention.varlen as a module of this file's stand-in (this torch may not have it)."""
    parent = sys.modules.get("torch.nn.attention") or types.ModuleType("torch.nn.attention")
    module = types.ModuleType("torch.nn.attention.varlen")
    module.varlen_attn, module.AuxRequest = varlen_attn, AuxRequest
    monkeypatch.setitem(sys.modules, "torch.nn.attention", parent)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
    return module
