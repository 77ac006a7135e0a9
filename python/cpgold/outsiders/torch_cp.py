"""A plain torch all-gather CP attention, one process per rank: the reference of the multi-process harness
(cpgold.outsiders.ranks), so the harness is tested without TransformerEngine (python/tests/test_outsiders_nccl.py).

Per rank: K/V shards are all-gathered over the rank's groups in TE's order ([CP group], or [a2a group, p2p group] for
a2a+p2p: the a2a group's shards first, then those blocks over the p2p group) and placed at their global rows by the
fixture's partition; the rank's own Q rows (its shard) attend the global K/V of their sequence with the case's
mask on true positions (bottom-right aligned causal, window (left, right), -1 unbounded), softmax scale and GQA
(query head h reads KV head h // (hq / hkv)). Pad and tail rows are never read (their outputs are 0, LSE -inf).
Backward by autograd: dQ of the rank's rows; dK/dV on the global rows, summed over the groups (all_reduce, the
inverse of the gather) and the rank's rows kept. Arithmetic in float64.

Options (--set): mistake=none|causal_edge_plus1 (a causal query at position i also sees the key at i + 1: a planted
off-by-one causal edge), fail_rank=R|all and fail_when=before|after (rank R, or every rank, raises before its collectives, leaving its
peers waiting in the all-gather, or after them), for the harness's tests of a failing rank.
"""
import numpy as np

from .rank_adapter import RankAdapter, RankResult

MISTAKES = ("none", "causal_edge_plus1")


