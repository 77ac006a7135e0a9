"""cuDNN fused attention (SDPA forward and backward) on a padded THD batch, through the cuDNN frontend's Python API.

The layout TransformerEngine's fused attention hands to cuDNN: Q/K/V/O/dO stay in the packed layout with padding
between sequences ([T, h, d]); a ragged offset per sequence (its padded start row, in elements) says where it
begins and seq_len_q/seq_len_kv its actual length, so pad rows are never read. Softmax stats (the natural-log LSE)
come out dense as [B, h, S_q, 1]. Masks are bottom-right aligned (FlashAttention's convention): causal is the
diagonal band's right bound 0; a window (left, right) is the band [i + delta - left, i + delta + right], which cuDNN
spells as left bound = left + 1 (keys strictly after i + delta - left_bound) and right bound = right.

Graphs are cached per (dtype, heads, dims, mask, scale, B, S_q, S_kv); B and S are rounded up to buckets so that
batches of one configuration share a graph (extra sequences have length 0).
"""
import math

import cudnn
import torch

CUDNN_DTYPE = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}


def bucket(n, floor):
    """Next power of two >= n, at least floor."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def band(causal, window):
    """(left_bound, right_bound) of cuDNN's diagonal band for a bottom-right window (left, right), -1 unbounded."""
    left, right = window
    if causal:
        right = 0
    return (left + 1 if left >= 0 else None), (right if right >= 0 else None)


