#!/usr/bin/env python3
"""Markdown tables of kernel sweep summaries (kernel_sweep.py JSON): verdict counts per suite, and per tensor and
level the distribution of error/limit from the check reports.

    python3 python/examples/summary_table.py varlen.json cudnn.json
"""
import json
import sys


def main(paths):
    summaries = [json.load(open(p)) for p in paths]
    print("| kernel | suite | pass | fail | error | not expressible |\n|---|---|---|---|---|---|")
    for s in summaries:
        for suite, c in s["counts"].items():
            print(f"| {s['kernel']} | {suite} | {c['pass']} | {c['fail']} | {c['error']} | {c['unsupported']} |")
    print("\n| kernel | tensor / level | results | max/limit median | p99 | max | mean/limit median | p99 | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        for key, d in s["distributions"].items():
            a, b = d["max_ratio"], d["mean_ratio"]
            print(f"| {s['kernel']} | {key} | {a['n']} | {a['median']:.3f} | {a['p99']:.3f} | {a['max']:.3f} | "
                  f"{b['median']:.3f} | {b['p99']:.3f} | {b['max']:.3f} |")
    for s in summaries:
        for e in s["fixtures"]:
            if e["status"] in ("fail", "error"):
                print(f"\n{s['kernel']} {e['suite']}/{e['fixture']}: {e['status']}"
                      + (f" ({e['reason'][:200]})" if e.get("reason") else ""))
                for line in e.get("failures", []):
                    print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
