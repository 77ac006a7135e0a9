#!/usr/bin/env python3
"""Standalone reproduction (torch and FlashAttention-3 or -4 only, no cpgold): with padding between sequences
expressed as padded offsets in cu_seqlens_q/k plus true lengths in seqused_q/k, the values in the pad rows must not
change any output of a valid row. Each run fills the pad rows of one input (q, k, v or dout) with NaN, +inf or a
large finite value and compares every valid row of O, LSE, dQ, dK, dV with the run whose pad rows hold zeros,
bit for bit.

    python3 fa_repro_pad_values.py --impl fa3|fa4 [--lengths 5,3 --padded 8,8] [--dim 64] [--dtype bf16]
    python3 fa_repro_pad_values.py --impl fa3 --dims-probe 128/64     (a (dim_qk, dim_v) pair, in a child process)

Expected: "same" on every line (what FlashAttention's maintainers say of seqused: only this many elements of each
sequence are used). Exit 1 when an output differs, 2 on bad arguments."""
import argparse
import subprocess
import sys

import torch


def load(impl):
    if impl == "fa3":
        from flash_attn_interface import flash_attn_varlen_func
        return lambda *a, **k: flash_attn_varlen_func(*a, return_attn_probs=True, **k)
    from flash_attn.cute import flash_attn_varlen_func   # (q, k, v, qv, cu_seqlens_q, ...): by keyword
    return lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, return_lse=True, **kw)


def batch(lengths, padded, heads, dim, dim_v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(padded)
    x = {n: (torch.rand(total, heads, d, generator=g, device="cuda") * 2 - 1).to(dtype)
         for n, d in (("q", dim), ("k", dim), ("v", dim_v), ("dout", dim_v))}
    offsets = torch.tensor([0] + list(torch.tensor(padded).cumsum(0)), dtype=torch.int32, device="cuda")
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    pad = torch.ones(total, dtype=torch.bool, device="cuda")
    for o, n in zip(offsets.tolist(), lengths):
        pad[o:o + n] = False
    return x, offsets, used, pad


def run(fn, x, offsets, used, padded, causal, deterministic):
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = fn(q, k, v, offsets, offsets, max(padded), max(padded), seqused_q=used, seqused_k=used,
                  causal=causal, deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["dout"])
    lse = lse if lse.shape[0] == q.shape[1] else lse.transpose(0, 1)   # [h, t]
    return {"o": out, "lse": lse.transpose(0, 1), "dq": dq, "dk": dk, "dv": dv}   # every tensor [t, ...]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("fa3", "fa4"), required=True)
    ap.add_argument("--lengths", default="5,3")
    ap.add_argument("--padded", default="8,8")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--dims-probe", help="DIM/DIM_V: one forward and backward with these head dims, in a child")
    ap.add_argument("--child-dims", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    fn = load(a.impl)
    if a.child_dims:
        d, dv = (int(t) for t in a.child_dims.split("/"))
        x, off, used, _ = batch([5, 3], [8, 8], 2, d, dv, dtype)
        r = run(fn, x, off, used, [8, 8], False, False)
        torch.cuda.synchronize()
        print(f"dims {d}/{dv}: ran, O finite on valid rows: {bool(torch.isfinite(r['o'][:5]).all())}")
        return 0
    if a.dims_probe:
        p = subprocess.run([sys.executable, __file__, "--impl", a.impl, "--child-dims", a.dims_probe],
                           capture_output=True, text=True)
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        print(f"{a.impl} dims {a.dims_probe}: child exit {p.returncode}: {tail[0][:300]}")
        print("expected: a clear error naming the unsupported head dims (or a result); a signal is a crash")
        return 0 if p.returncode in (0, 1) else 1
    lengths = [int(t) for t in a.lengths.split(",")]
    padded = [int(t) for t in a.padded.split(",")]
    if len(lengths) != len(padded) or any(n > p for n, p in zip(lengths, padded)):
        ap.error("--lengths and --padded: one each per sequence, length <= padded length")
    x, off, used, pad = batch(lengths, padded, a.heads, a.dim, a.dim, dtype)
    for n in x:
        x[n][pad] = 0
    base = run(fn, x, off, used, padded, a.causal, a.deterministic)
    valid = ~pad
    print(f"{a.impl}: lengths {lengths} padded {padded}, heads {a.heads}, dim {a.dim}, {a.dtype}, causal {a.causal},"
          f" deterministic {a.deterministic}; valid rows compared bit for bit with the zero-padded run")
    differs = 0
    for target in ("q", "k", "v", "dout"):
        for label, value in (("nan", float("nan")), ("+inf", float("inf")), ("1e4", 1e4)):
            y = {n: t.clone() for n, t in x.items()}
            y[target][pad] = value
            r = run(fn, y, off, used, padded, a.causal, a.deterministic)
            bad = []
            for name in ("o", "lse", "dq", "dk", "dv"):
                got, ref = r[name][valid], base[name][valid]
                if not torch.equal(got, ref):
                    nonfinite = int((~torch.isfinite(got)).sum())
                    bad.append(f"{name} ({nonfinite} non-finite)" if nonfinite else f"{name} (values)")
            differs += bool(bad)
            print(f"  pad rows of {target:4} = {label:4}: " + ("same" if not bad else "DIFFERENT: " + ", ".join(bad)))
    print("expected: same on every line")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
