#!/usr/bin/python3
"""Writes a `cpgold check` candidate from PyTorch's varlen attention (FlashAttention-2 inside) on a fixture's inputs:
the device half of the false-alarm sweep (docs/tolerance.md).

    python3 docs/python/torch_varlen_candidate.py FIXTURE.h5 CANDIDATE.h5 [--backend torch|numpy]
    cpgold check --empty-row-lse pos-inf FIXTURE.h5 CANDIDATE.h5     # FA2 writes LSE = +inf on rows without keys

The valid rows of every sequence are packed (padding between sequences and tail rows removed), run through
`torch.nn.attention.varlen.varlen_attn` (forward with LSE, backward through autograd) and scattered back into the
fixture's padded layout: pad rows 0, LSE pad rows -inf. The candidate holds the global outputs at the root and, when
cp_size > 1, every rank's rows (/layout/partitioned_indices_*) under /ranks/<r>/: what a CP implementation that is
correct per rank returns. `--backend numpy` runs a float64 attention on the same packed tensors instead (rounded to
the dtype as a kernel stores them): it exercises the packing, the window mapping and the scatter on a machine
without a GPU (test fixtures_torch_candidate_numpy). Exit 0 written, 2 bad usage, 3 a case varlen_attn cannot
express (fp32, head dims not a multiple of 8, GQA without enable_gqa support is expanded instead).
"""
import inspect
import sys

import h5py
import numpy as np

from check_golden import case_of, round_to, visible
from write_candidate import rank_outputs


def packed_rows(cu, off):
    """Global rows of the valid tokens in sequence order, and the packed cu_seqlens."""
    rows, cu_packed = [], [0]
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        rows.extend(range(int(off[b]), int(off[b]) + n))
        cu_packed.append(cu_packed[-1] + n)
    return np.array(rows, dtype=np.int64), np.array(cu_packed, dtype=np.int32)


