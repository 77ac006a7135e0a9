#!/usr/bin/env python3
"""TransformerEngine's CP (bench_te_cp.py's JSON files) beside cpgold's (bench_cp_nccl's logs) on the same batches:
one markdown row per seq-scale, tokens per rank, W and comm type, forward + backward.

    python3 lab/gpu/cp_peer_table.py --te te_fused_w2.json te_fa3_w2.json ... --cpgold 1=cpgold_s1.log 4=cpgold_s4.log

Each implementation's CP efficiency is against its own one-GPU non-CP call over the W-rank batch, divided by W (the
definition of lab/records/perf.md's "gpu: NCCL CP efficiency"); the ms columns compare the two directly. TE's breakdown is
the profiled rep of the rank whose rep took longest (under torch.profiler, so slower than the timed reps): its GPU
span, the attention kernels' time, and the time within the span its GPU ran no compute kernel (waiting for NCCL or
the host).
"""
import argparse
import json
import re


def cpgold_rows(path):
    """{(tokens, W, comm): (slowest ms, TFLOP/s, efficiency, exchanges ms, exposed ms)} of the fwd+bwd rows."""
    out = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 13 or cells[3] != "fwd+bwd" or not cells[0].isdigit():
            continue
        if cells[1] in ("p2p", "a2a", "all_gather", "a2a+p2p"):
            out[(int(cells[0]), int(cells[2]), cells[1])] = (float(cells[4]), float(cells[5]), float(cells[7]),
                                                             cells[8], cells[9])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--te", nargs="+", required=True, help="bench_te_cp.py --json files")
    ap.add_argument("--cpgold", nargs="*", default=[], metavar="SCALE=LOG", help="bench_cp_nccl logs by seq-scale")
    args = ap.parse_args()
    cp = {}
    for item in args.cpgold:
        scale, _, path = item.partition("=")
        for k, v in cpgold_rows(path).items():
            cp[(int(scale),) + k] = v
    te = {}
    backends = []
    for path in args.te:
        data = json.load(open(path))
        name = re.sub(r" \(sub-backend \d+\)", "", next((r.get("backend") for r in data["rows"] if r.get("backend")),
                                                      data["header"]["backend_requested"]))
        if name not in backends:
            backends.append(name)
        for r in data["rows"]:
            te[(r["seq_scale"], r["tokens_per_rank"], r["W"], r["comm"], name)] = r
    keys = sorted({k[:4] for k in te}, key=lambda k: (k[0], k[2], k[1], ["p2p", "a2a", "all_gather", "a2a+p2p"].index(k[3])))
    head = ["scale", "tokens/rank", "W", "comm"]
    for b in backends:
        head += [f"TE {b} ms", "TFLOP/s", "eff.", "profiled: span / attention / no compute ms"]
    head += ["cpgold ms", "TFLOP/s", "eff.", "exchanges / exposed ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for k in keys:
        row = [str(k[0]), str(k[1]), str(k[2]), k[3]]
        for b in backends:
            r = te.get(k + (b,))
            if r is None or "fwd+bwd" not in r:
                row += [r.get("error", "-")[:40] if r else "-", "-", "-", "-"]
                continue
            fb, p = r["fwd+bwd"], r.get("profile", {})
            row += [f"{fb['slowest_ms']:.2f}", f"{fb['tflops_per_gpu']:.0f}", f"{fb['efficiency']:.2f}",
                    f"{p['span_ms']:.1f} / {p['attention_ms']:.1f} / {p['no_compute_ms']:.1f}" if p else "-"]
        c = cp.get(k)
        row += [f"{c[0]:.2f}", f"{c[1]:.0f}", f"{c[2]:.2f}", f"{c[3]} / {c[4]}"] if c else ["-"] * 4
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
