#!/usr/bin/env python3
"""TransformerEngine's context parallelism timed the way bench_cp_nccl times cpgold's, one process per GPU:

    PYTHONPATH=python:$PYTHONPATH NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W bench/gpu/bench_te_cp.py --backend fused \
        [--comms p2p,a2a,all_gather] [--tokens-per-rank 8192,16384,32768] [--seq-scale 1,4] [--json FILE]

The batch is bench_cp_nccl's (bench/gpu/varlen_lengths.hpp): W x tokens-per-rank tokens of the length cycle 512,
1536, 2560, 3584, 1024, 3072, 2048, 4096 (times --seq-scale), the last sequence cut; causal, bf16, 16 query and KV
heads of dimension 128, no padding between sequences (cu_seqlens_padded = cu_seqlens). Each rank holds TE's
dual-chunk shard (tex.thd_get_partitioned_indices) and calls DotProductAttention (qkv_format "thd", attn_mask_type
"padding_causal") after set_context_parallel_group(group, ranks, stream, comm) as TE's CP tests do (a2a+p2p: [a2a
group of 2 consecutive ranks, p2p group]). The backend is what TE's variables select (--backend fused: FusedAttention;
flash: FlashAttention-3 or -4, whichever is on the path; the JSON names TE's choice).

Definitions as bench_cp_nccl's: a rep is forward + backward (and, separately, forward alone) timed by CUDA events
on the rank's current stream, ranks lined up by a barrier before each rep; the slowest rank of each rep, median over
--reps after --warmups. The reference is rank 0 alone running TE's non-CP DotProductAttention (same backend) over the
whole W-rank batch, divided by W; CP efficiency = reference / slowest. FLOPs: causal, 4 s^2/2 d h per sequence
forward, 3.5 times that forward + backward, divided by W.

Where the time goes (--profile, default on): one more forward + backward under torch.profiler on every rank; per
rank the GPU time of attention kernels, NCCL kernels and everything else (merges, copies, casts), and the time the
rank's GPU ran no compute kernel while the rep lasted (waiting for communication or the host); the slowest rank's
numbers are reported. NVLink multicast stays off: the script refuses to start without NCCL_NVLS_ENABLE=0.
"""
import argparse
import json
import os
import statistics
import sys
import time

from bench_torch import fwd_flops, varlen_lengths   # the benchmarks' batch and FLOPs (same folder)

BF16_DENSE_PEAK_TFLOPS = 989.0   # H100 / H200 SXM specification, per GPU
BACKENDS = {"fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
            "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}}


def causal_flops(lens, heads, dim, backward):
    """Forward FLOPs of the causal batch (bench_torch's), 3.5 times that for forward + backward."""
    f = fwd_flops(lens, heads, dim, dim, True)
    return 3.5 * f if backward else f


def kernel_class(name):
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("flash", "fmha", "sdpa", "cudnn", "fprop", "bprop", "dgrad", "attn", "attention",
                            "cutlass", "sm90_", "sm100_")):
        return "attention"
    return "other"


