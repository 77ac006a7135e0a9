#!/usr/bin/env python3
"""FA-2: FlashAttention-3 (the stable-ABI build for torch >= 2.9) kills the process with SIGSEGV on two
configurations it has an error message for, with torch and the library alone
(docs/findings/fa-2-fa3-dies-instead-of-raising.md).

    python3 fa2_fa3_dies_instead_of_raising.py [--impl fa3|fa4] [--config NAME ...] [--timeout S]

Each configuration runs one varlen forward and backward (padded offsets in cu_seqlens_q/k, true lengths in
seqused_q/k, bf16) in a child process of its own, so that a crash is reported as a signal and the others still run:
  dims_128_64          head dims 128 (Q/K) and 64 (V), no mask, lengths [5, 3] in slots [8, 8], 2 heads
  d256_det_gqa         head dim 256, deterministic=True, causal, lengths [70, 1, 13] in [72, 8, 16], 4 / 2 heads
  d256_det_mha         the same with 4 / 4 heads
  d256_default_gqa     control: head dim 256, default backward
  d128_det_gqa         control: head dim 128, deterministic=True
Expected: either the call ends and O, dQ, dK, dV of every valid row match a plain masked attention in float64 on the
CPU (in _common.py), or it raises a Python exception naming what it does not support (FlashAttention-3's sources
have such errors for the first three). Observed before: signal 11 for the first three with FlashAttention-3.

Exit 1 when a child dies by a signal, or returns wrong values (not refused cleanly either way); 0 when every
configuration ends or raises; 2 when it cannot run (library missing, no GPU).
"""
import argparse
import json
import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import gqa_reference as reference, padded_bf16_inputs  # noqa: E402 - after the path

LIMIT_ULPS = 32
CONFIGS = {
    "dims_128_64": dict(dims=(128, 64), heads=(2, 2), lengths=[5, 3], padded=[8, 8], causal=False, det=False),
    "d256_det_gqa": dict(dims=(256, 256), heads=(4, 2), lengths=[70, 1, 13], padded=[72, 8, 16], causal=True,
                         det=True),
    "d256_det_mha": dict(dims=(256, 256), heads=(4, 4), lengths=[70, 1, 13], padded=[72, 8, 16], causal=True,
                         det=True),
    "d256_default_gqa": dict(dims=(256, 256), heads=(4, 2), lengths=[70, 1, 13], padded=[72, 8, 16], causal=True,
                             det=False),
    "d128_det_gqa": dict(dims=(128, 128), heads=(4, 2), lengths=[70, 1, 13], padded=[72, 8, 16], causal=True,
                         det=True),
}
EXPECT_REFUSAL = ("dims_128_64", "d256_det_gqa", "d256_det_mha")


