"""A ring (p2p) context-parallel attention in torch (float64 on the CPU), forward and backward, with CP mistakes that
can be planted one at a time: the independent implementation the diagnosis's catalogue is held to
(python/tests/test_ring_mutants.py, and the confusion table of python/tests/test_replay_table.py).

Written from TransformerEngine's p2p semantics on THD, not from cpgold's simulator: the dual-chunk shards, the ring
steps and their sections, the per-sequence kernel calls with the rows they read (offsets and counts as a varlen
kernel takes them), the merges and the backward are this file's own code (only the scatter of every rank's outputs to
the global layout, fed with this file's rows, is python/examples/planted_ring_attention.py's). Only the fixture's case
and cu_seqlens are read from cpgold; the correct ring's outputs are compared with the fixture's golden and its
backward with torch's autograd by the tests.

The ring, rank r of W: every sequence b of padded length P_b splits into 2W chunks of C_b = P_b / 2W rows; the rank's
tensor holds chunk r then chunk 2W-1-r of every sequence (block of 2 C_b rows at local offset cu_padded[b] / W), then
its share of the tail rows. Step s reads the K/V shard of rank (r - s) mod W. Causal: step 0 is the diagonal (the
rank's Q against its own K/V), a lower owner (< r) gives its first chunk (a half tensor, chunk rows compacted at
cu_padded / 2W) to all of Q, a higher owner gives its whole shard to the rank's second Q chunk only (a half). Each
kernel call takes per sequence the rows it reads (the tensor's rows from the sequence's start, as many as its count)
and the global positions they hold; the mask is evaluated on those positions. Each step gives O_s and LSE_s; the
correct merge is LSE = logaddexp over the steps, O = sum O_s exp(LSE_s - LSE). The backward recomputes every step with
the merged O and LSE: dQ added on the rank's rows, dK/dV added to a buffer that travels with the K/V shard back to
its owner.

MUTANTS maps every plantable mistake to (the diagnosis kind it must be named, the replay's name of the modelled
mistake, or None for a mistake the recomputing tests name).
"""
import math
import re

import numpy as np
import torch

from planted_ring_attention import scatter

MUTANTS = {
    "none": (None, None),
    # layout: the rows a rank holds
    "contiguous_chunks": ("chunk_order", "contiguous_chunks"),
    "chunks_swapped": ("chunk_order", "chunks_swapped"),
    "ranks_reversed": ("chunk_order", "ranks_reversed"),
    "output_chunks_swapped": ("chunk_order", "output_chunks_swapped"),
    "output_chunks_swapped:r1": ("chunk_order", "output_chunks_swapped:r1"),
    # per-step counts and offsets from the wrong cu_seqlens
    "counts_cu_div_w": ("per_rank_counts", "counts_cu_div_w"),
    "counts_cu_div_2w": ("per_rank_counts", "counts_cu_div_2w"),
    "q_offsets_unpadded": ("per_rank_counts", "q_offsets_unpadded"),
    "kv_offsets_unpadded": ("per_rank_counts", "kv_offsets_unpadded"),
    "last_row_dropped": ("tail_rows_missing", "last_row_dropped"),
    # one section's mask
    "right_edge+1:diagonal": ("mask_edge", "right_edge+1:diagonal"),
    "right_edge-1:diagonal": ("mask_edge", "right_edge-1:diagonal"),
    "right_edge+1:every": ("mask_edge", "right_edge+1:every"),
    "left_edge+1:every": ("mask_edge", "left_edge+1:every"),
    "left_edge-1:every": ("mask_edge", "left_edge-1:every"),
    "diagonal_unmasked": ("mask_edge", "diagonal_unmasked"),
    "causal_local:lower": ("mask_edge", "causal_local:lower"),
    "causal_local:upper": ("mask_edge", "causal_local:upper"),
    "diagonal_keyless": ("mask_edge", "diagonal_keyless"),
    # the merge of the forward partials
    "running_o_not_rescaled": ("merge", "running_o_not_rescaled"),
    "step_o_not_rescaled": ("merge", "step_o_not_rescaled"),
    "double_rescale": ("merge", "double_rescale"),
    "keyless_step_lse_0": ("merge", "keyless_step_lse_0"),
    "keyless_step_lse_inf": ("merge", "keyless_step_lse_inf"),
    "merge_lse_in_dtype": ("merge", "merge_lse_in_dtype"),
    # the reduction of the gradients' partials
    "dq_overwritten": ("merge", "dq_overwritten"),
    "dkv_own_only": ("merge", "dkv_own_only"),
    "dkv_kept_local": ("merge", "dkv_kept_local"),
    # kernel arithmetic the recomputations name
    "scale_sqrt_d_plus_1": ("softmax_scale", None),
    "lse_base2": ("lse_convention", None),
}

