#!/usr/bin/env python3
"""TransformerEngine's recorded attention calls against cpgold's replay of TE: which CP failures are TE's.

    python3 lab/te/compare_te_calls.py --cpgold build/bin/cpgold te_cp_attrib.json [--json out.json]

Input: a summary of `python3 -m cpgold.outsiders te_cp --set trace=1` (every fused_attn_fwd/bwd call per rank: the arguments the
kernel received and where the q and k rows it reads as tokens come from). For every traced fixture this runs
`cpgold explain --case <the fixture's case> --te-audit --format json` (runs anywhere, no GPU) and compares, rank by
rank and call by call (forward calls in order, backward calls in order), TE's recorded arguments with the replay's
cuDNN calls: max_seqlen_q/kv, cu_seqlens_q/kv, cu_seqlens_q/kv_padded, attn_mask_type. It also checks that every
K/V row a call reads as a token came from the rank the replay names (kv_owner; all ranks for all_gather and a2a,
whose calls read gathered or exchanged rows) and that no call reads a padding row as a token.

Verdicts per fixture:
  replay-matches, audit-inexact   TE's real arguments are the replay's, and the audit finds pairs TE computes
                                  wrongly: the failure is TE's (its arguments), whatever the communication does;
  replay-matches, audit-exact     TE's arguments are right and the data arrived where it should: the failure lies
                                  after the kernels (merging the steps, the gradients' return trip) or in the numbers;
  replay-differs                  TE did something the replay does not model (the first difference is printed);
  rows-wrong                      a call read rows from a rank other than the one TE's schedule names: data moved
                                  wrongly (the communication, TE's or the thread ranks').
"""
import argparse
import json
import subprocess
import sys

FIELDS = ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
          "cu_seqlens_kv_padded", "attn_mask_type")


def load(path):
    if path.endswith(".jsonl"):
        return [json.loads(x) for x in open(path) if x.strip()]
    return json.load(open(path))["fixtures"]


def traced_calls(entry):
    """The per-rank calls of a traced fixture (`python3 -m cpgold.outsiders te_cp --set trace=1` keeps them in
    the entry's notes)."""
    return entry.get("calls") or entry.get("notes", {}).get("calls", {})


def replay(cpgold, case):
    p = subprocess.run([cpgold, "explain", "--case", json.dumps(case), "--te-audit", "--format", "json"],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"explain exit {p.returncode}: {p.stderr.strip()[:300]}")
    return json.loads(p.stdout)["te_audit"]


def compare_fixture(entry, cpgold):
    audit = replay(cpgold, entry["case"])
    fused = next((r for r in audit["replays"] if r["backend"] == "fused"), None)
    out = {"fixture": f"{entry['suite']}/{entry['fixture']}", "comm": entry["comm"], "cp_size": entry["cp_size"],
           "status": entry["status"], "audit_exact": audit["exact"], "differences": [], "row_problems": [],
           "calls": 0}
    if fused is None or fused.get("refusal"):
        out["verdict"] = "replay-refuses"
        out["refusal"] = (fused or {}).get("refusal")
        return out
    out["wrong_pairs"] = sum(c.get("wrong_pairs", 0) for p in ("forward", "backward") for c in fused["calls"][p])
    for rank, calls in sorted(traced_calls(entry).items(), key=lambda kv: int(kv[0])):
        r = int(rank)
        for pas in ("forward", "backward"):
            got = [c for c in calls if c["pass"] == pas]
            want = [c for c in fused["calls"][pas] if c["rank"] == r]
            if len(got) != len(want):
                out["differences"].append(f"rank {r} {pas}: TE made {len(got)} calls, the replay {len(want)}")
                continue
            for i, (g, w) in enumerate(zip(got, want)):
                out["calls"] += 1
                for f in FIELDS:
                    if f in w and g.get(f) != w[f]:
                        out["differences"].append(f"rank {r} {pas} call {i} (step {w['step']}, {w.get('section')}): "
                                                  f"{f} TE {g.get(f)} replay {w[f]}")
                rows = g.get("k_rows")
                if not isinstance(rows, dict):
                    continue
                owners = set(rows["from_rank"])
                if entry["comm"] in ("p2p", "a2a+p2p") and "kv_owner" in w and entry["comm"] == "p2p":
                    if owners - {str(w["kv_owner"])}:
                        out["row_problems"].append(f"rank {r} {pas} call {i}: K rows from ranks {sorted(owners)}, "
                                                   f"the schedule names rank {w['kv_owner']}")
                if rows["pad_rows"] or rows["unknown"]:
                    out["row_problems"].append(f"rank {r} {pas} call {i}: {rows['pad_rows']} padding rows and "
                                               f"{rows['unknown']} rows of no input read as tokens")
    if out["row_problems"]:
        out["verdict"] = "rows-wrong"
    elif out["differences"]:
        out["verdict"] = "replay-differs"
    else:
        out["verdict"] = "replay-matches, audit-" + ("exact" if audit["exact"] else "inexact")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary")
    ap.add_argument("--cpgold", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    for e in load(args.summary):
        if not traced_calls(e):
            if e.get("status") in ("fail", "error"):
                results.append({"fixture": f"{e['suite']}/{e['fixture']}", "comm": e.get("comm"),
                                "cp_size": e.get("cp_size"), "status": e["status"], "verdict": "not-traced",
                                "reason": e.get("reason", "")[:200]})
            continue
        results.append(compare_fixture(e, args.cpgold))
    for x in results:
        line = f"{x['fixture']:48} {str(x.get('comm')):10} W={x.get('cp_size')} {x['status']:5} {x['verdict']}"
        if "calls" in x:
            line += f" ({x['calls']} calls compared, audit wrong pairs {x.get('wrong_pairs', '-')})"
        print(line)
        for d in (x.get("differences", []) + x.get("row_problems", []))[:3]:
            print(f"    {d}")
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
