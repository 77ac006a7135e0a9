#!/usr/bin/env python3
"""Tables of one-process-per-GPU runs (cpgold.outsiders.ranks results.jsonl files) for lab/records/outsiders-nccl.md:
counts per suite and per comm type, and every failure and error with the class it falls in.

    python3 lab/outsiders/ranks_report.py TAG=results.jsonl [TAG=results.jsonl ...]
    python3 lab/outsiders/ranks_report.py --merged DIR [--drop-errors] TAG=results.jsonl ...

--merged DIR writes each TAG's merged lines to DIR/TAG/results.jsonl instead of the tables: the folder
`device_run.sh ranks` goes on from (RANKS_RESUME=1, RANKS_SEED=DIR); --drop-errors leaves the errors out, so that
they run again.

Several files of one TAG are merged (a run resumed on another machine): the entry of the last file wins.
Classes, from the case and the result alone (each one's evidence is in docs/te-findings.md and
lab/records/outsiders-flash.md):
  finding 1      all_gather with a window bounded on both sides (TE's per-chunk calls are top-left aligned)
  finding 4      p2p with rows after the last sequence: device-side assert (an error, the processes stop)
  pad rows       the FlashAttention path leaves pad rows unwritten; valid rows pass (a convention, not a defect)
  FA-1           NaN or inf in pad rows reaches valid rows through FlashAttention-3/4
  d256 grads     TE FusedAttention CP, head dim 256 with GQA: gradients wrong in head dims 128-255
  finding 2      p2p / a2a+p2p whose diagnosis is `merge` (a step with queries and none of their keys)
  finding 3      GQA, O and dQ pass, dK or dV fail (keys of a sequence or step without queries)
  harness: ...   the torch reference raised on a rank holding no valid row (fixed in torch_cp.py since run N2)
  FA4 CP         TE CP with FlashAttention-4, finite pads: valid rows wrong
  refusal ...    every rank raised an AssertionError of the library (a refusal in substance)
  unattributed   none of the above
"""
import collections
import json
import sys


def load(items):
    runs = collections.OrderedDict()
    cases = {}
    for item in items:
        tag, _, path = item.partition("=")
        run = runs.setdefault(tag, {})
        for line in open(path):
            e = json.loads(line)
            run[(e["suite"], e["fixture"])] = e
            if e.get("case"):
                cases[(e["suite"], e["fixture"])] = e
    for run in runs.values():   # an entry without its case (the processes died in it) takes it from another run
        for key, e in run.items():
            if not e.get("case") and key in cases:
                for k in ("case", "comm", "cp_size", "mask_class", "pad_fill", "dtype"):
                    e.setdefault(k, cases[key].get(k))
    return runs


def klass(tag, e):
    case = e.get("case") or {}
    status = e["status"]
    comm = e.get("comm") or case.get("comm")
    window = case.get("window") or [-1, -1]
    tail = case and case.get("total_tokens_q", 0) > sum(case.get("padded_q") or [0])
    if status == "error":
        if comm == "p2p" and (tail or "device-side assert" in e.get("reason", "") or "ended while" in e.get("reason", "")):
            return "finding 4 (device-side assert)"
        if "AssertionError" in e.get("reason", ""):
            return "refusal raised as an error"
        if tag.startswith("torch") and "does not require grad" in e.get("reason", ""):
            return "harness: a rank with no valid row (fixed since)"
        return "unattributed error"
    if status != "fail":
        return None
    if e.get("valid_rows_pass"):
        return "pad rows unwritten (valid rows pass)"
    if comm == "all_gather" and case.get("mask") == "none" and window[0] >= 0 and window[1] > 0:
        return "finding 1"
    flash = "fa3" in tag or "fa4" in tag
    if flash and case.get("pad_fill") in ("nan", "inf") and "nonfinite_leak" in (e.get("diagnosis") or []):
        return "FA-1 (non-finite pads)"
    if case.get("dim_qk") == 256 and case.get("heads_q") != case.get("heads_kv"):
        return "d256 grads"
    if "fa4" in tag:
        return "FA4 CP"
    worst = e.get("worst") or {}
    if comm in ("p2p", "a2a+p2p") and "merge" in (e.get("diagnosis") or []):
        return "finding 2"
    if (case.get("heads_q", 1) > case.get("heads_kv", case.get("heads_q", 1)) and worst.get("o", 0) <= 1
            and worst.get("dq", 0) <= 1 and max(worst.get("dk", 0), worst.get("dv", 0)) > 1):
        return "finding 3"
    return "unattributed"


def write_merged(runs, folder, drop_errors):
    import os
    for tag, run in runs.items():
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        kept = [e for e in run.values() if not (drop_errors and e["status"] == "error")]
        with open(os.path.join(folder, tag, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in kept)
        print(f"{tag}: {len(kept)} of {len(run)} fixtures -> {os.path.join(folder, tag, 'results.jsonl')}")


def main(argv):
    if argv[:1] == ["--merged"]:
        drop = "--drop-errors" in argv
        items = [a for a in argv[2:] if a != "--drop-errors"]
        return write_merged(load(items), argv[1], drop)
    runs = load(argv)
    statuses = ("pass", "fail", "error", "unsupported", "empty")
    print("| run | " + " | ".join(statuses) + " | skipped (another W) | classes of the failures and errors |")
    print("|---|" + "---|" * (len(statuses) + 2))
    for tag, run in runs.items():
        c = collections.Counter(e["status"] for e in run.values())
        k = collections.Counter(klass(tag, e) for e in run.values())
        k.pop(None, None)
        print(f"| {tag} | " + " | ".join(str(c.get(s, 0)) for s in statuses) + f" | {c.get('skipped', 0)} | "
              + "; ".join(f"{n} {v}" for v, n in k.most_common()) + " |")
    print()
    for tag, run in runs.items():
        by = collections.defaultdict(collections.Counter)
        for e in run.values():
            if e["status"] != "skipped":
                by[(e.get("comm") or "-", e.get("suite"))][e["status"]] += 1
        print(f"**{tag}** per comm type and suite (pass/fail/error/unsupported): " + "; ".join(
            f"{comm} {suite} {v['pass']}/{v['fail']}/{v['error']}/{v['unsupported']}"
            for (comm, suite), v in sorted(by.items())))
        print()
    print("| run | fixture | comm | W | class | worst o / dq / dk / dv | diagnosis |")
    print("|---|---|---|---|---|---|---|")
    for tag, run in runs.items():
        for (suite, name), e in sorted(run.items()):
            k = klass(tag, e)
            if k is None or k.startswith("pad rows"):
                continue
            w = e.get("worst") or {}
            cells = " / ".join(f"{w[t]:.3g}" if t in w else "-" for t in ("o", "dq", "dk", "dv"))
            diag = ", ".join(e.get("diagnosis") or []) or (e.get("reason") or "")[:60].replace("|", "/")
            print(f"| {tag} | `{suite}/{name}` | {e.get('comm')} | {e.get('cp_size')} | {k} | {cells} | {diag} |")


if __name__ == "__main__":
    main(sys.argv[1:])
