"""Your own CP attention under cpgold's pytest plugin, on W thread ranks of the CPU (docs/python.md, "Your own CP
code"). Runnable as shipped, without a GPU:

    pytest docs/python/test_own_cp_attention.py --cpgold-suite quick

`cp_attention` is a context-parallel attention written against torch.distributed as it would run under NCCL: every
rank holds its dual-chunk shard of Q, K, V (the fixture's partition), all-gathers K and V from the other ranks
(backward: dK, dV summed over the ranks) and computes its rows' attention with the mask taken from global positions.
`cpgold.run_cp` shards the fixture's inputs, runs it on `fixture.cp_size` thread ranks, takes dQ, dK, dV by autograd
and checks every rank and the gathered outputs.
"""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import cpgold  # noqa: E402


class AllGatherRows(torch.autograd.Function):
    """All-gather along rows (rank order); its backward sums the gradient over the ranks and keeps this rank's rows
    (all_gather and all_reduce: offered by NCCL, gloo and thread ranks alike)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def cp_attention(q, k, v, ctx):
    """One rank: q [Lq, hq, d], k, v [Lkv, hkv, d] (the rank's shards). Returns o [Lq, hq, dv] and lse [hq, Lq]."""
    o, lse = attention_of_rank(q, k, v, ctx)
    # Pad rows of O are 0 already (no visible key), but only this where() keeps the garbage of dout's pad rows out of
    # dV and dK in the backward (0 * NaN is NaN).
    _, _, valid_q = ctx.positions("q")
    return torch.where(valid_q[:, None, None], o, torch.zeros(())), lse


def attention_of_rank(q, k, v, ctx):
    """The rank's rows of attention over every rank's K/V (all-gathered), O not yet masked for the backward."""
    fx = ctx.fixture
    seq_q, pos_q, valid_q = ctx.positions("q")
    # Pad rows hold garbage on purpose (NaN, inf): zero them before they meet a matmul, or NaN leaks into every row
    # (0 * NaN) and into dQ / dK.
    q = torch.where(valid_q[:, None, None], q.float(), torch.zeros(()))
    _, _, valid_kv_local = ctx.positions("kv")
    k = torch.where(valid_kv_local[:, None, None], k.float(), torch.zeros(()))
    v = torch.where(valid_kv_local[:, None, None], v.float(), torch.zeros(()))
    k_all, v_all = AllGatherRows.apply(k, ctx.group), AllGatherRows.apply(v, ctx.group)
    # Sequence and position of every gathered K/V row: the ranks' positions, in rank order.
    seq_kv, pos_kv, valid_kv = (torch.cat(parts) for parts in zip(*[
        cpgold.cp_driver.RankContext(fx, r, ctx.world_size, None, ctx.device).positions("kv")
        for r in range(ctx.world_size)]))
    lens_q = torch.as_tensor(fx.seqlens("q"), dtype=torch.long)
    lens_kv = torch.as_tensor(fx.seqlens("kv"), dtype=torch.long)
    # Bottom-right aligned mask from global positions: j <= i + delta + right, j >= i + delta - left.
    delta = lens_kv[seq_kv.clamp(min=0)][None, :] - lens_q[seq_q.clamp(min=0)][:, None]
    i, j = pos_q[:, None], pos_kv[None, :]
    visible = (seq_q[:, None] == seq_kv[None, :]) & valid_q[:, None] & valid_kv[None, :]
    left, right = fx.window
    if left >= 0:
        visible &= j >= i + delta - left
    if right >= 0:
        visible &= j <= i + delta + right
    group = fx.heads_q // fx.heads_kv
    k_all = k_all.repeat_interleave(group, dim=1)      # query head h reads kv head h // group
    v_all = v_all.repeat_interleave(group, dim=1)
    scores = fx.softmax_scale * torch.einsum("qhd,khd->hqk", q, k_all)
    scores = torch.where(visible[None], scores, torch.tensor(float("-inf")))
    # Rows without a visible key: O = 0 and LSE = -inf, with no NaN on the way (nor in the backward).
    if scores.shape[-1] == 0:   # no key on any rank (an empty batch): amax has no elements to reduce
        m = scores.new_full(scores.shape[:-1], float("-inf"))
    else:
        m = scores.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros(()))
    p = torch.exp(scores - m[..., None])
    den = p.sum(dim=-1)
    seen = den > 0
    den = torch.where(seen, den, torch.ones(()))
    o = torch.einsum("hqk,khd->qhd", p / den[..., None], v_all)
    lse = torch.where(seen, m + torch.log(den), torch.tensor(float("-inf")))
    return o, lse


def test_cp_attention_forward_and_backward(cpgold_case):
    cpgold.run_cp(cp_attention, cpgold_case, device="cpu", lse_layout="ht")


def test_cp_attention_each_rank_checks_itself(cpgold_case):
    """TransformerEngine's style: each rank checks its own outputs, the rank read from the process group."""
    fx = cpgold_case

    def rank_main(rank, ranks):
        x = fx.rank_inputs(rank, "torch")
        ctx = cpgold.cp_driver.RankContext(fx, rank, fx.cp_size, ranks.group(), torch.device("cpu"))
        o, lse = cp_attention(x["q"], x["k"], x["v"], ctx)
        cpgold.testing.assert_rank_close(fx, {"o": o, "lse": lse}, tensors="o,lse", lse_layout="ht")

    from cpgold.thread_ranks import ThreadRanks

    ThreadRanks(fx.cp_size, device="cpu").run(rank_main)