def positions(fx, rows, side):
    """(sequence, position, valid) of global rows: the sequence a row's padded range belongs to (-1 past the last),
    its position in it, and whether it holds a token."""
    offsets = fx.cu_seqlens(side, padded=True).astype(np.int64)
    lengths = fx.seqlens(side).astype(np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    seq = np.searchsorted(offsets, rows, side="right") - 1
    inside = (seq >= 0) & (seq < len(lengths))
    safe = np.clip(seq, 0, max(len(lengths) - 1, 0))
    pos = np.where(inside, rows - offsets[safe], -1)
    valid = inside & (pos < (lengths[safe] if len(lengths) else 0))
    return np.where(inside, seq, -1), pos, valid


class TorchAllGather(RankAdapter):
    name = "torch_allgather"
    tensors = ("o", "lse", "dq", "dk", "dv")

    def __init__(self, deterministic=False, mistake="none", fail_rank=-1, fail_when="before", **options):
        super().__init__(deterministic, **options)
        fail_rank = -2 if fail_rank == "all" else fail_rank
        if mistake not in MISTAKES:
            raise ValueError(f"mistake: expected one of {', '.join(MISTAKES)}, got {mistake!r}")
        if fail_when not in ("before", "after"):
            raise ValueError(f"fail_when: expected before or after, got {fail_when!r}")
        self.mistake, self.fail_rank, self.fail_when = mistake, int(fail_rank), fail_when

    def options(self):
        return {**super().options(), "mistake": self.mistake, "fail_rank": self.fail_rank,
                "fail_when": self.fail_when}

    def versions(self):
        """The environment (torch, its CUDA and NCCL, the device, the driver) and the process-group backends this
        torch has."""
        import torch.distributed as dist
        return {**super().versions(), "gloo_available": dist.is_available() and dist.is_gloo_available(),
                "nccl_available": dist.is_available() and dist.is_nccl_available()}

    def unsupported(self, fx):
        return "not a CP fixture (cp_size 1)" if fx.cp_size < 2 else None

    def _fail(self, rank, when):
        if self.fail_when == when and self.fail_rank in (rank, -2):
            raise RuntimeError(f"planted failure on rank {rank} ({when} its collectives)")

    def _gather_kv(self, fx, rank, groups, k, v):
        """Global K and V [Tkv, hkv, d] (float64, zeros on rows no rank holds) from every rank's shard."""
        import torch
        import torch.distributed as dist

        w = fx.cp_size
        rows = [fx.partitioned_indices(r, "kv") for r in range(w)]
        longest = max(len(r) for r in rows)
        dqk = k.shape[2]

        def packed(x_k, x_v):
            p = torch.zeros((longest,) + tuple(x_k.shape[1:2]) + (dqk + x_v.shape[2],), dtype=torch.float64,
                            device=k.device)
            p[:x_k.shape[0], :, :dqk] = x_k
            p[:x_v.shape[0], :, dqk:] = x_v
            return p

        held = {rank: packed(k, v)}
        for group, members in zip(groups.groups, groups.group_ranks):
            order = sorted(held)
            mine = torch.stack([held[r] for r in order])
            ids = torch.tensor(order, dtype=torch.int64, device=k.device)
            parts = [torch.empty_like(mine) for _ in members]
            id_parts = [torch.empty_like(ids) for _ in members]
            dist.all_gather(parts, mine, group=group)
            dist.all_gather(id_parts, ids, group=group)
            for part, idp in zip(parts, id_parts):
                for j, r in enumerate(idp.tolist()):
                    held[r] = part[j]
        missing = [r for r in range(w) if r not in held]
        if missing:
            raise RuntimeError(f"rank {rank}: the groups {groups.group_ranks} do not reach ranks {missing}")
        hkv = k.shape[1]
        kg = torch.zeros((fx.total_rows("kv"), hkv, dqk), dtype=torch.float64, device=k.device)
        vg = torch.zeros((fx.total_rows("kv"), hkv, v.shape[2]), dtype=torch.float64, device=k.device)
        for r in range(w):
            idx = torch.as_tensor(rows[r], device=k.device)
            kg[idx] = held[r][:len(rows[r]), :, :dqk]
            vg[idx] = held[r][:len(rows[r]), :, dqk:]
        return kg, vg

    def run_rank(self, fx, rank, groups):
        import torch
        import torch.distributed as dist

        self._fail(rank, "before")
        dev = groups.device
        x = {n: t.to(torch.float64) for n, t in fx.rank_inputs(rank, "torch", dev).items()}
        kg, vg = self._gather_kv(fx, rank, groups, x["k"], x["v"])
        q = x["q"].clone().requires_grad_()
        kg.requires_grad_()
        vg.requires_grad_()
        hq, hkv = fx.heads_q, fx.heads_kv
        rep = hq // hkv
        qrows = fx.partitioned_indices(rank, "q")
        qseq, qpos, qvalid = positions(fx, qrows, "q")
        lq, lkv = fx.seqlens("q").astype(np.int64), fx.seqlens("kv").astype(np.int64)
        koff = fx.cu_seqlens("kv", padded=True).astype(np.int64)
        left, right = fx.window
        if fx.causal:
            right = 1 if self.mistake == "causal_edge_plus1" else 0
        n = len(qrows)
        o = torch.zeros((n, hq, vg.shape[2]), dtype=torch.float64, device=dev)
        lse = torch.full((hq, n), float("-inf"), dtype=torch.float64, device=dev)
        for b in range(len(lq)):
            local = np.flatnonzero(qvalid & (qseq == b))
            if not len(local) or not lkv[b]:
                continue
            krows = koff[b] + np.arange(lkv[b])
            d = np.arange(lkv[b])[None, :] - qpos[local][:, None] - (lkv[b] - lq[b])  # key - query, bottom-right
            vis = np.ones(d.shape, dtype=bool)
            if left >= 0:
                vis &= d >= -left
            if right >= 0:
                vis &= d <= right
            li = torch.as_tensor(local, device=dev)
            ki = torch.as_tensor(krows, device=dev)
            vis_t = torch.as_tensor(vis, device=dev)[None]                       # [1, nq, nk]
            kb = kg[ki].repeat_interleave(rep, dim=1)
            vb = vg[ki].repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", q[li], kb) * fx.softmax_scale
            s = s.masked_fill(~vis_t, float("-inf"))
            seen = vis_t.any(dim=2, keepdim=True)                                # [1, nq, 1]
            p = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=2) * seen
            o = o.index_copy(0, li, torch.einsum("hqk,khd->qhd", p, vb))
            with torch.no_grad():
                lse[:, li] = torch.logsumexp(s, dim=2)
        dout = torch.where(torch.as_tensor(qvalid, device=dev)[:, None, None], x["dout"], torch.zeros_like(x["dout"]))
        if o.requires_grad:
            dq, dkg, dvg = torch.autograd.grad(o, (q, kg, vg), dout, allow_unused=True)
        else:   # no valid query row on this rank (all its rows are padding): O depends on no input, every grad is 0
            dq = dkg = dvg = None
        dq = torch.zeros_like(q) if dq is None else dq
        dkg = torch.zeros_like(kg) if dkg is None else dkg.contiguous()
        dvg = torch.zeros_like(vg) if dvg is None else dvg.contiguous()
        for group in groups.groups:
            dist.all_reduce(dkg, group=group)
            dist.all_reduce(dvg, group=group)
        self._fail(rank, "after")
        kv_rows = torch.as_tensor(fx.partitioned_indices(rank, "kv"), device=dev)
        out = {"o": o.detach(), "lse": lse, "dq": dq, "dk": dkg[kv_rows], "dv": dvg[kv_rows]}
        return RankResult({k: t.float().cpu().numpy() for k, t in out.items()}, backend=f"torch all_gather on {dev}",
                          notes={"mistake": self.mistake})
