#!/usr/bin/env python3
"""FA-1: with padding between sequences (padded offsets in cu_seqlens_q/k, true lengths in seqused_q/k), NaN or inf
in the pad rows of q, k, v or dout reaches valid rows of O, dQ, dK and dV, in FlashAttention-3 and FlashAttention-4;
torch and the library alone (docs/findings/fa-1-nonfinite-pad-rows.md).

    python3 fa1_nonfinite_pad_rows.py --impl fa3|fa4 [--lengths 1 --padded 2] [--causal] [--dtype bf16|fp16]
                                      [--heads 1] [--dim 64] [--deterministic]

For each input (q, k, v, dout) and each fill of its pad rows (NaN, +inf, 1e4), one forward and backward through
flash_attn_varlen_func; every valid row of O, dQ, dK and dV is compared with a plain masked attention in float64 on
the CPU (in _common.py), which reads valid rows only. Pad rows of the outputs are not compared: FlashAttention never
writes them (a documented convention, not this finding). The default batch is the smallest case: one token in a slot
of two rows, one head.

Expected: every valid output within a few ulps of the reference whatever the pad rows hold. Exit 1 when a fill
changes a valid output (non-finite or wrong), 0 when none does, 2 when it cannot run (library missing, no GPU).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import offsets, reference  # noqa: E402 - after the path

LIMIT_ULPS = 32
FILLS = (("nan", float("nan")), ("+inf", float("inf")), ("1e4", 1e4))
KNOWN = {("v", "o"): "forward: known upstream for a KV cache (FlashAttention issue 2374)"}


def load(impl):
    """The library's varlen function as f(q, k, v, cu, max_seqlen, seqused, causal, deterministic) -> out."""
    if impl == "fa3":
        from flash_attn_interface import flash_attn_varlen_func as fa
        from importlib.metadata import version
        name = f"flash-attn-3 {version('flash-attn-3')}"

        def call(q, k, v, cu, m, used, causal, deterministic):
            r = fa(q, k, v, cu, cu, m, m, seqused_q=used, seqused_k=used, causal=causal, deterministic=deterministic)
            return r[0] if isinstance(r, (tuple, list)) else r
    else:
        from flash_attn.cute import flash_attn_varlen_func as fa
        from importlib.metadata import version
        name = f"flash-attn-4 {version('flash-attn-4')}"

        def call(q, k, v, cu, m, used, causal, deterministic):
            r = fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, seqused_q=used,
                   seqused_k=used, causal=causal, deterministic=deterministic)
            return r[0] if isinstance(r, (tuple, list)) else r
    return call, name