LOG2E = 1.0 / math.log(2.0)
_EDGE = re.compile(r"^(right|left)_edge([+-]1):(diagonal|lower|upper|every)$")


class Geometry:
    """One side ("q" or "kv") of the global layout as the ring splits it."""

    def __init__(self, fx, side):
        self.w = fx.cp_size
        self.offsets = fx.cu_seqlens(side, padded=True).astype(np.int64)
        self.cu = fx.cu_seqlens(side).astype(np.int64)
        self.lens = np.diff(self.cu)
        self.chunk = np.diff(self.offsets) // (2 * self.w)
        self.total = fx.total_rows(side)
        self.tail_share = (self.total - int(self.offsets[-1])) // self.w

    def local_rows(self):
        return int(self.offsets[-1]) // self.w + self.tail_share

    def block_start(self, b, half=False):
        """Start of sequence b in the rank's tensor (half: in a compacted half tensor)."""
        return int(self.offsets[b]) // (self.w * (2 if half else 1))

    def held_chunks(self, r, mutant):
        w = self.w
        if mutant == "contiguous_chunks":
            return (2 * r, 2 * r + 1)
        if mutant == "chunks_swapped":
            return (2 * w - 1 - r, r)
        if mutant == "ranks_reversed":
            return (w - 1 - r, w + r)
        return (r, 2 * w - 1 - r)

    def global_rows(self, r, mutant="none"):
        """[local rows] the global row each local row of rank r holds (tail rows: its share of them)."""
        rows = []
        for b in range(len(self.lens)):
            c = int(self.chunk[b])
            for chunk in self.held_chunks(r, mutant):
                rows.append(self.offsets[b] + chunk * c + np.arange(c))
        rows.append(self.offsets[-1] + r * self.tail_share + np.arange(self.tail_share))
        return np.concatenate(rows).astype(np.int64)

    def half_map(self, half):
        """[half rows] the local row of every row of a compacted half tensor (half 0: chunk r, 1: chunk 2W-1-r)."""
        rows = []
        for b in range(len(self.lens)):
            c = int(self.chunk[b])
            rows.append(self.block_start(b) + half * c + np.arange(c))
        return np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)


def _shard(x, rows):
    out = torch.zeros((len(rows),) + tuple(x.shape[1:]), dtype=torch.float64)
    out[:] = x[torch.as_tensor(rows)]
    return out


