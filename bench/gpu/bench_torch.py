#!/usr/bin/env python3
"""PyTorch baselines for bench_gpu_attention on the same device in the same run (bench/gpu/varlen_batches.md):
varlen_attn (FlashAttention-2 inside) on the same varlen batches, and cuDNN SDPA on equal-length batches
(seqlen 2048) of the same token count, plus the machine's bf16 matrix rate (8192^3 matmul).

usage: bench_torch.py [--dims 128,64] [--tokens 16384,32768,65536] [--divide N]
(head dims d = d_v; heads = 2048 / d; --divide N, a divisor of 512: every length of the cycle and cuDNN's 2048
divided by N, the same tokens in sequences as short as CP chunks, as bench_gpu_attention --divide N)"""
import inspect
import math
import sys

import torch
import torch.nn.functional as F

CYCLE = [512, 1536, 2560, 3584, 1024, 3072, 2048, 4096]


def varlen_lengths(total, divide=1, scale=1):
    """bench/gpu/varlen_lengths.hpp's batch: the cycle times scale, divided by divide, the last length cut."""
    lens, s, i = [], 0, 0
    while s < total:
        n = min(CYCLE[i % 8] * scale // divide, total - s)
        lens.append(n)
        s += n
        i += 1
    return lens


def fwd_flops(lens, heads, d, dv, causal):
    return sum(2.0 * s * (s / 2.0 if causal else s) * (d + dv) * heads for s in lens)


def median_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps=10)
    return 2 * 8192**3 / ms * 1e-9


def int_list(flag, default):
    if flag in sys.argv:
        i = sys.argv.index(flag)
        if i + 1 >= len(sys.argv):
            sys.exit(f"{flag} needs a comma-separated list of integers")
        return [int(x) for x in sys.argv[i + 1].split(",")]
    return default


def main():
    dims = int_list("--dims", [128, 64])
    totals = int_list("--tokens", [16384, 32768, 65536])
    divide = int_list("--divide", [1])[0]
    if divide < 1 or 512 % divide:
        sys.exit(f"--divide: expected a divisor of 512 (1, 2, 4, ..., 512), got {divide}")
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}, torch {torch.__version__}; varlen lengths {512 // divide}..{4096 // divide} cycling, "
          f"cuDNN seqlen {2048 // divide}")
    print(f"bf16 matmul 8192^3: {matmul_rate():.1f} TFLOP/s")
    from torch.nn.attention.varlen import varlen_attn
    from torch.nn.attention import sdpa_kernel, SDPBackend

    params = inspect.signature(varlen_attn).parameters
    print("varlen_attn signature:", inspect.signature(varlen_attn))
    print(f"{'impl':8} {'mask':5} {'d':7} {'tokens':6} {'fwd_ms':>10} {'fwd_TF':>10} {'bwd_ms':>10} {'bwd_TF':>10}")
    for d in dims:
        for causal in (True, False):
            for total in totals:
                heads = 2048 // d
                lens = varlen_lengths(total, divide)
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
                mx = max(lens)
                flops = fwd_flops(lens, heads, d, d, causal)
                q, k, v, do = (torch.rand(total, heads, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(4))
                kw = {}
                if "window_size" in params:
                    kw["window_size"] = (-1, 0) if causal else (-1, -1)
                elif causal:
                    kw["is_causal"] = True
                with torch.no_grad():
                    fwd = median_ms(lambda: varlen_attn(q, k, v, cu, cu, mx, mx, **kw))
                qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                out = varlen_attn(qg, kg, vg, cu, cu, mx, mx, **kw)
                bwd = median_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
                mask = "causal" if causal else "full"
                print(f"{'varlen':8} {mask:5} {d:<7} {total:<6} {fwd:10.3f} {flops / fwd * 1e-9:10.1f} {bwd:10.3f} "
                      f"{2.5 * flops / bwd * 1e-9:10.1f}", flush=True)
                # cuDNN on equal-length batches of 2048 / divide tokens.
                s = 2048 // divide
                b = total // s
                eq_flops = fwd_flops([s] * b, heads, d, d, causal)
                qs, ks, vs, dos = (torch.rand(b, heads, s, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(4))
                try:
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        with torch.no_grad():
                            fwd_c = median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal))
                        qg, kg, vg = (x.clone().requires_grad_() for x in (qs, ks, vs))
                        out_c = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        bwd_c = median_ms(lambda: torch.autograd.grad(out_c, (qg, kg, vg), dos, retain_graph=True))
                    print(f"{'cudnn':8} {mask:5} {d:<7} {total:<6} {fwd_c:10.3f} {eq_flops / fwd_c * 1e-9:10.1f} "
                          f"{bwd_c:10.3f} {2.5 * eq_flops / bwd_c * 1e-9:10.1f}", flush=True)
                except RuntimeError as e:
                    print(f"cudnn {mask} d{d} {total}: not run: {e}".splitlines()[0], flush=True)
                del q, k, v, do, qg, kg, vg, out, qs, ks, vs, dos
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
