#!/usr/bin/env python3
"""The process death of FlashAttention's deterministic backward at head dim 256 with GQA
(lab/records/outsiders-flash.md: `edge/d256_p2p_w2_gqa` died with SIGSEGV under `deterministic=True`), with torch and
FlashAttention-3 or -4 alone (no cpgold, no TransformerEngine):

    python3 fa_crash_repro.py --impl fa3|fa4 [--lengths 70,1,13 --padded 72,8,16]

Each combination of head dim (256, 128), heads (4 query / 2 KV, 4 / 4) and backward (default, deterministic) runs
one causal varlen forward and backward in a child process: padded offsets in cu_seqlens_q/k, the true lengths in
seqused_q/k, bf16. A child that ends by a signal crashed; the table says which combinations do.
Expected: every child exits 0 (a clear Python error for a combination the library does not support is exit 1).
Exit 1 when a child crashed, 2 on bad arguments."""
import argparse
import subprocess
import sys

import torch


def child(impl, lengths, padded, heads_q, heads_kv, dim, deterministic):
    if impl == "fa3":
        from flash_attn_interface import flash_attn_varlen_func as fa
        call = lambda q, k, v, cu, used, m: fa(q, k, v, cu, cu, m, m, seqused_q=used, seqused_k=used, causal=True,
                                               deterministic=deterministic)
    else:
        from flash_attn.cute import flash_attn_varlen_func as fa
        call = lambda q, k, v, cu, used, m: fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                               max_seqlen_k=m, seqused_q=used, seqused_k=used, causal=True,
                                               deterministic=deterministic)
    torch.manual_seed(0)
    total = sum(padded)
    q = torch.randn(total, heads_q, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, heads_kv, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    cu = torch.tensor([0] + [sum(padded[:i + 1]) for i in range(len(padded))], dtype=torch.int32, device="cuda")
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = call(q, k, v, cu, used, max(padded))
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"ran: dQ finite {bool(torch.isfinite(q.grad).all())}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("fa3", "fa4"), required=True)
    ap.add_argument("--lengths", default="70,1,13")
    ap.add_argument("--padded", default="72,8,16")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(t) for t in a.lengths.split(",")]
    padded = [int(t) for t in a.padded.split(",")]
    if len(lengths) != len(padded) or any(n > p for n, p in zip(lengths, padded)):
        ap.error("--lengths and --padded: one each per sequence, length <= padded length")
    if a.child:
        hq, hkv, dim, det = (int(t) for t in a.child.split(","))
        child(a.impl, lengths, padded, hq, hkv, dim, bool(det))
        return 0
    print(f"{a.impl}: causal varlen, lengths {lengths} in padded slots {padded} (seqused), bf16; one child each")
    crashed = 0
    for dim in (256, 128):
        for hq, hkv in ((4, 2), (4, 4)):
            for det in (0, 1):
                p = subprocess.run([sys.executable, __file__, "--impl", a.impl, "--lengths", a.lengths, "--padded",
                                    a.padded, "--child", f"{hq},{hkv},{dim},{det}"], capture_output=True, text=True)
                lines = [l for l in (p.stdout + p.stderr).strip().splitlines() if "warn" not in l.lower()]
                state = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
                crashed += p.returncode < 0
                print(f"  d {dim:3}, heads {hq}/{hkv}, {'deterministic' if det else 'default      '}: {state}: "
                      f"{(lines[-1] if lines else '')[:200]}")
    print("expected: exit 0 (or exit 1 naming an unsupported combination) on every line; a signal is a crash")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
