#!/usr/bin/env python3
"""FlashAttention-3 on 16 queries and no keys, with torch and FlashAttention-3 alone (no cpgold): does the value of
max_seqlen_k (1, as cpgold's fa3 adapter passed before, or 0, the true one) decide whether the process survives?

    python3 fa3_empty_k_repro.py [--deterministic] [--no-seqused] [--k-rows N]

One varlen call the way python/cpgold/outsiders/flash.py makes it: one sequence, seqlens_q [16] and seqlens_kv [0]
(cu_seqlens_q [0, 16], cu_seqlens_k [0, 0], seqused_q [16], seqused_k [0]), 2 heads, head dim 64, max_seqlen_q 16,
no mask, softmax_scale 1/8, return_attn_probs=True. Every combination of max_seqlen_k (1, 0), dtype (fp16, bf16)
and pass (forward; forward and backward) runs in a child process of its own, so a SIGSEGV is reported as a signal
and the other combinations still run. One line per combination: the exit (or the signal), then what the library
returned (O all zero, the LSE values, dQ/dK/dV all zero) or its error's last line. --k-rows N gives K N rows past
the last sequence (tail rows, cu_seqlens_k still [0, 0]), so that the library has a K tensor with rows to read.

Expected: no line with a signal. Both values give O = 0 and LSE = +inf (FlashAttention-3's convention for a row
without keys) or -inf, and dQ = 0. Exit 0 when no child died by a signal, 1 when one did, 2 on bad arguments.
"""
import argparse
import subprocess
import sys


def child(max_seqlen_k, dtype_name, backward, deterministic, seqused, k_rows):
    import torch
    from flash_attn_interface import flash_attn_varlen_func

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    heads, dim, lq = 2, 64, 16
    q = torch.randn(lq, heads, dim, device="cuda", dtype=dtype, requires_grad=backward)
    k = torch.randn(k_rows, heads, dim, device="cuda", dtype=dtype, requires_grad=backward)
    v = torch.randn(k_rows, heads, dim, device="cuda", dtype=dtype, requires_grad=backward)
    i32 = dict(dtype=torch.int32, device="cuda")
    extra = {"seqused_q": torch.tensor([lq], **i32), "seqused_k": torch.tensor([0], **i32)} if seqused else {}
    result = flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.tensor([0, lq], **i32),
                                    cu_seqlens_k=torch.tensor([0, 0], **i32), max_seqlen_q=lq,
                                    max_seqlen_k=max_seqlen_k, softmax_scale=dim ** -0.5, causal=False,
                                    window_size=(-1, -1), deterministic=deterministic, return_attn_probs=True,
                                    **extra)
    out, lse = (result[0], result[1]) if isinstance(result, (tuple, list)) else (result, None)
    torch.cuda.synchronize()
    said = [f"O all zero {bool((out == 0).all())}"]
    if lse is not None:
        said.append(f"LSE values {sorted(set(lse.float().flatten().tolist()))[:4]}")
    if backward:
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        said.append(f"dQ all zero {bool((q.grad == 0).all())}")
        if k_rows:
            said.append(f"dK, dV all zero {bool((k.grad == 0).all() and (v.grad == 0).all())}")
    print("ran: " + ", ".join(said))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deterministic", action="store_true", help="deterministic=True (the adapter's --deterministic)")
    ap.add_argument("--no-seqused", action="store_true", help="leave seqused_q/k out")
    ap.add_argument("--k-rows", type=int, default=0, help="rows of K and V (tail rows past the sequence; default 0)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.k_rows < 0:
        ap.error(f"--k-rows: expected a number >= 0, got {a.k_rows}")
    if a.child:
        max_seqlen_k, dtype_name, backward = a.child.split(",")
        child(int(max_seqlen_k), dtype_name, backward == "1", a.deterministic, not a.no_seqused, a.k_rows)
        return 0
    print(f"FlashAttention-3 varlen: 16 queries, no keys (K rows {a.k_rows}), 2 heads, d 64, seqused "
          f"{'no' if a.no_seqused else 'yes'}, deterministic {a.deterministic}; one child each")
    crashed = 0
    for max_seqlen_k in (1, 0):
        for dtype_name in ("fp16", "bf16"):
            for backward in (0, 1):
                argv = [sys.executable, __file__, "--child", f"{max_seqlen_k},{dtype_name},{backward}",
                        "--k-rows", str(a.k_rows)] + (["--deterministic"] if a.deterministic else []) + \
                       (["--no-seqused"] if a.no_seqused else [])
                p = subprocess.run(argv, capture_output=True, text=True)
                lines = [ln for ln in (p.stdout + p.stderr).strip().splitlines() if "warn" not in ln.lower()]
                if p.returncode < 0:
                    import signal
                    try:
                        name = signal.Signals(-p.returncode).name
                    except ValueError:
                        name = "an unknown signal"
                    state = f"signal {-p.returncode} ({name})"
                    crashed += 1
                else:
                    state = f"exit {p.returncode}"
                passes = "forward+backward" if backward else "forward         "
                print(f"  max_seqlen_k {max_seqlen_k}, {dtype_name}, {passes}: {state}: "
                      f"{(lines[-1] if lines else '')[:200]}", flush=True)
    print("expected: no signal; O all zero and dQ all zero where the call ran (exit 1 with an error is a refusal)")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