def numpy_attention(q, k, v, do, cu_q, cu_kv, scale, window, causal):
    """float64 attention on packed THD tensors: O, LSE [h, t] (+inf on rows without keys, as FA2), dQ, dK, dV."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    o, lse = np.zeros((tq, hq, v.shape[2])), np.full((hq, tq), np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        lq, lkv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if lq == 0:
            continue
        mask = visible(lq, lkv, window, causal)
        seen = mask.any(axis=1)
        for h in range(hq):
            s = np.where(mask, scale * (q[rq, h] @ k[rk, h // g].T), -np.inf)
            m = np.where(seen, s.max(axis=1, initial=-np.inf), 0.0)
            l_ = np.where(seen, m + np.log(np.where(seen, np.exp(s - m[:, None]).sum(axis=1), 1.0)), np.inf)
            p = np.where(mask, np.exp(s - np.where(seen, l_, 0.0)[:, None]), 0.0)
            o[rq, h], lse[h, rq] = p @ v[rk, h // g], l_
            ds = p * (do[rq, h] @ v[rk, h // g].T - (do[rq, h] * o[rq, h]).sum(axis=1)[:, None])
            dq[rq, h] = scale * (ds @ k[rk, h // g])
            dk[rk, h // g] += scale * (ds.T @ q[rq, h])
            dv[rk, h // g] += p.T @ do[rq, h]
    return o, lse, dq, dk, dv


def torch_attention(q, k, v, do, cu_q, cu_kv, scale, window, causal, dtype):
    """varlen_attn on the device; LSE returned as [h, t]."""
    import torch
    from torch.nn.attention import varlen as varlen_module

    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    dev = "cuda"
    hq, hkv = q.shape[1], k.shape[1]
    params = inspect.signature(varlen_module.varlen_attn).parameters
    expand = hq != hkv and "enable_gqa" not in params
    tq, tk, tv = (torch.tensor(x, dtype=tdtype, device=dev).requires_grad_() for x in (q, k, v))
    kk, vv = (tk.repeat_interleave(hq // hkv, dim=1), tv.repeat_interleave(hq // hkv, dim=1)) if expand else (tk, tv)
    kw = {}
    wl, wr = window
    if "window_size" in params:
        kw["window_size"] = (wl, 0) if causal else (wl, wr)
    elif wl >= 0 or wr >= 0:
        return None  # this torch has no window argument
    elif causal:
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.shape[2] ** -0.5) > 1e-12:
        return None
    if hq != hkv and not expand:
        kw["enable_gqa"] = True
    kw["return_aux"] = varlen_module.AuxRequest(lse=True)
    cq, ck = (torch.tensor(c, dtype=torch.int32, device=dev) for c in (cu_q, cu_kv))
    mq, mk = int(np.diff(cu_q).max(initial=0)), int(np.diff(cu_kv).max(initial=0))
    out, aux = varlen_module.varlen_attn(tq, kk, vv, cq, ck, mq, mk, **kw)
    lse = aux.lse.float()
    if lse.shape[0] != hq:  # [t, h] in some versions
        lse = lse.transpose(0, 1)
    grads = torch.autograd.grad(out, (tq, tk, tv), torch.tensor(do, dtype=tdtype, device=dev))
    as_np = lambda x: x.detach().float().cpu().numpy().astype(np.float64)
    return as_np(out), as_np(lse), as_np(grads[0]), as_np(grads[1]), as_np(grads[2])


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    fixture, candidate = argv[0], argv[1]
    backend = argv[argv.index("--backend") + 1] if "--backend" in argv else "torch"
    if backend not in ("torch", "numpy"):
        print(f"--backend: expected torch or numpy, got {backend!r}")
        return 2
    with h5py.File(fixture, "r") as f:
        c = case_of(f)
        dtype, cp_size = c["dtype"], int(c["cp_size"])
        if dtype == "fp32" or c["dim_qk"] % 8 or c["dim_v"] % 8 or c["dim_qk"] != c["dim_v"]:
            print(f"{fixture}: not expressible with varlen_attn (dtype {dtype}, dims {c['dim_qk']}/{c['dim_v']})")
            return 3
        rows_q, cu_q = packed_rows(f["layout/cu_seqlens_q"][()], f["layout/cu_seqlens_q_padded"][()])
        rows_kv, cu_kv = packed_rows(f["layout/cu_seqlens_kv"][()], f["layout/cu_seqlens_kv_padded"][()])
        inputs = {n: np.asarray(f["inputs/" + n][()], dtype=np.float64) for n in ("q", "k", "v", "dout")}
        idx_q, idx_kv = f["layout/partitioned_indices_q"][()], f["layout/partitioned_indices_kv"][()]
    q, do = inputs["q"][rows_q], inputs["dout"][rows_q]
    k, v = inputs["k"][rows_kv], inputs["v"][rows_kv]
    args = (q, k, v, do, cu_q, cu_kv, float(c["softmax_scale"]), tuple(c["window"]), c["mask"] == "causal")
    result = torch_attention(*args, dtype) if backend == "torch" else numpy_attention(*args)
    if result is None:
        print(f"{fixture}: not expressible with this torch's varlen_attn (window or scale argument missing)")
        return 3
    o, lse, dq, dk, dv = result
    tq, tkv = inputs["q"].shape[0], inputs["k"].shape[0]
    out = {"o": np.zeros((tq,) + o.shape[1:]), "dq": np.zeros((tq,) + dq.shape[1:]),
           "dk": np.zeros((tkv,) + dk.shape[1:]), "dv": np.zeros((tkv,) + dv.shape[1:]),
           "lse": np.full((lse.shape[0], tq), -np.inf)}
    for name, packed, rows in (("o", o, rows_q), ("dq", dq, rows_q), ("dk", dk, rows_kv), ("dv", dv, rows_kv)):
        out[name][rows] = round_to(packed, dtype)  # what a kernel stores (torch's values are already in the dtype)
    out["lse"][:, rows_q] = lse.astype(np.float32)
    out = {name: x.astype(np.float32) for name, x in out.items()}
    with h5py.File(candidate, "w") as cand:
        for name, x in out.items():
            cand[name] = x
        if cp_size > 1:
            for r in range(cp_size):
                g = cand.create_group(f"ranks/{r}")
                for name, x in rank_outputs(out, idx_q, idx_kv, r).items():
                    g[name] = x
    print(f"wrote {candidate} ({backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
