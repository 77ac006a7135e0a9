#!/usr/bin/env python3
"""FA-3: FlashAttention-4 reads TransformerEngine's causal window (-1, 0) as a window that admits no key, so TE with
FlashAttention-4 returns zeros for causal attention; torch and the library alone
(docs/findings/fa-3-causal-window-minus-one.md).

    python3 fa3_causal_window_minus_one.py [--route direct|te]

--route direct (default; torch and flash-attn-4): flash_attn.cute.flash_attn_varlen_func on a causal varlen batch,
called three ways: causal=True with window_size (None, None) (FlashAttention-4's own "unbounded"), (-1, 0) (what
TE passes for a causal mask) and (-1, -1). The finding reproduces when (-1, 0) is wrong while (None, None) is right.

--route te (torch, TransformerEngine and flash-attn-4, without flash-attn-3 on the path): TE's DotProductAttention,
THD, attn_mask_type padding_causal, with NVTE_FLASH_ATTN=1 NVTE_FUSED_ATTN=0 NVTE_UNFUSED_ATTN=0, forward and
backward. TE must report that it ran FlashAttention 4 (it prefers FlashAttention-3 when that is installed).

Batches (bf16, no padding): sequences of 2 and 4 tokens with 1 head of dim 32 (the smallest case, found by
`cpgold shrink`), and sequences of 16 and 32 tokens with 2 heads of dim 64. Expected: every valid row within a few
bf16 ulps of a plain causal attention in float64 on the CPU (in _common.py). Exit 1 when the finding reproduces,
0 when it does not, 2 when it cannot run (library missing, no GPU, TE not on FlashAttention-4, or the baseline
(None, None) call already wrong).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import causal_reference as reference, offsets  # noqa: E402 - after the path

LIMIT_ULPS = 32
BATCHES = {"smallest": dict(lengths=[2, 4], heads=1, dim=32), "n2_repro": dict(lengths=[16, 32], heads=2, dim=64)}


def make_batch(torch, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(batch["lengths"])
    x = {n: torch.randn(total, batch["heads"], batch["dim"], generator=g) for n in ("q", "k", "v", "dout")}
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    off = offsets(batch["lengths"])
    want = {n: torch.zeros(total, batch["heads"], batch["dim"], dtype=torch.float64) for n in ("o", "dq", "dk", "dv")}
    for b, n in enumerate(batch["lengths"]):
        s = slice(off[b], off[b] + n)
        r = reference(*(x[t][s].double() for t in ("q", "k", "v", "dout")), batch["dim"] ** -0.5)
        for t in want:
            want[t][s] = r[t]
    return x, want


def judge(got, want, names):
    """{tensor: worst error in bf16 ulps of the reference's largest magnitude}, rows of O that are all zero, and O's
    first row of sequence 0 (head 0, first 4 dims)."""
    ulps = {}
    for t in names:
        e = float((got[t] - want[t]).abs().nan_to_num(float("inf")).max())
        ulps[t] = e / (max(float(want[t].abs().max()), 1e-30) * 2.0 ** -8)
    zero_rows = int((got["o"].flatten(1) == 0).all(dim=1).sum())
    return ulps, zero_rows, [round(float(v), 4) for v in got["o"][0, 0, :4]]


def direct(torch, batch, device):
    from flash_attn.cute import flash_attn_varlen_func
    x, want = make_batch(torch, batch)
    cu = torch.tensor(offsets(batch["lengths"]), dtype=torch.int32, device=device)
    m = max(batch["lengths"])
    lines, verdicts = [], {}
    for window in ((None, None), (-1, 0), (-1, -1)):
        out = flash_attn_varlen_func(*(x[n].to(device) for n in ("q", "k", "v")), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=m, max_seqlen_k=m, softmax_scale=batch["dim"] ** -0.5, causal=True,
                                     window_size=window)
        out = out[0] if isinstance(out, (tuple, list)) else out
        ulps, zero_rows, row0 = judge({"o": out.detach().double().cpu()}, want, ("o",))
        verdicts[window] = ulps["o"] <= LIMIT_ULPS
        lines.append(f"  causal=True, window_size={str(window):12}: O worst {ulps['o']:9.1f} ulps, "
                     f"{zero_rows} of {out.shape[0]} rows all zero; sequence 0 row 0 head 0: {row0}"
                     + ("" if verdicts[window] else "   <-- wrong"))
    ref_row0 = [round(float(v), 4) for v in want["o"][0, 0, :4]]
    return lines + [f"  reference sequence 0 row 0 head 0: {ref_row0}"], verdicts


def through_te(torch, batch):
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa
    x, want = make_batch(torch, batch)
    cu = torch.tensor(offsets(batch["lengths"]), dtype=torch.int32, device="cuda")
    h, d = batch["heads"], batch["dim"]
    dpa = te.DotProductAttention(h, d, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal",
                                 softmax_scale=d ** -0.5)
    q, k, v = (x[n].cuda().requires_grad_() for n in ("q", "k", "v"))
    o = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    o.backward(x["dout"].cuda().reshape(o.shape))
    torch.cuda.synchronize()
    b = te_dpa._attention_backends
    backend = (f"FlashAttention ({b.get('flash_attention_backend')})" if b.get("use_flash_attention") else
               f"FusedAttention (sub-backend {int(b['fused_attention_backend'])})" if b.get("use_fused_attention")
               else "other")
    got = {"o": o.detach().view(-1, h, d).double().cpu(), "dq": q.grad.double().cpu(), "dk": k.grad.double().cpu(),
           "dv": v.grad.double().cpu()}
    ulps, zero_rows, row0 = judge(got, want, ("o", "dq", "dk", "dv"))
    return backend, ulps, zero_rows, row0, [round(float(v), 4) for v in want["o"][0, 0, :4]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--route", choices=("direct", "te"), default="direct")
    ap.add_argument("--device", default="cuda", help="where the library runs (default cuda; --route te: cuda only)")
    a = ap.parse_args()
    if a.route == "te":
        os.environ.update(NVTE_FLASH_ATTN="1", NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="0")
    try:
        import torch
        from importlib.metadata import version
        fa4 = version("flash-attn-4")
        import flash_attn.cute
        if a.route == "te":
            import transformer_engine
    except Exception as e:  # noqa: BLE001 - ImportError or PackageNotFoundError: the route cannot run here
        print(f"cannot run: {type(e).__name__}: {e}")
        return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("cannot run: no GPU visible")
        return 2
    try:
        dsl = version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - recorded as missing
        dsl = "not installed"
    info = {"flash-attn-4": fa4, "flash_attn.cute": flash_attn.cute.__file__, "nvidia-cutlass-dsl": dsl,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device}
    if a.route == "te":
        info["transformer_engine"] = transformer_engine.__version__
        try:
            info["flash-attn-3"] = version("flash-attn-3")
        except Exception:  # noqa: BLE001 - the route wants it absent
            info["flash-attn-3"] = "not installed"
    print(f"FA-3, route {a.route}: causal attention, bf16, no padding; wrong above {LIMIT_ULPS} bf16 ulps")
    print("versions: " + json.dumps(info))
    reproduced = 0
    for name, batch in BATCHES.items():
        print(f"{name}: lengths {batch['lengths']}, {batch['heads']} head(s) of dim {batch['dim']}")
        if a.route == "direct":
            lines, ok = direct(torch, batch, torch.device(a.device))
            print("\n".join(lines))
            if not ok[(None, None)]:
                print("cannot run: the baseline window_size (None, None) is already wrong: not this finding")
                return 2
            reproduced += not ok[(-1, 0)]
        else:
            backend, ulps, zero_rows, row0, ref0 = through_te(torch, batch)
            print(f"  TE ran {backend}; worst errors in bf16 ulps {({t: round(u, 1) for t, u in ulps.items()})}, "
                  f"{zero_rows} rows of O all zero; sequence 0 row 0 head 0: observed {row0}, expected {ref0}")
            if "FlashAttention (4" not in backend:
                print(f"cannot run: TE ran {backend}, not FlashAttention 4 (flash-attn-3 on the path?)")
                return 2
            reproduced += not all(u <= LIMIT_ULPS for u in ulps.values())
    print(f"batches where the finding reproduces: {reproduced} of {len(BATCHES)}")
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
