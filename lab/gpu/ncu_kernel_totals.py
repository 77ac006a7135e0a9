#!/usr/bin/env python3
"""Per-kernel totals of an Nsight Compute CSV (ncu --csv --metrics gpu__time_duration.sum,...): for every kernel
function, the number of launches, the summed duration and the duration-weighted mean of every other metric.
Usage: ncu_kernel_totals.py FILE.csv [LABEL]. Prints one markdown table, kernels by total time."""
import csv
import re
import sys
from collections import defaultdict

TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def short(name):
    """cpgold::gpu::detail::f<__nv_bfloat16, 128, 128, true>(AttentionParams) -> f<__nv_bfloat16,128,128,true>"""
    name = re.sub(r"\(.*$", "", name)
    base = re.sub(r"<.*$", "", name).split("::")[-1]
    args = re.search(r"<(.*)>", name)
    if args:
        base += "<" + ",".join(a.strip().split("::")[-1] for a in args.group(1).split(",")) + ">"
    return base


def main():
    path = sys.argv[1]
    label = sys.argv[2] if len(sys.argv) > 2 else path
    launches = defaultdict(dict)  # launch ID -> {"kernel": name, metric: value}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV
    for r in csv.DictReader(lines):
        rec = launches[r["ID"]]
        rec["kernel"] = short(r["Kernel Name"])
        try:
            value = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        if r["Metric Name"] == "gpu__time_duration.sum":
            value *= TO_US.get(r.get("Metric Unit", "ns"), 1e-3)  # -> microseconds
        rec[r["Metric Name"]] = value
    totals = defaultdict(lambda: {"n": 0, "us": 0.0, "weighted": defaultdict(float)})
    metrics = set()
    for rec in launches.values():
        us = rec.get("gpu__time_duration.sum", 0.0)
        t = totals[rec["kernel"]]
        t["n"] += 1
        t["us"] += us
        for m, v in rec.items():
            if m not in ("kernel", "gpu__time_duration.sum"):
                metrics.add(m)
                t["weighted"][m] += v * us
    metrics = sorted(metrics)
    grand = sum(t["us"] for t in totals.values()) or 1.0
    print(f"\n{label}: {len(launches)} launches, {grand / 1e3:.3f} ms of kernel time (each kernel alone)")
    print("| kernel | launches | ms | share | " + " | ".join(metrics) + " |")
    print("|---|---|---|---|" + "---|" * len(metrics))
    for k, t in sorted(totals.items(), key=lambda kv: -kv[1]["us"]):
        cells = [f"{t['weighted'][m] / t['us']:.1f}" if t["us"] > 0 else "-" for m in metrics]
        print(f"| {k} | {t['n']} | {t['us'] / 1e3:.3f} | {100 * t['us'] / grand:.1f}% | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
