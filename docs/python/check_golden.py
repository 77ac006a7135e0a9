#!/usr/bin/python3
"""Checks cpgold fixtures against a float64 oracle recomputed here in numpy, independently of cpgold's C++ code.

    /usr/bin/python3 docs/python/check_golden.py fixtures/data/golden            # every *.h5 of a folder (+ MANIFEST.json)
    /usr/bin/python3 docs/python/check_golden.py a.h5 b.h5                  # single fixtures

Needs h5py and numpy only (Debian: python3-h5py, python3-numpy). For every fixture it
  1. recomputes O, LSE (forward) and dQ, dK, dV (backward) in float64 from /inputs, with masks from the global
     positions inside each sequence (bottom-right alignment delta = L_kv - L_q, windows, GQA), and checks /golden/*
     against it (relative 1e-6: the goldens are the float32 rounding of such an oracle);
  2. checks the exact classes: pad and tail rows of O/dQ/dK/dV exactly 0, the set of valid rows with LSE -inf equal
     to the oracle's, pad rows of the golden LSE -inf;
  3. checks that /ranks/<r>/* are the global tensors gathered with /layout/partitioned_indices_*, bit for bit;
  4. checks /case schema_version (2) and recomputes the CP budget attributes of /golden/* from /peer/* and this
     oracle with the rule of fixtures/SCHEMA.md version 2 (atol = max(k * ulp_p(0.3 + max|x|), FlashAttention's
     rounding floor), k = 2 in bf16/fp16 and 8 in float32; peer max/mean errors; max budget = rtol * max + atol;
     mean budget = max(1.5 * mean + atol / 8, max budget / sqrt(n)));
  5. the /case attribute inputs_sha256: the SHA-256 of the raw bytes of /inputs/q, k, v, dout one after the other;
  6. with a folder holding MANIFEST.json: the SHA-256 of every dataset's raw bytes against the manifest.
Exit 0 if everything holds, 1 otherwise (one line per problem); a missing h5py is an ImportError (exit 1).
"""
import hashlib
import json
import math
import os
import sys

import h5py
import numpy as np

REL = 1e-6  # float32 storage of a float64 value: relative error <= 2^-24
SCHEMA_VERSION = 2  # fixtures/SCHEMA.md: the budget rule below belongs to this version


def case_of(f):
    return json.loads(f["case"].attrs["case_json"])


def read(f, path):
    return np.asarray(f[path][()], dtype=np.float64)


def visible(lq, lkv, window, causal):
    """[lq, lkv] bool: key j visible to query i (global positions in the sequence, bottom-right aligned)."""
    i = np.arange(lq)[:, None]
    j = np.arange(lkv)[None, :]
    delta = lkv - lq
    ok = np.ones((lq, lkv), dtype=bool)
    if causal:
        ok &= j <= i + delta
    wl, wr = window
    if wl >= 0:
        ok &= j >= i + delta - wl
    if wr >= 0:
        ok &= j <= i + delta + wr
    return ok


def oracle(f):
    """float64 O [tq, hq, dv], LSE [hq, tq], dQ, dK, dV from the fixture's inputs; pad rows 0 / -inf."""
    c = case_of(f)
    q, k, v, do = (read(f, "inputs/" + n) for n in ("q", "k", "v", "dout"))
    tq, hq, _ = q.shape
    tkv, hkv, dv = v.shape
    group = hq // hkv
    scale = float(c["softmax_scale"])
    causal = c["mask"] == "causal"
    cu_q, cu_kv = f["layout/cu_seqlens_q"][()], f["layout/cu_seqlens_kv"][()]
    off_q, off_kv = f["layout/cu_seqlens_q_padded"][()], f["layout/cu_seqlens_kv_padded"][()]
    o = np.zeros((tq, hq, dv))
    lse = np.full((hq, tq), -np.inf)
    dq, dk, dvv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_q) - 1):
        lq, lkv = int(cu_q[b + 1] - cu_q[b]), int(cu_kv[b + 1] - cu_kv[b])
        if lq == 0:
            continue
        rq = slice(int(off_q[b]), int(off_q[b]) + lq)
        rk = slice(int(off_kv[b]), int(off_kv[b]) + lkv)
        mask = visible(lq, lkv, c["window"], causal)
        seen = mask.any(axis=1)
        for h in range(hq):
            g = h // group
            s = np.where(mask, scale * (q[rq, h] @ k[rk, g].T), -np.inf)
            m = np.where(seen, s.max(axis=1, initial=-np.inf), 0.0)
            p = np.where(mask, np.exp(s - m[:, None]), 0.0)
            l = np.where(seen, m + np.log(np.where(seen, p.sum(axis=1), 1.0)), -np.inf)
            p = np.where(mask, np.exp(s - np.where(seen, l, 0.0)[:, None]), 0.0)
            oh = p @ v[rk, g]
            o[rq, h], lse[h, rq] = oh, l
            dp = do[rq, h] @ v[rk, g].T
            ds = p * (dp - (do[rq, h] * oh).sum(axis=1)[:, None])
            dq[rq, h] = scale * (ds @ k[rk, g])
            dk[rk, g] += scale * (ds.T @ q[rq, h])
            dvv[rk, g] += p.T @ do[rq, h]
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dvv}


