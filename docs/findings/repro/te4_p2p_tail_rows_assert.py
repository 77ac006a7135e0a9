#!/usr/bin/env python3
"""TE-4: TransformerEngine's p2p context-parallel backward dies with a device-side assert when the THD buffer has rows
after the last sequence, with torch and TransformerEngine alone (docs/findings/te-4-p2p-tail-rows-assert.md).

    python3 te4_p2p_tail_rows_assert.py [--blocking] [--timeout S]      2 GPUs: the CP forward and backward
    python3 te4_p2p_tail_rows_assert.py --helper                        no CP: TE's helper on the same metadata

CP (2 GPUs): one sequence of 3 tokens, padded to 4 rows, in a THD buffer of 8 rows (4 rows after the last sequence,
which TE allows), causal, 2 heads of dim 64, bf16, cuDNN FusedAttention, cp_comm_type p2p on 2 ranks, one process
per GPU over NCCL. Each process holds its rank's rows (tex.thd_get_partitioned_indices) and the global cu_seqlens.
Expected: forward and backward end, and O, dQ, dK, dV of the 3 tokens match a plain causal attention in float64 on
the CPU (in _common.py). --blocking sets CUDA_LAUNCH_BLOCKING=1, so that the traceback names the failing line.

--helper (no CP, no kernel): calls TE's own get_thd_padding_mask (the function the p2p backward calls through
_zero_thd_padding) with rank 0's backward metadata of the CP case: 4 local rows, cu_seqlens [0, 1] (rank 0's valid
rows of the sequence), cu_seqlens_padded [0, 2]. Expected: a mask, rows 1 to 3 padding. CPU tensors, so an index out
of bounds is an IndexError rather than a device-side assert.

Exit 1 when TE dies or raises (the finding), or returns wrong values; 0 when it runs and is right; 2 when it cannot run.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - after the path
    causal_reference as reference, cp_launcher_start, cu_seqlens, rank_start, run_ranks, versions)

WORLD = 2
CASE = dict(seqlens=[3], padded=[4], rows=8, heads=2, dim=64)
LIMIT_ULPS = 32
CRASH_WORDS = ("device-side assert", "out of bounds", "cudaErrorAssert", "error code: 710")


def make_inputs(seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(CASE["rows"], CASE["heads"], CASE["dim"], generator=g) for n in ("q", "k", "v", "dout")}
    for t in x.values():
        t[CASE["seqlens"][0]:] = 0   # pad and tail rows
    return {n: t.to(torch.bfloat16) for n, t in x.items()}


def rank_main():
    import torch
    import torch.distributed as dist
    rank, world = rank_start()
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    x = make_inputs()
    dev = torch.device("cuda", rank)
    cu = cu_seqlens(torch, dev, CASE["seqlens"], CASE["seqlens"], CASE["padded"], CASE["padded"])
    idx = tex.thd_get_partitioned_indices(cu["cu_seqlens_q_padded"], CASE["rows"], world, rank).long().cpu()
    h, d = CASE["heads"], CASE["dim"]
    report = {"rank": rank, "rows": idx.tolist(),
              "versions": versions(torch, transformer_engine, te, torch_cudnn=False)}
    print("START " + json.dumps(report), flush=True)   # the versions, even if the backward kills the process
    dpa = te.DotProductAttention(h, d, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal",
                                 softmax_scale=d ** -0.5)
    dpa.set_context_parallel_group(dist.new_group(list(range(world))), list(range(world)), torch.cuda.Stream(), "p2p")
    q, k, v = (x[n][idx].to(dev).requires_grad_() for n in ("q", "k", "v"))
    stage = "forward"
    try:
        o = dpa(q, k, v, **cu)
        torch.cuda.synchronize()
        stage = "backward"
        o.backward(x["dout"][idx].to(dev).reshape(o.shape))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the finding: report it and leave without touching the CUDA context again
        print("RESULT " + json.dumps({"rank": rank, "stage": stage, "error": f"{type(e).__name__}: {e}"[:600]}),
              flush=True)
        os._exit(3)
    n = CASE["seqlens"][0]
    want = reference(*(x[t][:n].double() for t in ("q", "k", "v", "dout")), d ** -0.5)
    got = {"o": o.detach().view(-1, h, d).double().cpu(), "dq": q.grad.double().cpu(), "dk": k.grad.double().cpu(),
           "dv": v.grad.double().cpu()}
    errs = {}
    for name, g in got.items():
        rows = [(local, row) for local, row in enumerate(idx.tolist()) if row < n]
        e = max((float((g[local] - want[name][row]).abs().nan_to_num(float("inf")).max()) for local, row in rows),
                default=0.0)
        errs[name] = e / (max(float(want[name].abs().max()), 1e-30) * 2.0 ** -8)
    print("RESULT " + json.dumps({"rank": rank, "stage": "done", "ulps": errs}), flush=True)
    dist.destroy_process_group()


def helper_main():
    import torch
    import transformer_engine
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils
    print(f"TE-4 --helper: transformer_engine {transformer_engine.__version__}, torch {torch.__version__}: "
          "get_thd_padding_mask(4, cu_seqlens=[0, 1], cu_seqlens_padded=[0, 2]) on the CPU")
    print("expected: [False, True, True, True] (row 0 the token rank 0 holds, row 1 its pad row, rows 2-3 after the "
          "last sequence)")
    try:
        mask = dpa_utils.get_thd_padding_mask(4, torch.tensor([0, 1]), torch.tensor([0, 2]))
    except Exception as e:  # noqa: BLE001 - the finding
        print(f"observed: {type(e).__name__}: {e}")
        return 1
    print(f"observed: {mask.tolist()}")
    return 0 if mask.tolist() == [False, True, True, True] else 1


def launch(timeout, blocking):
    return run_ranks(__file__, [], WORLD, timeout, {"CUDA_LAUNCH_BLOCKING": "1"} if blocking else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--helper", action="store_true", help="no CP: TE's get_thd_padding_mask on rank 0's metadata")
    ap.add_argument("--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 in the ranks")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds the CP run may take (default 180)")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    done, libs = cp_launcher_start(a.rank_worker, rank_main)
    if done is not None:
        return done
    torch, _ = libs
    if a.helper:
        return helper_main()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < WORLD:
        print(f"cannot run: {WORLD} GPUs needed for the CP part, {gpus} visible (--helper needs none)")
        return 2
    print(f"TE-4: TransformerEngine CP p2p with {WORLD} ranks (one process per GPU, NCCL), cuDNN FusedAttention, "
          f"causal; {CASE['seqlens'][0]} tokens padded to {CASE['padded'][0]} rows in a buffer of {CASE['rows']} rows"
          + (", CUDA_LAUNCH_BLOCKING=1" if a.blocking else ""))
    outs = launch(a.timeout, a.blocking)
    crashed = wrong = started = 0
    for r, (code, out, err) in enumerate(outs):
        start = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("START ")]
        result = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
        if start:
            started += 1
            if r == 0:
                print("versions: " + json.dumps(start[0]["versions"]))
            print(f"rank {r}: holds global rows {start[0]['rows']}")
        said = [ln for ln in err.splitlines() if any(w in ln for w in CRASH_WORDS)]
        where = [ln.strip() for ln in err.splitlines() if "utils.py" in ln or "context_parallel.py" in ln][-2:]
        if result and result[-1]["stage"] == "done":
            bad = {t: u for t, u in result[-1]["ulps"].items() if not u <= LIMIT_ULPS}
            wrong += bool(bad)
            print(f"rank {r}: forward and backward ended; worst errors in bf16 ulps "
                  f"{ {t: round(u, 1) for t, u in result[-1]['ulps'].items()} }"
                  + (f"  <-- wrong: {bad}" if bad else ""))
        else:
            crashed += 1
            what = (result[-1]["error"] if result else
                    f"exit {code}" + (" (killed at the timeout)" if code == -9 else ""))
            stage = result[-1]["stage"] if result else "unknown stage"
            print(f"rank {r}: died in the {stage}: {what[:300]}")
            for ln in (said[:2] + where):
                print(f"    {ln[:240]}")
    if not started:
        tail = [ln for ln in outs[0][2].strip().splitlines() if ln.strip()][-3:]
        print("cannot run: no rank got as far as TE's call: " + " | ".join(tail)[-400:])
        return 2
    print("expected: every rank ends, O, dQ, dK, dV of the tokens right; "
          f"observed: {crashed} rank(s) died, {wrong} rank(s) with wrong values")
    return 1 if crashed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
