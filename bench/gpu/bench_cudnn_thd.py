#!/usr/bin/env python3
"""cuDNN fused attention on padded THD batches (ragged offsets, python/cpgold/outsiders/cudnn_thd.py), the batches of
bench_gpu_attention (bench/gpu/varlen_batches.md) with the same --pad-rows: every sequence keeps its slot of the
cycle length and holds pad-rows tokens fewer, the rest is padding between sequences. FLOPs count actual tokens only.
Prints the machine's bf16 matrix rate (8192^3) as the measured ceiling.

    python3 bench/gpu/bench_cudnn_thd.py --pad-rows 63 --dims 128,64,192/128
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "python")]
import cudnn  # noqa: E402
from cpgold.outsiders import cudnn_thd  # noqa: E402
from bench_torch import fwd_flops, matmul_rate, median_ms, varlen_lengths  # noqa: E402  (the same batches)


def main():
    ap = argparse.ArgumentParser(description="cuDNN THD attention on padded varlen batches")
    ap.add_argument("--pad-rows", type=int, default=0)
    ap.add_argument("--dims", default="128,64", help="d or d/dv, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--totals", default="16384,32768,65536", help="token counts (slot rows), comma separated")
    ap.add_argument("--divide", type=int, default=1,
                    help="every slot length of the cycle divided by this divisor of 512 (8: 64..512, CP chunk lengths)")
    args = ap.parse_args()
    if args.divide < 1 or 512 % args.divide:
        ap.error(f"--divide: expected a divisor of 512 (1, 2, 4, ..., 512), got {args.divide}")
    dims = [tuple(int(x) for x in item.split("/")) if "/" in item else (int(item), int(item))
            for item in args.dims.split(",")]
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
          f"{cudnn.backend_version_string()}, frontend {cudnn.__version__}; slot lengths {512 // args.divide}.."
          f"{4096 // args.divide} cycling; pad rows per sequence: {args.pad_rows}")
    print(f"bf16 matmul 8192^3: {matmul_rate():.1f} TFLOP/s")
    print(f"{'impl':8} {'mask':5} {'d':7} {'tokens':6} {'fwd_ms':>10} {'fwd_TF':>10} {'bwd_ms':>10} {'bwd_TF':>10} "
          f"{'bwd_det_TF':>10}")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    for d, dv in dims:
        for causal in (True, False):
            for total in (int(t) for t in args.totals.split(",")):
                heads = 2048 // dv
                slots = varlen_lengths(total, args.divide)
                lens = [max(0, s - args.pad_rows) for s in slots]
                offsets = [0]
                for s in slots:
                    offsets.append(offsets[-1] + s)
                window = (-1, 0) if causal else (-1, -1)
                rates = []
                for deterministic in (False, True):
                    att = cudnn_thd.ThdAttention(handle, torch.bfloat16, heads, heads, d, dv, len(lens), max(lens),
                                                 max(lens), d ** -0.5, causal, window, deterministic)
                    bt = att.batch_tensors(offsets, offsets, lens, lens)
                    q, k = (torch.rand(total, heads, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(2))
                    v, do = (torch.rand(total, heads, dv, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(2))
                    o = torch.zeros(total, heads, dv, device="cuda", dtype=torch.bfloat16)
                    stats = torch.empty(att.b, heads, att.sq, 1, device="cuda", dtype=torch.float32)
                    dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                    fwd = median_ms(lambda: att.forward(q, k, v, o, stats, bt), args.reps)
                    bwd = median_ms(lambda: att.backward(q, k, v, o, do, stats, dq, dk, dvv, bt), args.reps)
                    rates.append((fwd, bwd))
                    del att, q, k, v, do, o, dq, dk, dvv, stats
                    torch.cuda.empty_cache()
                flops = fwd_flops(lens, heads, d, dv, causal)
                (fwd, bwd), (_, bwd_det) = rates
                dims_text = str(d) if d == dv else f"{d}/{dv}"
                print(f"{'cudnn':8} {'causal' if causal else 'full':5} {dims_text:7} {total:<6} {fwd:10.3f} "
                      f"{flops / fwd * 1e-9:10.1f} {bwd:10.3f} {2.5 * flops / bwd * 1e-9:10.1f} "
                      f"{2.5 * flops / bwd_det * 1e-9:10.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