def valid_rows(cu, off, total):
    valid = np.zeros(total, dtype=bool)
    for b in range(len(cu) - 1):
        valid[int(off[b]):int(off[b]) + int(cu[b + 1] - cu[b])] = True
    return valid


def round_to(x, dtype):
    """Round-to-nearest-even of float64 values to bf16, fp16 or fp32 (returned as float64)."""
    if dtype == "fp32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float64)
    # bf16: 8 significant bits, exponent range of float32
    mant, exp = np.frexp(x)
    exp = np.maximum(exp, -125)
    ulp = np.ldexp(1.0, exp - 8)
    return np.round(x / ulp) * ulp


SIGNIFICAND_BITS = {"bf16": 8, "fp16": 11, "fp32": 24}


def ulp_in(y, precision):
    """Units in the last place of y > 0 in the precision: 2^(floor(log2 y) + 1 - significand bits)."""
    _, exp = math.frexp(y)
    return math.ldexp(1.0, exp - SIGNIFICAND_BITS[precision])


def rounding_floor(x, precision):
    """atol of fixtures/SCHEMA.md version 2: k ulps of 0.3 + max|x| (k = 8 in float32, 2 otherwise), or
    FlashAttention's floor 2 * max |fl(fl(x + 0.3) - 0.3) - x| where that were larger."""
    magnitude = float(np.max(np.abs(x), initial=0.0))
    k = 8.0 if precision == "fp32" else 2.0
    flash = 0.0
    if x.size:
        flash = 2.0 * float(np.max(np.abs(round_to(round_to(x + 0.3, precision) - 0.3, precision) - x)))
    return max(k * ulp_in(0.3 + magnitude, precision), flash)


def mean_budget(rtol, max_err, mean_err, atol, n):
    """The mean limit: the statistical one, never below the max limit / sqrt(n) (a mean of few elements)."""
    return max(1.5 * mean_err + atol / 8, (rtol * max_err + atol) / math.sqrt(max(n, 1)))


def check_fixture(path, problems):
    def fail(what):
        problems.append(f"{path}: {what}")

    with h5py.File(path, "r") as f:
        version = int(f["case"].attrs["schema_version"])
        if version != SCHEMA_VERSION:
            fail(f"/case: schema_version {version}, this checker applies the budget rule of version {SCHEMA_VERSION}")
            return
        c = case_of(f)
        digest = hashlib.sha256(b"".join(raw_bytes(f["inputs/" + n]) for n in ("q", "k", "v", "dout"))).hexdigest()
        if "inputs_sha256" not in f["case"].attrs:
            fail("/case: no attribute inputs_sha256")
        elif f["case"].attrs["inputs_sha256"] != digest:
            fail(f"/case: inputs_sha256 {f['case'].attrs['inputs_sha256']} != SHA-256 of the stored inputs {digest}")
        ref = oracle(f)
        tq, tkv = f["inputs/q"].shape[0], f["inputs/k"].shape[0]
        vq = valid_rows(f["layout/cu_seqlens_q"][()], f["layout/cu_seqlens_q_padded"][()], tq)
        vkv = valid_rows(f["layout/cu_seqlens_kv"][()], f["layout/cu_seqlens_kv_padded"][()], tkv)
        rows = {"o": vq, "dq": vq, "dk": vkv, "dv": vkv}
        for name in ("o", "dq", "dk", "dv"):
            g, x, valid = read(f, "golden/" + name), ref[name], rows[name]
            if g.shape != x.shape:
                fail(f"/golden/{name}: shape {g.shape}, oracle {x.shape}")
                continue
            if np.any(g[~valid] != 0):
                fail(f"/golden/{name}: non-zero pad or tail rows")
            gv, xv = g[valid], x[valid]
            floor = 1e-9 * max(float(np.max(np.abs(xv), initial=0.0)), 1e-30)
            err = np.abs(gv - xv)
            bad = err > REL * np.abs(xv) + floor
            if np.any(bad):
                at = np.unravel_index(np.argmax(err - REL * np.abs(xv)), xv.shape)
                fail(f"/golden/{name}: {int(bad.sum())} element(s) off the numpy oracle, e.g. valid row {at[0]}, "
                     f"head {at[1]}, dim {at[2]}: golden {gv[at]!r}, oracle {xv[at]!r}")
        g, x = read(f, "golden/lse"), ref["lse"]
        if np.any(np.isfinite(g[:, ~vq])):
            fail("/golden/lse: pad rows are not -inf")
        gv, xv = g[:, vq], x[:, vq]
        if not np.array_equal(np.isneginf(gv), np.isneginf(xv)) or np.any(np.isnan(gv)) or np.any(np.isposinf(gv)):
            fail("/golden/lse: the valid rows with LSE -inf differ from the oracle's")
        finite = np.isfinite(xv) & np.isfinite(gv)
        if np.any(np.abs(gv[finite] - xv[finite]) > REL * np.abs(xv[finite]) + 1e-9):
            fail("/golden/lse: finite values off the numpy oracle")

        # Per-rank shards: the global tensors gathered with the partitioned indices, bit for bit.
        idx_q, idx_kv = f["layout/partitioned_indices_q"][()], f["layout/partitioned_indices_kv"][()]
        for r in range(int(c["cp_size"])):
            for name, idx, src in (("q", idx_q, "inputs/q"), ("k", idx_kv, "inputs/k"), ("v", idx_kv, "inputs/v"),
                                   ("dout", idx_q, "inputs/dout"), ("o", idx_q, "golden/o"), ("dq", idx_q, "golden/dq"),
                                   ("dk", idx_kv, "golden/dk"), ("dv", idx_kv, "golden/dv")):
                a, b = f[f"ranks/{r}/{name}"][()], f[src][()][idx[r]]
                if not np.array_equal(a, b, equal_nan=True):
                    fail(f"/ranks/{r}/{name}: not the gathered rows of /{src}")
            lse_r = f[f"ranks/{r}/lse"][()]
            if not np.array_equal(lse_r, f["golden/lse"][()][:, idx_q[r]]):
                fail(f"/ranks/{r}/lse: not the gathered rows of /golden/lse")

        # CP budgets of /golden/* from /peer/* and this oracle.
        for name in ("o", "lse", "dq", "dk", "dv"):
            d = f["golden/" + name]
            peer = read(f, "peer/" + name)
            if name == "lse":
                x, p = ref[name][:, vq], peer[:, vq]
                keep = np.isfinite(x)
                x, p = x[keep], p[keep]
                precision = "fp32"
            else:
                x, p = ref[name][rows[name]], peer[rows[name]]
                precision = c["dtype"]
            atol = rounding_floor(x, precision)
            max_err = float(np.max(np.abs(p - x), initial=0.0))
            mean_err = float(np.mean(np.abs(p - x))) if x.size else 0.0
            rtol = float(d.attrs["rtol"])
            expect = {"compared_elements": x.size, "atol": atol, "cp_peer_max_err": max_err,
                      "cp_peer_mean_err": mean_err, "cp_max_budget": rtol * max_err + atol,
                      "cp_mean_budget": mean_budget(rtol, max_err, mean_err, atol, x.size)}
            if rtol != (2.0 if name in ("o", "lse") else 3.0):
                fail(f"/golden/{name}: rtol {rtol}")
            for key, value in expect.items():
                stored = float(d.attrs[key])
                if not math.isclose(stored, value, rel_tol=1e-6, abs_tol=1e-300):
                    fail(f"/golden/{name}: attribute {key} = {stored!r}, recomputed {value!r}")


