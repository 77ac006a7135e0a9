"""A small CPU training setup for the capture tests: a model whose attention is a user's own context-parallel ring
attention in torch, run on thread ranks (cpgold.thread_ranks) as it would run under NCCL.

The ring: every rank holds the dual-chunk shard of every sequence of a packed THD batch (TransformerEngine's split:
chunks r and 2W-1-r of each sequence padded to a multiple of 2W, tail rows split evenly at the end); its K/V block
travels around the ring (p2p isend/irecv, one step per rank, an autograd function whose backward sends the gradient
the other way); at each step the rank's queries attend to the block it holds with the mask taken from global positions
(causal, bottom-right aligned, same sequence, valid rows only); the step partials are merged by their LSE. GQA: query
head h reads KV head h // (hq / hkv). Pad rows (between sequences and the tail) give O = 0, LSE = -inf and no gradient.

Bugs that can be planted per call (argument `bug`):
    "diagonal_unmasked"  the causal mask is left out of step 0 (the rank's own K/V: the diagonal blocks), so a query
                         sees the later keys of its own chunk
    "chunks_swapped"     this rank's two chunks of every sequence come out in swapped order (rows of chunk 2W-1-r where
                         chunk r's belong), as if the rank's output were re-ordered with the wrong chunk order
A bug given as "NAME@rR" is planted on rank R only.
"""
import numpy as np
import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------------------------- layout (user's own)


def padded_layout(seqlens, w, extra, tail):
    """cu_seqlens, cu_seqlens_padded and total rows of a packed batch: sequence b padded to a multiple of 2W plus
    extra[b] * 2W rows of padding; `tail` rows after the last sequence (a multiple of W)."""
    lens = np.asarray(seqlens, dtype=np.int64)
    padded = [-(-n // (2 * w)) * 2 * w + e * 2 * w for n, e in zip(lens, extra)]
    cu = np.concatenate([[0], np.cumsum(lens)])
    cu_padded = np.concatenate([[0], np.cumsum(padded)])
    return cu, cu_padded, int(cu_padded[-1] + tail)


def rank_rows(cu_padded, total, w, r):
    """The global rows rank r holds: chunks r and 2W-1-r of every sequence, then its share of the tail rows."""
    rows = []
    for b in range(len(cu_padded) - 1):
        c = (cu_padded[b + 1] - cu_padded[b]) // (2 * w)
        for chunk in (r, 2 * w - 1 - r):
            rows.append(cu_padded[b] + chunk * c + np.arange(c))
    tail = total - cu_padded[-1]
    rows.append(cu_padded[-1] + r * (tail // w) + np.arange(tail // w))
    return np.concatenate(rows).astype(np.int64)


def positions(cu, cu_padded, total, w, r):
    """(sequence, position, valid) of every row rank r holds, as torch tensors (sequence -1 on tail rows)."""
    rows = rank_rows(cu_padded, total, w, r)
    lens = np.diff(cu)
    seq = np.searchsorted(cu_padded, rows, side="right") - 1
    inside = seq < len(lens)
    safe = np.clip(seq, 0, len(lens) - 1)
    pos = np.where(inside, rows - cu_padded[safe], -1)
    valid = inside & (pos < lens[safe])
    return (torch.as_tensor(np.where(inside, seq, -1)), torch.as_tensor(pos), torch.as_tensor(valid))


def swap_order(cu_padded, w, r):
    """The local row order with this rank's two chunks of every sequence swapped."""
    order, start = [], 0
    for b in range(len(cu_padded) - 1):
        c = (cu_padded[b + 1] - cu_padded[b]) // (2 * w)
        order.append(np.arange(start + c, start + 2 * c))
        order.append(np.arange(start, start + c))
        start += 2 * c
    n = start
    return np.concatenate(order + [np.arange(n, n)]).astype(np.int64), n


# ---------------------------------------------------------------------------------------------- the ring


class RingPass(torch.autograd.Function):
    """Sends x to rank + 1 and receives the block of rank - 1 (batch_isend_irecv, even ranks posting the send first);
    the backward sends the gradient to rank - 1 and receives rank + 1's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, -1), None


def _exchange(x, group, direction):
    w = dist.get_world_size(group)
    r = dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    send = dist.P2POp(dist.isend, x, (r + direction) % w, group)
    recv = dist.P2POp(dist.irecv, out, (r - direction) % w, group)
    for req in dist.batch_isend_irecv([send, recv] if r % 2 == 0 else [recv, send]):
        req.wait()
    return out


def _partial(q, k, v, visible, scale):
    """One step's attention of q [L, hq, d] against k, v [Lk, hkv, d] where visible [L, Lk]:
    o [L, hq, dv], lse [hq, L]."""
    g = q.shape[1] // k.shape[1]
    # query head h reads KV head h // g (expand, whose backward is a plain sum: the same bits on every run)
    k = k[:, :, None].expand(k.shape[0], k.shape[1], g, k.shape[2]).reshape(k.shape[0], -1, k.shape[2])
    v = v[:, :, None].expand(v.shape[0], v.shape[1], g, v.shape[2]).reshape(v.shape[0], -1, v.shape[2])
    s = scale * torch.einsum("qhd,khd->hqk", q, k)
    s = s.masked_fill(~visible[None], float("-inf"))
    m = s.amax(dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
    m = torch.where(torch.isfinite(m), m, torch.zeros(()))
    p = torch.exp(s - m[..., None])
    den = p.sum(dim=-1)
    seen = den > 0
    den = torch.where(seen, den, torch.ones(()))
    o = torch.einsum("hqk,khd->qhd", p / den[..., None], v)
    lse = torch.where(seen, m + torch.log(den), torch.tensor(float("-inf")))
    return o, lse


def ring_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, group,
                   causal=True, scale=None, bug=None):
    """This rank's CP attention: q [Lq, hq, d], k, v [Lkv, hkv, d] (its dual-chunk shard), global cu_seqlens and
    padded offsets (as TransformerEngine takes them); group None: one rank. Returns o [Lq, hq, dv] (q's dtype) and
    lse [hq, Lq] (float32)."""
    w = dist.get_world_size(group) if group is not None else 1
    r = dist.get_rank(group) if group is not None else 0
    if bug and "@r" in bug:
        bug, only = bug.split("@r")
        bug = bug if int(only) == r else None
    dtype = q.dtype
    cu_q, cu_kv = (np.asarray(torch.as_tensor(x).cpu()) for x in (cu_seqlens_q, cu_seqlens_kv))
    cpq, cpkv = (np.asarray(torch.as_tensor(x).cpu()) for x in (cu_seqlens_q_padded, cu_seqlens_kv_padded))
    total_q, total_kv = q.shape[0] * w, k.shape[0] * w
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    dev = q.device
    seq_q, pos_q, valid_q = (t.to(dev) for t in positions(cu_q, cpq, total_q, w, r))
    lens_q = torch.as_tensor(np.diff(cu_q), device=dev)
    lens_kv = torch.as_tensor(np.diff(cu_kv), device=dev)
    qf = torch.where(valid_q[:, None, None], q.float(), torch.zeros(()))
    valid_kv_mine = positions(cu_kv, cpkv, total_kv, w, r)[2].to(dev)
    kv = torch.cat([torch.where(valid_kv_mine[:, None, None], k.float(), torch.zeros(())),
                    torch.where(valid_kv_mine[:, None, None], v.float(), torch.zeros(()))], dim=-1)
    outs, lses = [], []
    for step in range(w):
        if step:
            kv = RingPass.apply(kv, group)
        owner = (r - step) % w
        seq_k, pos_k, valid_k = (t.to(dev) for t in positions(cu_kv, cpkv, total_kv, w, owner))
        visible = (seq_q[:, None] == seq_k[None, :]) & valid_q[:, None] & valid_k[None, :]
        if causal and not (bug == "diagonal_unmasked" and step == 0):
            delta = lens_kv[seq_k.clamp(min=0)][None, :] - lens_q[seq_q.clamp(min=0)][:, None]
            visible &= pos_k[None, :] <= pos_q[:, None] + delta
        kk, vv = kv[..., :k.shape[-1]], kv[..., k.shape[-1]:]
        o_s, lse_s = _partial(qf, kk, vv, visible, scale)
        outs.append(o_s)
        lses.append(lse_s)
    lse_all = torch.stack(lses)
    top = lse_all.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros(()))
    weights = torch.exp(lse_all - top)
    z = weights.sum(dim=0)
    seen = z > 0
    z = torch.where(seen, z, torch.ones(()))
    o = sum(o_s * (wt / z).transpose(0, 1)[..., None] for o_s, wt in zip(outs, weights))
    lse = torch.where(seen, top + torch.log(z), torch.tensor(float("-inf")))
    if bug == "chunks_swapped":
        order, n = swap_order(cpq, w, r)
        order = torch.as_tensor(np.concatenate([order, np.arange(n, o.shape[0])]), device=dev)
        o, lse = o[order], lse[:, order]
    return o.to(dtype), lse


# ---------------------------------------------------------------------------------------------- the model


class Block(torch.nn.Module):
    def __init__(self, hidden, hq, hkv, d, attention, bug=None, dtype=torch.float32):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.qkv = torch.nn.Linear(hidden, (hq + 2 * hkv) * d, bias=False)
        self.proj = torch.nn.Linear(hq * d, hidden, bias=False)
        self.attention, self.bug, self.dtype = attention, bug, dtype

    def forward(self, x, batch):
        t = x.shape[0]
        qkv = self.qkv(x)
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.reshape(t, self.hq, self.d).to(self.dtype)
        k = k.reshape(t, self.hkv, self.d).to(self.dtype)
        v = v.reshape(t, self.hkv, self.d).to(self.dtype)
        o, _ = self.attention(q, k, v, batch["cu"], batch["cu"], batch["cu_padded"], batch["cu_padded"],
                              batch["group"], bug=self.bug)
        return x + self.proj(o.float().reshape(t, -1))


class Model(torch.nn.Module):
    def __init__(self, layers, hidden=24, hq=4, hkv=2, d=16, attention=ring_attention, bugs=None,
                 dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        bugs = bugs or {}
        self.layers = torch.nn.ModuleList(Block(hidden, hq, hkv, d, attention, bugs.get(i), dtype)
                                          for i in range(layers))

    def forward(self, x, batch):
        for layer in self.layers:
            x = layer(x, batch)
        return x


def set_attention(model, attention):
    for layer in model.layers:
        layer.attention = attention


def batch_of(w, seqlens=(5, 17, 9, 30), extra=(1, 0, 2, 0), tail=None, hidden=24, seed=1):
    """The global packed batch: embeddings [T, hidden] (pad rows random too), targets, the layout."""
    tail = w if tail is None else tail
    cu, cu_padded, total = padded_layout(seqlens, w, extra, tail)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, hidden, generator=g)
    target = torch.randn(total, hidden, generator=g)
    return {"cu": torch.as_tensor(cu, dtype=torch.int32), "cu_padded": torch.as_tensor(cu_padded, dtype=torch.int32),
            "total": total, "x": x, "target": target, "w": w}


def train_step(model, batch, rank, group):
    """One training step of one rank: its rows of the batch through the model, a loss over its valid rows, backward.
    Returns (loss, output, {parameter name: gradient})."""
    w = batch["w"]
    device = next(model.parameters()).device
    cu, cu_padded = batch["cu"].numpy(), batch["cu_padded"].numpy()
    rows = torch.as_tensor(rank_rows(cu_padded, batch["total"], w, rank))
    _, _, valid = positions(cu, cu_padded, batch["total"], w, rank)
    local = dict(batch, group=group)
    x = batch["x"][rows].to(device)
    out = model(x, local)
    loss = ((out * batch["target"][rows].to(device)).sum(dim=-1) * valid.to(device)).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