def union_ms(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


def profile_breakdown(torch, step):
    """One call of step() under torch.profiler: GPU ms per kernel class, the rep's GPU span, and the part of that
    span with no compute (non-NCCL) kernel running."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    spans = {"attention": [], "nccl": [], "other": []}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        a = e.start_ns() if hasattr(e, "start_ns") else e.start_us() * 1000
        d = e.duration_ns() if hasattr(e, "duration_ns") else e.duration_us() * 1000
        spans[kernel_class(e.name())].append((a, a + d))
    every = [x for v in spans.values() for x in v]
    if not every:
        return {}
    span = (max(b for _, b in every) - min(a for a, _ in every)) / 1e6
    compute = union_ms(spans["attention"] + spans["other"])
    out = {f"{k}_ms": sum(b - a for a, b in v) / 1e6 for k, v in spans.items()}
    out.update(span_ms=span, no_compute_ms=span - compute, kernels=len(every))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    ap.add_argument("--comms", default="p2p,a2a,all_gather", help="comma-separated: p2p, a2a, all_gather, a2a+p2p")
    ap.add_argument("--tokens-per-rank", default="8192,16384,32768")
    ap.add_argument("--seq-scale", default="1", help="comma-separated: 1 (sequences 512..4096), 4 (2048..16384), ...")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled rep of every configuration")
    ap.add_argument("--json", help="write every row here (rank 0)")
    args = ap.parse_args()
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        sys.exit("bench_te_cp: NCCL_NVLS_ENABLE=0 must be set (NVLink multicast stays off on these machines)")
    comms = [c for c in args.comms.split(",") if c]
    for c in comms:
        if c not in ("p2p", "a2a", "all_gather", "a2a+p2p"):
            sys.exit(f"bench_te_cp: --comms: unknown comm type {c!r}")
    tokens_list = [int(t) for t in args.tokens_per_rank.split(",") if t]
    scales = [int(x) for x in args.seq_scale.split(",") if x]
    if not scales or not all(1 <= x <= 64 for x in scales) or args.reps < 1 or args.warmups < 0:
        sys.exit("bench_te_cp: --seq-scale in 1..64, --reps >= 1, --warmups >= 0")
    os.environ.update(BACKENDS[args.backend])
    import torch
    import torch.distributed as dist
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    W, h, d = world, args.heads, args.dim
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    import types

    from cpgold.outsiders.te import backend_chosen, flash_attn_versions   # the package on PYTHONPATH (device_run.sh)
    te_modules = types.SimpleNamespace(te_dpa=te_dpa)

    def chosen():
        return backend_chosen(te_modules)

    header = {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
              "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "device": torch.cuda.get_device_name(0), "gpus": W, "backend_requested": args.backend,
              **flash_attn_versions(), "heads": h, "dim": d, "reps": args.reps, "warmups": args.warmups,
              "seq_scales": scales, "peak_tflops": BF16_DENSE_PEAK_TFLOPS}
    say("bench_te_cp: " + ", ".join(f"{k} {v}" for k, v in header.items()))
    # a2a+p2p groups: every process creates every group in the same order
    groups = {"all": dist.new_group(list(range(W)))}
    if "a2a+p2p" in comms:
        a = 2
        for s in range(0, W, a):
            groups[("a2a", s // a)] = dist.new_group(list(range(s, s + a)))
        for i in range(a):
            groups[("p2p", i)] = dist.new_group(list(range(i, W, a)))
    stream = torch.cuda.Stream()
    dt = torch.bfloat16

    def timed(step, reps, warmups, barrier=True):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for i in range(warmups + reps):
            if barrier:
                dist.barrier(group=groups["all"])
            torch.cuda.synchronize()
            a.record()
            step()
            b.record()
            b.synchronize()
            if i >= warmups:
                out.append(a.elapsed_time(b))
        return out

    def slowest_median(mine):
        every = [None] * W
        dist.all_gather_object(every, mine, group=groups["all"])
        return statistics.median(max(r[i] for r in every) for i in range(len(mine))), every

    rows = []
    for scale, tokens in ((sc, t) for sc in scales for t in tokens_list):
        lens = varlen_lengths(tokens * W, scale=scale)
        total = sum(lens)
        bad = [n for n in lens if n % (2 * W)]
        if bad:
            sys.exit(f"bench_te_cp: sequence lengths {bad[:4]} are not multiples of 2W = {2 * W}")
        cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device="cuda")
        mx = max(lens)
        g = torch.Generator(device="cuda").manual_seed(1234 + tokens)
        q, k, v, dout = (torch.randn(total, h, d, generator=g, device="cuda", dtype=torch.float32).to(dt)
                         for _ in range(4))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                  max_seqlen_q=mx, max_seqlen_kv=mx)

        def step_of(dpa, q, k, v, dout, backward):
            qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))

            def step():
                o = dpa(qq, kk, vv, **kw)
                if backward:
                    o.backward(dout.reshape(o.shape))
            return step

        # the reference: rank 0 alone, non-CP, the whole W-rank batch
        ref = [0.0, 0.0]
        ref_backend = None
        if rank == 0:
            dpa = te.DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal",
                                         attention_dropout=0.0)
            for b in (0, 1):
                ref[b] = statistics.median(timed(step_of(dpa, q, k, v, dout, b == 1), args.reps, args.warmups,
                                                 barrier=False)) / W
            ref_backend = chosen()
            del dpa
        box = [ref, ref_backend]
        dist.broadcast_object_list(box, src=0, group=groups["all"])
        ref, ref_backend = box
        flops = [causal_flops(lens, h, d, b == 1) / W for b in (0, 1)]
        # this rank's shard: TE's dual-chunk partition of the padded offsets
        idx = tex.thd_get_partitioned_indices(cu, total, W, rank)
        shard = [x.index_select(0, idx).contiguous() for x in (q, k, v, dout)]
        for comm in comms:
            if comm == "a2a+p2p" and (W < 4 or W % 2):
                continue
            entry = {"seq_scale": scale, "tokens_per_rank": tokens, "W": W, "comm": comm, "sequences": len(lens),
                     "reference_ms": {"fwd": ref[0], "fwd+bwd": ref[1]}, "reference_backend": ref_backend}
            try:
                dpa = te.DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal",
                                             attention_dropout=0.0)
                if comm == "a2a+p2p":
                    cp_group = [groups[("a2a", rank // 2)], groups[("p2p", rank % 2)]]
                else:
                    cp_group = groups["all"]
                dpa.set_context_parallel_group(cp_group, list(range(W)), stream, comm)
                for b, name in ((0, "fwd"), (1, "fwd+bwd")):
                    mine = timed(step_of(dpa, *shard, b == 1), args.reps, args.warmups)
                    slow, every = slowest_median(mine)
                    entry[name] = {"slowest_ms": slow, "rank_median_ms": [statistics.median(r) for r in every],
                                   "tflops_per_gpu": flops[b] / (slow * 1e-3) / 1e12,
                                   "efficiency": ref[b] / slow}
                entry["backend"] = chosen()
                if not args.no_profile:
                    mine = profile_breakdown(torch, step_of(dpa, *shard, True))
                    every = [None] * W
                    dist.all_gather_object(every, mine, group=groups["all"])
                    worst = max(range(W), key=lambda r: every[r].get("span_ms", 0))
                    entry["profile"] = {"rank": worst, **every[worst],
                                        "ranks_no_compute_ms": [e.get("no_compute_ms") for e in every]}
                del dpa
            except Exception as e:  # noqa: BLE001 - TE refuses or fails: recorded with its message
                entry["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}"
            rows.append(entry)
            if "fwd+bwd" in entry:
                fb, p = entry["fwd+bwd"], entry.get("profile", {})
                say(f"scale {scale} tokens/rank {tokens} W={W} {comm}: fwd+bwd slowest {fb['slowest_ms']:.3f} ms "
                    f"({fb['tflops_per_gpu']:.1f} TFLOP/s per GPU, {100 * fb['tflops_per_gpu'] / BF16_DENSE_PEAK_TFLOPS:.1f}% "
                    f"of peak), reference {ref[1]:.3f} ms, efficiency {fb['efficiency']:.2f}; fwd "
                    f"{entry['fwd']['slowest_ms']:.3f} ms eff {entry['fwd']['efficiency']:.2f}; {entry['backend']}"
                    + (f"; profiled rep (rank {p['rank']}): span {p['span_ms']:.3f} ms, attention "
                       f"{p['attention_ms']:.3f}, nccl {p['nccl_ms']:.3f}, other {p['other_ms']:.3f}, no compute "
                       f"{p['no_compute_ms']:.3f}" if p else ""))
            else:
                say(f"scale {scale} tokens/rank {tokens} W={W} {comm}: {entry.get('error')}")
        del q, k, v, dout, shard
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    dist.barrier(group=groups["all"])
    dist.destroy_process_group()


if __name__ == "__main__":
    t0 = time.time()
    main()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"bench_te_cp: {time.time() - t0:.1f} s", flush=True)