def raw_bytes(dataset):
    """The element bytes as the file stores them (bf16 has no numpy type: read as 16-bit words)."""
    t = dataset.id.get_type()
    if t.get_class() == h5py.h5t.FLOAT and t.get_size() == 2 and t.get_ebias() == 127:
        out = np.empty(dataset.shape, dtype="<u2")
        if out.size:
            dataset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=t)
        return out.tobytes()
    return np.ascontiguousarray(dataset[()]).tobytes()


def check_manifest(folder, problems):
    with open(os.path.join(folder, "MANIFEST.json")) as m:
        manifest = json.load(m)
    listed = {entry["file"] for entry in manifest["files"]}
    present = {n for n in os.listdir(folder) if n.endswith(".h5")}
    for extra in sorted(present - listed):
        problems.append(f"{folder}/{extra}: not in MANIFEST.json")
    for entry in manifest["files"]:
        path = os.path.join(folder, entry["file"])
        if not os.path.exists(path):
            problems.append(f"{path}: listed in MANIFEST.json but missing")
            continue
        with h5py.File(path, "r") as f:
            if f["case"].attrs["case_json"] != entry["case_json"]:
                problems.append(f"{path}: case JSON differs from MANIFEST.json")
            found = {}

            def collect(name, obj):  # returns None: visititems stops at the first non-None return
                if isinstance(obj, h5py.Dataset):
                    found["/" + name] = obj

            f.visititems(collect)
            if set(found) != set(entry["datasets"]):
                problems.append(f"{path}: datasets differ from MANIFEST.json")
            for name, sha in entry["datasets"].items():
                if name in found and hashlib.sha256(raw_bytes(found[name])).hexdigest() != sha:
                    problems.append(f"{path}:{name}: SHA-256 differs from MANIFEST.json")


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    problems, files, checked = [], [], 0
    for arg in argv:
        if os.path.isdir(arg):
            files += sorted(os.path.join(arg, n) for n in os.listdir(arg) if n.endswith(".h5"))
            if os.path.exists(os.path.join(arg, "MANIFEST.json")):
                check_manifest(arg, problems)
        else:
            files.append(arg)
    for path in files:
        before = len(problems)
        check_fixture(path, problems)
        checked += 1
        print(f"{'ok  ' if len(problems) == before else 'FAIL'} {path}")
    for p in problems:
        print("  " + p)
    print(f"{checked} fixture(s) checked against the numpy float64 oracle: "
          f"{'PASS' if not problems and checked else 'FAIL'}")
    return 0 if not problems and checked else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