class Ring:
    def __init__(self, fx, mutant="none"):
        if mutant not in MUTANTS:
            raise ValueError(f"mutant: expected one of {sorted(MUTANTS)}, got {mutant!r}")
        if fx.comm != "p2p":
            raise ValueError(f"the ring is p2p; the fixture's comm is {fx.comm!r}")
        self.fx, self.mutant = fx, mutant
        self.w = fx.cp_size
        self.q, self.kv = Geometry(fx, "q"), Geometry(fx, "kv")
        self.hq, self.hkv = fx.heads_q, fx.heads_kv
        self.group = self.hq // self.hkv
        self.scale = fx.softmax_scale if mutant != "scale_sqrt_d_plus_1" else 1.0 / math.sqrt(fx.dim_qk + 1)
        self.window = fx.window
        self.causal = fx.causal
        x = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in fx.inputs().items()}
        self.inputs = x
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fx.dtype]

    # -- what a rank's tensors hold --------------------------------------------------------------------------------

    def positions(self, r, geo, b):
        """[2 C_b] global positions rank r believes the rows of its block of sequence b hold (chunks r, 2W-1-r)."""
        c = int(geo.chunk[b])
        return np.concatenate([r * c + np.arange(c), (2 * self.w - 1 - r) * c + np.arange(c)])

    def token_rows(self, r, geo, b, side, half):
        """Block rows (0 .. 2C_b - 1, or 0 .. C_b - 1 of a half) a kernel takes as tokens of sequence b: the rows of
        its count from the sequence's start, in order, with the positions they hold."""
        c = int(geo.chunk[b])
        pos = self.positions(r, geo, b)
        length = int(geo.lens[b])
        if self.mutant in ("counts_cu_div_w", "counts_cu_div_2w"):
            n_whole = int(geo.cu[b + 1] // self.w - geo.cu[b] // self.w)
            if half is None:
                rows = np.arange(min(n_whole, 2 * c))
            elif self.mutant == "counts_cu_div_2w":
                n_half = int(geo.cu[b + 1] // (2 * self.w) - geo.cu[b] // (2 * self.w))
                rows = half * c + np.arange(min(n_half, c))
            else:  # a half reads its part of the rank's count
                n = min(n_whole, c) if half == 0 else max(0, n_whole - c)
                rows = half * c + np.arange(min(n, c))
        else:
            rows = np.arange(2 * c) if half is None else half * c + np.arange(c)
            rows = rows[pos[rows] < length]
            if self.mutant == "last_row_dropped" and side == "q" and len(rows):
                all_valid = np.flatnonzero(pos < length)
                last = all_valid[np.argmax(pos[all_valid])]
                rows = rows[rows != last]
        return rows, pos[rows]

    # -- the kernel ----------------------------------------------------------------------------------------------

    def mask(self, qpos, kpos, section):
        """[nq, nk] visible pairs of one sequence in one step."""
        wl, wr = self.window
        m = self.mutant
        if m == "diagonal_keyless" and section == "diagonal" and (wl >= 0 or wr >= 0):
            return torch.zeros((len(qpos), len(kpos)), dtype=torch.bool)
        if m == "diagonal_unmasked" and section == "diagonal":
            wl, wr = -1, -1
        if m.startswith("causal_local:") and self.causal and section == m.split(":")[1]:
            nq, nk = len(qpos), len(kpos)
            i = torch.arange(nq)[:, None]
            j = torch.arange(nk)[None, :]
            return j <= i + (nk - nq)
        right, left = wr >= 0, wl >= 0  # bounded sides
        edge = _EDGE.match(m)
        if edge and edge.group(3) in ("every", section):
            shift = int(edge.group(2))
            if edge.group(1) == "right" and right:
                if wr + shift >= 0 or not left:  # a causal edge one short: j <= i - 1
                    wr += shift
            elif edge.group(1) == "left" and left and wl + shift >= 0:
                wl += shift
        d = torch.as_tensor(kpos)[None, :] - torch.as_tensor(qpos)[:, None]
        ok = torch.ones(d.shape, dtype=torch.bool)
        if right:
            ok &= d <= wr
        if left:
            ok &= d >= -wl
        return ok

    def calls(self, r, owner, section, q_half, kv_half):
        """Per sequence: (Q tensor rows, positions, K/V tensor rows, positions) of one step's kernel call; the rows
        are those of the step's tensors (the rank's, or a compacted half) from the start the kernel is given."""
        out = []
        for b in range(len(self.q.lens)):
            qb, qpos = self.token_rows(r, self.q, b, "q", q_half)
            kb, kpos = self.token_rows(owner, self.kv, b, "kv", kv_half)
            if len(qb) == 0 or len(kb) == 0:
                continue
            # rows in the step's tensors: a half keeps its chunk's rows, compacted
            qrow = self.start(self.q, b, q_half, self.mutant == "q_offsets_unpadded") + (qb - (0 if q_half is None else q_half * int(self.q.chunk[b])))
            krow = self.start(self.kv, b, kv_half, self.mutant == "kv_offsets_unpadded") + (kb - (0 if kv_half is None else kv_half * int(self.kv.chunk[b])))
            out.append((qrow, qpos, krow, kpos))
        return out

    def computed(self, r, owner, section, qh, kh):
        """A step runs unless a window leaves every pair of every sequence out (the sections of a causal ring and a
        call without mask always run); decided on the correct ring's rows and mask: a mistake does not skip steps."""
        wl, wr = self.window
        if wl < 0 and wr < 0 or self.causal:
            return True
        if self.mutant == "none":
            calls = self.calls(r, owner, section, qh, kh)
        else:
            if not hasattr(self, "_correct"):
                self._correct = Ring(self.fx, "none")
            calls = self._correct.calls(r, owner, section, qh, kh)
        for qrow, qpos, krow, kpos in calls:
            d = np.asarray(kpos)[None, :] - np.asarray(qpos)[:, None]
            ok = np.ones(d.shape, dtype=bool)
            if wr >= 0:
                ok &= d <= wr
            if wl >= 0:
                ok &= d >= -wl
            if ok.any():
                return True
        return False

    def start(self, geo, b, half, unpadded):
        d = self.w * (1 if half is None else 2)
        return int((geo.cu if unpadded else geo.offsets)[b]) // d

    def steps(self, r, backward=False):
        """[(step, owner, section, q half, kv half)] of rank r (half None: the whole tensor; 0 or 1: chunk r's rows or
        chunk 2W-1-r's rows, compacted). The backward runs the ring the other way round, as TransformerEngine's does:
        step s holds the K/V of rank (r + 1 + s) mod W, its own last."""
        out = []
        for s in range(self.w):
            owner = (r + 1 + s) % self.w if backward else (r - s) % self.w
            if not self.causal:
                out.append((s, owner, "all", None, None))
            elif owner == r:
                out.append((s, owner, "diagonal", None, None))
            elif owner < r:
                out.append((s, owner, "lower", None, 0))
            else:
                out.append((s, owner, "upper", 1, None))
        return out

    def forward_call(self, q, k, v, calls, section):
        """One step's partial: O [rows of q, hq, dv] and LSE [hq, rows of q] (-inf where no key), each sequence's rows
        written in order."""
        o = torch.zeros((q.shape[0], self.hq, v.shape[2]), dtype=torch.float64)
        lse = torch.full((self.hq, q.shape[0]), -math.inf, dtype=torch.float64)
        for qrow, qpos, krow, kpos in calls:
            vis = self.mask(qpos, kpos, section)
            qi, ki = torch.as_tensor(qrow), torch.as_tensor(krow)
            for h in range(self.hq):
                g = h // self.group
                s = self.scale * (q[qi, h] @ k[ki, g].T)
                s = torch.where(vis, s, torch.tensor(-math.inf, dtype=torch.float64))
                m = torch.amax(s, dim=1, keepdim=True)
                seen = vis.any(dim=1, keepdim=True)  # a row with a key (NaN scores stay NaN, as in any kernel)
                p = torch.where(vis, torch.exp(s - torch.where(seen, m, torch.zeros_like(m))), torch.zeros_like(s))
                total = p.sum(dim=1, keepdim=True)
                # a product over the visible pairs only: a pad value no row sees never reaches the result
                pv = (p[:, :, None] * torch.where(vis[:, :, None], v[ki, g][None, :, :], torch.zeros((), dtype=torch.float64))).sum(1)
                o[qi, h] = torch.where(seen, pv / torch.where(seen, total, torch.ones_like(total)), torch.zeros_like(pv))
                lse[h, qi] = torch.where(seen[:, 0], (m + torch.log(torch.where(seen, total, torch.ones_like(total))))[:, 0],
                                         torch.tensor(-math.inf, dtype=torch.float64))
        return o, lse

    def backward_call(self, q, k, v, o, lse, dout, calls, section):
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        zero = torch.zeros((), dtype=torch.float64)
        for qrow, qpos, krow, kpos in calls:
            vis = self.mask(qpos, kpos, section)
            qi, ki = torch.as_tensor(qrow), torch.as_tensor(krow)
            for h in range(self.hq):
                g = h // self.group
                l = lse[h, qi][:, None]
                s = self.scale * (q[qi, h] @ k[ki, g].T)
                keyed = l != -math.inf  # a row with keys (a NaN LSE stays NaN, as in any kernel)
                p = torch.where(vis & keyed, torch.exp(s - torch.where(keyed, l, zero)), zero)
                do = dout[qi, h]
                delta = (do * o[qi, h]).sum(1, keepdim=True)
                vv = torch.where(vis[:, :, None], v[ki, g][None], zero)
                dp = (do[:, None, :] * vv).sum(2)
                ds = torch.where(vis, p * (dp - delta), zero)
                kk = torch.where(vis[:, :, None], k[ki, g][None], zero)
                dq[qi, h] += self.scale * (ds[:, :, None] * kk).sum(1)
                qq = torch.where(vis[:, :, None], q[qi, h][:, None], zero)
                dk[ki, g] += self.scale * (ds[:, :, None] * qq).sum(0)
                dod = torch.where(vis[:, :, None], do[:, None], zero)
                dv[ki, g] += (p[:, :, None] * dod).sum(0)
        return dq, dk, dv

    # -- the ring -----------------------------------------------------------------------------------------------

    def rounded(self, x):
        return x.to(self.dtype).to(torch.float64)

    def merge(self, parts, n):
        """parts: [(O_s, LSE_s, local rows of the partial's rows)] in step order."""
        o = torch.zeros((n, self.hq, self.inputs["v"].shape[2]), dtype=torch.float64)
        lse = torch.full((self.hq, n), -math.inf, dtype=torch.float64)
        m = self.mutant
        online = m in ("running_o_not_rescaled", "step_o_not_rescaled", "double_rescale", "keyless_step_lse_0",
                       "keyless_step_lse_inf", "merge_lse_in_dtype")
        if not online:
            for _, l_s, rows in parts:
                lse[:, rows] = torch.logaddexp(lse[:, rows], l_s)
            for o_s, l_s, rows in parts:
                wgt = torch.where(torch.isfinite(l_s), torch.exp(l_s - torch.where(torch.isfinite(lse[:, rows]), lse[:, rows], 0.0)), 0.0)
                o[rows] += o_s * wgt.T[:, :, None]
            return o, lse
        with np.errstate(all="ignore"):
            for o_s, l_s, rows in parts:
                li = l_s.clone()
                if m == "keyless_step_lse_0":
                    li = torch.where(li == -math.inf, torch.zeros_like(li), li)
                if m == "keyless_step_lse_inf":
                    li = torch.where(li == -math.inf, torch.full_like(li, math.inf), li)
                if m == "merge_lse_in_dtype":
                    li = self.rounded(li)
                l = lse[:, rows]
                merged = torch.where((l == math.inf) | (li == math.inf), torch.full_like(l, math.inf), torch.logaddexp(l, li))
                if m == "merge_lse_in_dtype":
                    merged = self.rounded(merged)
                a = torch.where(l == -math.inf, torch.zeros_like(l), torch.exp(l - merged))
                bb = torch.where(li == -math.inf, torch.zeros_like(li), torch.exp(li - merged))
                if m == "running_o_not_rescaled":
                    a = torch.where(l == -math.inf, a, torch.ones_like(a))
                if m == "step_o_not_rescaled":
                    bb = torch.where(li == -math.inf, bb, torch.ones_like(bb))
                if m == "double_rescale":
                    a = a * a
                prev = o[rows]
                term_a = torch.where(a.T[:, :, None] == 0, torch.zeros_like(prev), prev * a.T[:, :, None])
                term_b = torch.where(bb.T[:, :, None] == 0, torch.zeros_like(o_s), o_s * bb.T[:, :, None])
                o[rows] = term_a + term_b
                lse[:, rows] = merged
        return o, lse

    def output_order(self, r):
        """The order a rank returns its O and LSE rows in: its two chunks of every sequence swapped under the output
        mutants (on every rank, or on rank 1 only), else as computed (None)."""
        m = self.mutant
        if not (m == "output_chunks_swapped" or (m == "output_chunks_swapped:r1" and r == 1)):
            return None
        order = np.arange(self.q.local_rows())
        for b in range(len(self.q.lens)):
            c, start = int(self.q.chunk[b]), self.q.block_start(b)
            order[start:start + 2 * c] = np.concatenate([start + c + np.arange(c), start + np.arange(c)])
        return torch.as_tensor(order)

    def run(self, backward=True):
        """Every rank's outputs in its rank-local order: [{"o", "lse" [hq, L], "dq", "dk", "dv"}] (float32)."""
        w, x, m = self.w, self.inputs, self.mutant
        held_q = [self.q.global_rows(r, m) for r in range(w)]
        held_kv = [self.kv.global_rows(r, m) for r in range(w)]
        q_of = [_shard(x["q"], rows) for rows in held_q]
        do_of = [_shard(x["dout"], rows) for rows in held_q]
        # A rank that returns its rows reordered receives their dO in that order: row i's dO is that of the row
        # returned where i's output went (a swap is its own inverse).
        for r in range(w):
            order = self.output_order(r)
            if order is not None:
                do_of[r] = do_of[r][order]
        k_of = [_shard(x["k"], rows) for rows in held_kv]
        v_of = [_shard(x["v"], rows) for rows in held_kv]
        half_q = [torch.as_tensor(self.q.half_map(h)) for h in (0, 1)]
        half_kv = [torch.as_tensor(self.kv.half_map(h)) for h in (0, 1)]

        def part(t, half, maps):
            return t if half is None else t[maps[half]]

        outs = []
        for r in range(w):
            n = q_of[r].shape[0]
            parts = []
            for s, owner, section, qh, kh in self.steps(r):
                if not self.computed(r, owner, section, qh, kh):
                    continue
                calls = self.calls(r, owner, section, qh, kh)
                o_s, l_s = self.forward_call(part(q_of[r], qh, half_q), part(k_of[owner], kh, half_kv),
                                             part(v_of[owner], kh, half_kv), calls, section)
                rows = torch.arange(n) if qh is None else half_q[qh]
                parts.append((o_s, l_s, rows))
            o, lse = self.merge(parts, n)
            outs.append({"o": o, "lse": lse})
        if backward:
            # dK/dV travel with the K/V shard: the buffer of owner o is added to by every rank in step order and comes
            # home after the last step. Ranks run in step order (step-major), as the ring's time does.
            dkv_home = [(torch.zeros_like(k_of[r]), torch.zeros_like(v_of[r])) for r in range(w)]
            kept = [(torch.zeros_like(k_of[r]), torch.zeros_like(v_of[r])) for r in range(w)]
            dqs = [torch.zeros_like(q_of[r]) for r in range(w)]
            steps = [self.steps(r, backward=True) for r in range(w)]
            for s in range(w):
                for r in range(w):
                    _, owner, section, qh, kh = steps[r][s]
                    o, lse = outs[r]["o"], outs[r]["lse"]
                    if not self.computed(r, owner, section, qh, kh):
                        continue
                    calls = self.calls(r, owner, section, qh, kh)
                    qrows = torch.arange(q_of[r].shape[0]) if qh is None else half_q[qh]
                    krows = torch.arange(k_of[owner].shape[0]) if kh is None else half_kv[kh]
                    lse_s = lse if qh is None else lse[:, half_q[qh]]
                    dq_s, dk_s, dv_s = self.backward_call(part(q_of[r], qh, half_q), part(k_of[owner], kh, half_kv),
                                                          part(v_of[owner], kh, half_kv), part(o, qh, half_q), lse_s,
                                                          part(do_of[r], qh, half_q), calls, section)
                    if m == "dq_overwritten":
                        dqs[r][qrows] = dq_s
                    else:
                        dqs[r][qrows] += dq_s
                    if m == "dkv_own_only" and owner != r:
                        continue
                    if m == "dkv_kept_local" and owner != r:
                        kept[r][0][krows] += dk_s
                        kept[r][1][krows] += dv_s
                        continue
                    bk, bv = dkv_home[owner]
                    bk[krows] += dk_s
                    bv[krows] += dv_s
            for r in range(w):
                outs[r]["dq"] = dqs[r]
                outs[r]["dk"] = dkv_home[r][0] + kept[r][0]
                outs[r]["dv"] = dkv_home[r][1] + kept[r][1]
        result = []
        for r, out in enumerate(outs):
            if m == "lse_base2":
                out["lse"] = out["lse"] * LOG2E
            order = self.output_order(r)
            if order is not None:
                out["o"], out["lse"] = out["o"][order], out["lse"][:, order]
            result.append({name: a.numpy().astype(np.float32) for name, a in out.items()})
        return result

    def gather(self, outputs):
        """Every rank's outputs scattered to the global layout through the rows the rank really holds (the
        bookkeeping of planted_ring_attention.scatter; the rows are this ring's own)."""
        geometry = {"q": self.q, "kv": self.kv}
        return scatter(outputs, lambda side: geometry[side].total,
                       lambda r, side: geometry[side].global_rows(r, self.mutant))


def ring_attention(fx, mutant="none", backward=True):
    return Ring(fx, mutant).run(backward)


def gather(fx, outputs, mutant="none"):
    return Ring(fx, mutant).gather(outputs)


def autograd_outputs(fx):
    """The correct attention of the fixture's case through torch's autograd (float64, no CP): global o, lse, dq, dk,
    dv, for checking the ring's own backward."""
    x = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)).clone().requires_grad_(k != "dout")
         for k, v in fx.inputs().items()}
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    qg, kg = Geometry(fx, "q"), Geometry(fx, "kv")
    hq, group = fx.heads_q, fx.heads_q // fx.heads_kv
    wl, wr = fx.window
    o = torch.zeros((q.shape[0], hq, v.shape[2]), dtype=torch.float64)
    lse = torch.full((hq, q.shape[0]), -math.inf, dtype=torch.float64)
    os_, ls_ = [], []
    for b in range(len(qg.lens)):
        lq, lk = int(qg.lens[b]), int(kg.lens[b])
        if lq == 0 or lk == 0:
            continue
        qi = int(qg.offsets[b]) + torch.arange(lq)
        ki = int(kg.offsets[b]) + torch.arange(lk)
        d = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - (lk - lq)
        vis = torch.ones((lq, lk), dtype=torch.bool)
        if wr >= 0:
            vis &= d <= wr
        if wl >= 0:
            vis &= d >= -wl
        for h in range(hq):
            s = fx.softmax_scale * (q[qi, h] @ k[ki, h // group].T)
            s = s.masked_fill(~vis, -math.inf)
            l = torch.logsumexp(s, dim=1)
            p = torch.exp(s - torch.where(torch.isfinite(l), l, torch.zeros_like(l))[:, None]).masked_fill(~vis, 0.0)
            os_.append((qi, h, p @ v[ki, h // group]))
            ls_.append((qi, h, l))
    for qi, h, val in os_:
        o = o.index_put((qi, torch.full_like(qi, h)), val)
    loss = (o * dout).sum()
    loss.backward()
    for qi, h, l in ls_:
        lse[h, qi] = l.detach()
    return {"o": o.detach().numpy(), "lse": lse.numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(),
            "dv": v.grad.numpy()}