def make_batch(torch, lengths, padded, heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(padded)
    x = {n: (torch.rand(total, heads, dim, generator=g) * 2 - 1) for n in ("q", "k", "v", "dout")}
    pad = torch.ones(total, dtype=torch.bool)
    off = offsets(padded)
    for b, n in enumerate(lengths):
        pad[off[b]:off[b] + n] = False
    for t in x.values():
        t[pad] = 0
    return {n: t.to(dtype) for n, t in x.items()}, pad


def run(torch, call, x, lengths, padded, causal, deterministic, device):
    """O, dQ, dK, dV of one forward and backward, on the CPU as float64 [t, h, d]."""
    i32 = dict(dtype=torch.int32, device=device)
    cu, used = torch.tensor(offsets(padded), **i32), torch.tensor(lengths, **i32)
    q, k, v = (x[n].to(device).requires_grad_() for n in ("q", "k", "v"))
    o = call(q, k, v, cu, max(padded), used, causal, deterministic)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["dout"].to(device))
    return {n: t.detach().double().cpu() for n, t in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("fa3", "fa4"), required=True)
    ap.add_argument("--lengths", default="1", help="valid tokens per sequence (default 1)")
    ap.add_argument("--padded", default="2", help="rows per sequence (default 2)")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--device", default="cuda", help="where the library runs (default cuda)")
    a = ap.parse_args()
    try:
        lengths = [int(t) for t in a.lengths.split(",")]
        padded = [int(t) for t in a.padded.split(",")]
    except ValueError:
        ap.error(f"--lengths {a.lengths!r} / --padded {a.padded!r}: comma-separated integers expected")
    if len(lengths) != len(padded) or any(not 0 <= n <= p for n, p in zip(lengths, padded)):
        ap.error(f"--lengths {lengths} and --padded {padded}: one each per sequence, 0 <= length <= padded")
    if a.heads < 1 or a.dim < 1:
        ap.error(f"--heads {a.heads} / --dim {a.dim}: positive integers expected")
    try:
        import torch
        call, name = load(a.impl)
    except ImportError as e:
        print(f"cannot run: {e}")
        return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("cannot run: no GPU visible")
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    ulp = 2.0 ** -(8 if a.dtype == "bf16" else 11)
    x, pad = make_batch(torch, lengths, padded, a.heads, a.dim, dtype)
    off, scale = offsets(padded), a.dim ** -0.5
    want = {n: torch.zeros(x[s].shape, dtype=torch.float64) for n, s in (("o", "dout"), ("dq", "q"), ("dk", "k"),
                                                                          ("dv", "v"))}
    for b, n in enumerate(lengths):
        s = slice(off[b], off[b] + n)
        if n:
            r = reference(*(x[t][s].double() for t in ("q", "k", "v", "dout")), scale, a.causal)
            for t in want:
                want[t][s] = r[t]
    valid = ~pad
    device = torch.device(a.device)
    print(f"FA-1: {name}, lengths {lengths} in padded slots {padded} (cu_seqlens = padded offsets, seqused = lengths), "
          f"{a.heads} head(s) of dim {a.dim}, {a.dtype}, causal {a.causal}, deterministic {a.deterministic}")
    print("versions: " + json.dumps({"library": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                                     "gpu": torch.cuda.get_device_name() if device.type == "cuda" else str(device)}))
    try:
        base = run(torch, call, x, lengths, padded, a.causal, a.deterministic, device)
    except Exception as e:  # noqa: BLE001 - the library refusing the layout
        print(f"cannot run: the zero-padded call raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return 2

    def judge(out):
        bad = []
        for t in ("o", "dq", "dk", "dv"):
            got, ref = out[t][valid], want[t][valid]
            nonfinite = int((~torch.isfinite(got)).sum())
            err = float((got - ref).abs().nan_to_num(float("inf")).max()) if got.numel() else 0.0
            lim = LIMIT_ULPS * max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-30) * ulp
            if nonfinite or err > lim:
                bad.append((t, nonfinite, err))
        return bad

    if judge(base):
        print(f"cannot run: with zero pad rows the valid outputs are already wrong: {judge(base)}")
        return 2
    print("  pad rows zero: every valid output as expected (the baseline)")
    differs = 0
    for target in ("q", "k", "v", "dout"):
        for label, value in FILLS:
            y = {n: t.clone() for n, t in x.items()}
            y[target][pad] = value
            out = run(torch, call, y, lengths, padded, a.causal, a.deterministic, device)
            bad = judge(out)
            differs += bool(bad)
            same_bits = all(torch.equal(out[t][valid], base[t][valid]) for t in out)
            text = "as expected" + (" (bit for bit as with zero pads)" if same_bits else "")
            if bad:
                text = "DIFFERENT: " + ", ".join(
                    f"{t} ({n} non-finite)" if n else f"{t} (max error {e:.3g})" for t, n, e in bad)
                notes = [KNOWN[(target, t)] for t, _, _ in bad if (target, t) in KNOWN]
                text += ("; " + "; ".join(notes)) if notes else ""
            print(f"  pad rows of {target:4} = {label:4}: {text}")
    print("expected: as expected on every line (the pad rows' values change no valid output)")
    print(f"fills that changed a valid output: {differs} of {4 * len(FILLS)}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
