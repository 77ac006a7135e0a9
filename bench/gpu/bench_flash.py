#!/usr/bin/env python3
"""FlashAttention-3, FlashAttention-4 and PyTorch's varlen_attn (FlashAttention-2) on the padded THD batches of
bench_cudnn_thd.py and bench_gpu_attention (bench/gpu/varlen_batches.md) with the same --pad-rows: every sequence
keeps its slot of the cycle length and holds pad-rows tokens fewer. FA3 and FA4 take the padded layout as users hand
it over (padded offsets as cu_seqlens, true lengths as seqused_q/k); varlen_attn has no seqused, so it gets the same
tokens compacted. FLOPs count actual tokens only (backward 2.5x the forward's). Prints the machine's bf16 matrix
rate (8192^3) as the measured ceiling. An implementation that is not installed, or refuses a configuration, prints
a line saying so.

    python3 bench/gpu/bench_flash.py --pad-rows 63 --dims 64,128,192/128,256
"""
import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
from bench_torch import fwd_flops, matmul_rate, median_ms, varlen_lengths  # noqa: E402  (the same batches)


VARLEN_MASK = {}   # the installed varlen_attn's spelling of causal: window_size (-1, 0), or is_causal


def implementations(wanted):
    out = {}
    for name, module in (("fa3", "flash_attn_interface"), ("fa4", "flash_attn.cute")):
        if name not in wanted:
            continue
        try:
            out[name] = importlib.import_module(module).flash_attn_varlen_func
        except Exception as e:  # noqa: BLE001 - reported, the others still run
            print(f"{name}: not run: {type(e).__name__}: {e}".splitlines()[0])
    if "varlen" in wanted:
        try:
            import inspect
            from torch.nn.attention.varlen import varlen_attn
            windowed = "window_size" in inspect.signature(varlen_attn).parameters
            VARLEN_MASK.update({True: {"window_size": (-1, 0)} if windowed else {"is_causal": True},
                                False: {"window_size": (-1, -1)} if windowed else {}})
            out["varlen"] = varlen_attn
        except ImportError as e:
            print(f"varlen: not run: {e}")
    return out


def call(name, fn, q, k, v, cu, used, mx, causal, deterministic=False):
    if name == "fa3":
        out = fn(q, k, v, cu, cu, mx, mx, seqused_q=used, seqused_k=used, causal=causal, deterministic=deterministic)
        return out[0] if isinstance(out, tuple) else out   # (out, lse) only with return_attn_probs
    if name == "fa4":
        return fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, seqused_q=used,
                  seqused_k=used, causal=causal, deterministic=deterministic)[0]
    return fn(q, k, v, cu, cu, mx, mx, **VARLEN_MASK[causal])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pad-rows", type=int, default=0)
    ap.add_argument("--dims", default="64,128,192/128,256", help="d or d/dv, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--totals", default="16384,32768,65536", help="token counts (slot rows), comma separated")
    ap.add_argument("--impls", default="fa3,fa4,varlen", help="which of fa3, fa4, varlen (comma separated)")
    args = ap.parse_args()
    dims = [tuple(int(x) for x in item.split("/")) if "/" in item else (int(item), int(item))
            for item in args.dims.split(",")]
    impls = implementations(set(args.impls.split(",")))
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; pad rows per sequence: "
          f"{args.pad_rows}")
    print(f"bf16 matmul 8192^3: {matmul_rate():.1f} TFLOP/s")
    print(f"{'impl':8} {'mask':5} {'d':7} {'tokens':6} {'fwd_ms':>10} {'fwd_TF':>10} {'bwd_ms':>10} {'bwd_TF':>10} "
          f"{'bwd_det_TF':>10}")
    for d, dv in dims:
        for causal in (True, False):
            for total in (int(t) for t in args.totals.split(",")):
                heads = 2048 // dv
                slots = varlen_lengths(total)
                lens = [max(0, s - args.pad_rows) for s in slots]
                offsets = [0]
                for s in slots:
                    offsets.append(offsets[-1] + s)
                cu_pad = torch.tensor(offsets, dtype=torch.int32, device="cuda")
                used = torch.tensor(lens, dtype=torch.int32, device="cuda")
                cu_act = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                valid = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, lens)]).cuda()
                q, k = (torch.rand(total, heads, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(2))
                v, do = (torch.rand(total, heads, dv, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(2))
                flops = fwd_flops(lens, heads, d, dv, causal)
                dims_text = str(d) if d == dv else f"{d}/{dv}"
                mask = "causal" if causal else "full"
                for name, fn in impls.items():
                    if name == "varlen" and d != dv:
                        continue
                    if name == "varlen":
                        x = [t[valid].contiguous() for t in (q, k, v, do)]
                        cu, mx = cu_act, max(lens)
                    else:
                        x = [q, k, v, do]
                        cu, mx = cu_pad, max(slots)
                    try:
                        with torch.no_grad():
                            fwd = median_ms(lambda: call(name, fn, *x[:3], cu, used, mx, causal), args.reps)
                        rates = []
                        for det in ((False, True) if name != "varlen" else (False,)):
                            qg, kg, vg = (t.clone().requires_grad_() for t in x[:3])
                            out = call(name, fn, qg, kg, vg, cu, used, mx, causal, det)
                            rates.append(median_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), x[3],
                                                                               retain_graph=True), args.reps))
                            del qg, kg, vg, out
                    except Exception as e:  # noqa: BLE001 - a refusal is reported, not fatal
                        print(f"{name:8} {mask:5} {dims_text:7} {total:<6} not run: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]}", flush=True)
                        continue
                    det_text = f"{2.5 * flops / rates[1] * 1e-9:10.1f}" if len(rates) > 1 else f"{'-':>10}"
                    print(f"{name:8} {mask:5} {dims_text:7} {total:<6} {fwd:10.3f} {flops / fwd * 1e-9:10.1f} "
                          f"{rates[0]:10.3f} {2.5 * flops / rates[0] * 1e-9:10.1f} {det_text}", flush=True)
                del q, k, v, do
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