class ThdAttention:
    """Forward + backward graphs of one configuration. Shapes: q [Tq, hq, dqk], k [Tkv, hkv, dqk], v [Tkv, hkv, dv],
    o/dout [Tq, hq, dv]; offsets_* [B+1] padded starts (rows); seqlens_* [B] actual lengths."""

    def __init__(self, handle, dtype, heads_q, heads_kv, dim_qk, dim_v, batch, max_q, max_kv, scale, causal, window,
                 deterministic=False):
        self.handle, self.dtype = handle, dtype
        self.hq, self.hkv, self.dqk, self.dv = heads_q, heads_kv, dim_qk, dim_v
        self.b, self.sq, self.skv = batch, max_q, max_kv
        self.scale = scale
        self.left, self.right = band(causal, window)
        self.deterministic = deterministic
        self._build_forward()
        self._build_backward()

    # [B, h, S, d] views of a packed [T, h, d] tensor: the batch stride is replaced by the ragged offset.
    def _dims(self, heads, seq, dim):
        return [self.b, heads, seq, dim], [seq * heads * dim, dim, heads * dim, 1]

    def _graph(self):
        return cudnn.pygraph(io_data_type=CUDNN_DTYPE[self.dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

    def _ragged(self, g, name, heads, seq, dim):
        dim_, stride = self._dims(heads, seq, dim)
        t = g.tensor(name=name, dim=dim_, stride=stride, data_type=CUDNN_DTYPE[self.dtype])
        off = g.tensor(name=name + "_offset", dim=[self.b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                       data_type=cudnn.data_type.INT64)
        t.set_ragged_offset(off)
        return t, off

    def _lengths(self, g, name):
        return g.tensor(name=name, dim=[self.b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)

    def _mask_kwargs(self):
        kw = {"use_padding_mask": True, "diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT}
        if self.left is not None:
            kw["diagonal_band_left_bound"] = self.left
        if self.right is not None:
            kw["diagonal_band_right_bound"] = self.right
        return kw

    @staticmethod
    def _finish(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def _build_forward(self):
        g = self._graph()
        self.f_q, self.f_qo = self._ragged(g, "q", self.hq, self.sq, self.dqk)
        self.f_k, self.f_ko = self._ragged(g, "k", self.hkv, self.skv, self.dqk)
        self.f_v, self.f_vo = self._ragged(g, "v", self.hkv, self.skv, self.dv)
        self.f_sq, self.f_skv = self._lengths(g, "seq_q"), self._lengths(g, "seq_kv")
        o, stats = g.sdpa(name="sdpa", q=self.f_q, k=self.f_k, v=self.f_v, generate_stats=True, attn_scale=self.scale,
                          seq_len_q=self.f_sq, seq_len_kv=self.f_skv, **self._mask_kwargs())
        dims, stride = self._dims(self.hq, self.sq, self.dv)
        self.f_oo = g.tensor(name="o_offset", dim=[self.b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                             data_type=cudnn.data_type.INT64)
        o.set_output(True).set_dim(dims).set_stride(stride).set_ragged_offset(self.f_oo)
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([self.b, self.hq, self.sq, 1]) \
            .set_stride([self.hq * self.sq, self.sq, 1, 1])
        self.f_o, self.f_stats = o, stats
        self.fwd = self._finish(g)

    def _build_backward(self):
        g = self._graph()
        self.b_q, self.b_qo = self._ragged(g, "q", self.hq, self.sq, self.dqk)
        self.b_k, self.b_ko = self._ragged(g, "k", self.hkv, self.skv, self.dqk)
        self.b_v, self.b_vo = self._ragged(g, "v", self.hkv, self.skv, self.dv)
        self.b_o, self.b_oo = self._ragged(g, "o", self.hq, self.sq, self.dv)
        dims, stride = self._dims(self.hq, self.sq, self.dv)
        self.b_do = g.tensor(name="dO", dim=dims, stride=stride, data_type=CUDNN_DTYPE[self.dtype])
        self.b_do.set_ragged_offset(self.b_oo)
        self.b_stats = g.tensor(name="stats", dim=[self.b, self.hq, self.sq, 1], stride=[self.hq * self.sq, self.sq, 1, 1],
                                data_type=cudnn.data_type.FLOAT)
        self.b_sq, self.b_skv = self._lengths(g, "seq_q"), self._lengths(g, "seq_kv")
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=self.b_q, k=self.b_k, v=self.b_v, o=self.b_o, dO=self.b_do,
                                     stats=self.b_stats, attn_scale=self.scale, seq_len_q=self.b_sq,
                                     seq_len_kv=self.b_skv, use_deterministic_algorithm=self.deterministic,
                                     **self._mask_kwargs())
        for t, ref, (heads, seq, dim) in ((dq, self.b_qo, (self.hq, self.sq, self.dqk)),
                                          (dk, self.b_ko, (self.hkv, self.skv, self.dqk)),
                                          (dv, self.b_vo, (self.hkv, self.skv, self.dv))):
            dims, stride = self._dims(heads, seq, dim)
            t.set_output(True).set_dim(dims).set_stride(stride).set_ragged_offset(ref)
        self.b_dq, self.b_dk, self.b_dv = dq, dk, dv
        self.bwd = self._finish(g)
        self.workspace = torch.empty(max(self.fwd.get_workspace_size(), self.bwd.get_workspace_size()), device="cuda",
                                     dtype=torch.uint8)

    def batch_tensors(self, offsets_q, offsets_kv, seqlens_q, seqlens_kv):
        """Device tensors of lengths and ragged offsets (elements) for a batch of <= B sequences; the missing
        sequences get length 0 at the end offset."""
        n = len(seqlens_q)
        pad = self.b - n

        def lens(x):
            return torch.tensor(list(x) + [0] * pad, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)

        def offs(x, heads, dim):
            rows = list(x) + [x[-1]] * pad
            return torch.tensor([r * heads * dim for r in rows], dtype=torch.int64, device="cuda").view(-1, 1, 1, 1)

        return {"seq_q": lens(seqlens_q), "seq_kv": lens(seqlens_kv),
                "q": offs(offsets_q, self.hq, self.dqk), "o": offs(offsets_q, self.hq, self.dv),
                "k": offs(offsets_kv, self.hkv, self.dqk), "v": offs(offsets_kv, self.hkv, self.dv)}

    def forward(self, q, k, v, o, stats, bt):
        """o [Tq, hq, dv] (zeroed by the caller: pad rows are not written), stats [B, hq, S_q, 1] float32."""
        pack = {self.f_q: q, self.f_k: k, self.f_v: v, self.f_o: o, self.f_stats: stats, self.f_sq: bt["seq_q"],
                self.f_skv: bt["seq_kv"], self.f_qo: bt["q"], self.f_ko: bt["k"], self.f_vo: bt["v"],
                self.f_oo: bt["o"]}
        self.fwd.execute(pack, self.workspace, handle=self.handle)

    def backward(self, q, k, v, o, dout, stats, dq, dk, dv, bt):
        pack = {self.b_q: q, self.b_k: k, self.b_v: v, self.b_o: o, self.b_do: dout, self.b_stats: stats,
                self.b_dq: dq, self.b_dk: dk, self.b_dv: dv, self.b_sq: bt["seq_q"], self.b_skv: bt["seq_kv"],
                self.b_qo: bt["q"], self.b_ko: bt["k"], self.b_vo: bt["v"], self.b_oo: bt["o"]}
        self.bwd.execute(pack, self.workspace, handle=self.handle)