def child(impl, name, device):
    """One configuration: prints 'stage ...' lines as it goes and a final 'RESULT {...}' line."""
    import torch
    c = CONFIGS[name]
    if impl == "fa3":
        from flash_attn_interface import flash_attn_varlen_func as fa

        def call(q, k, v, cu, m, used):
            r = fa(q, k, v, cu, cu, m, m, seqused_q=used, seqused_k=used, causal=c["causal"],
                   deterministic=c["det"])
            return r[0] if isinstance(r, (tuple, list)) else r
    else:
        from flash_attn.cute import flash_attn_varlen_func as fa

        def call(q, k, v, cu, m, used):
            r = fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, seqused_q=used,
                   seqused_k=used, causal=c["causal"], deterministic=c["det"])
            return r[0] if isinstance(r, (tuple, list)) else r
    (hq, hkv), (dqk, dv) = c["heads"], c["dims"]
    x, off = padded_bf16_inputs(torch, 0, c["padded"], c["lengths"], hq, hkv, dqk, dv)
    i32 = dict(dtype=torch.int32, device=device)
    cu, used = torch.tensor(off, **i32), torch.tensor(c["lengths"], **i32)
    q, k, v = (x[n].to(device).requires_grad_() for n in ("q", "k", "v"))
    print("stage forward", flush=True)
    o = call(q, k, v, cu, max(c["padded"]), used)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print("stage backward", flush=True)
    dq, dk, dvv = torch.autograd.grad(o, (q, k, v), x["dout"].to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    print("stage compare", flush=True)
    got = {"o": o, "dq": dq, "dk": dk, "dv": dvv}
    worst = {}
    for t in got:
        got[t] = got[t].detach().double().cpu()
    for b, n in enumerate(c["lengths"]):
        s = slice(off[b], off[b] + n)
        ref = reference(*(x[t][s].double() for t in ("q", "k", "v", "dout")), dqk ** -0.5, c["causal"])
        for t, r in ref.items():
            e = float((got[t][s] - r).abs().nan_to_num(float("inf")).max())
            mag = float(r.abs().max())
            w = worst.setdefault(t, [0.0, 0.0])
            w[0], w[1] = max(w[0], e), max(w[1], mag)
    ulps = {t: (e / (max(m, 1e-30) * 2.0 ** -8)) for t, (e, m) in worst.items()}
    print("RESULT " + json.dumps({"ulps": ulps}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("fa3", "fa4"), default="fa3")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one configuration may take (default 300)")
    ap.add_argument("--device", default="cuda", help="where the library runs (default cuda)")
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS), help="a configuration (repeatable; "
                    "default every one)")
    ap.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    try:
        import importlib
        import torch
        importlib.import_module({"fa3": "flash_attn_interface", "fa4": "flash_attn.cute"}[a.impl])
    except ImportError as e:
        print(f"cannot run: {e}")
        return 2
    if a.child:
        child(a.impl, a.child, torch.device(a.device))
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("cannot run: no GPU visible")
        return 2
    from importlib.metadata import version
    dist = {"fa3": "flash-attn-3", "fa4": "flash-attn-4"}[a.impl]
    try:
        lib = f"{dist} {version(dist)}"
    except Exception:  # noqa: BLE001 - a build without metadata
        lib = f"{dist} (no version metadata)"
    print(f"FA-2: {lib}, one child process per configuration")
    print("versions: " + json.dumps({"library": lib, "torch": torch.__version__, "cuda": torch.version.cuda,
                                     "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device}))
    crashed = wrong = 0
    for name, c in CONFIGS.items():
        if a.config and name not in a.config:
            continue
        argv = [sys.executable, __file__, "--impl", a.impl, "--device", a.device, "--child", name]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
            code, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = "timeout", e.stdout or "", e.stderr or ""
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        stages = [ln[6:] for ln in out.splitlines() if ln.startswith("stage ")]
        results = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
        desc = (f"head dims {c['dims'][0]}/{c['dims'][1]}, heads {c['heads'][0]}/{c['heads'][1]}, "
                f"{'deterministic' if c['det'] else 'default'} backward")
        if isinstance(code, int) and code < 0:
            crashed += 1
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = "unknown"
            print(f"  {name:17} ({desc}): signal {-code} ({sig}) in the {stages[-1] if stages else 'import'}"
                  "   <-- the process died")
        elif code == "timeout":
            crashed += 1
            print(f"  {name:17} ({desc}): no end within {a.timeout:g} s (in the {stages[-1] if stages else 'import'})")
        elif results:
            u = results[-1]["ulps"]
            bad = [t for t, v in u.items() if not v <= LIMIT_ULPS]
            wrong += bool(bad)
            print(f"  {name:17} ({desc}): ended; worst errors in bf16 ulps "
                  f"{ {t: round(v, 1) for t, v in u.items()} }" + (f"   <-- wrong: {', '.join(bad)}" if bad else ""))
        else:
            lines = [ln for ln in err.strip().splitlines() if ln.strip() and "warn" not in ln.lower()]
            print(f"  {name:17} ({desc}): raised in the {stages[-1] if stages else 'import'} (exit {code}): "
                  f"{(lines[-1] if lines else '')[:220]}")
    print(f"expected: each configuration ends right or raises (FlashAttention-3 has errors for "
          f"{', '.join(EXPECT_REFUSAL)}); observed: {crashed} process death(s), {wrong} wrong result(s)")
    return 1 if crashed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
