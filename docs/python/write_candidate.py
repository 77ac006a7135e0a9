#!/usr/bin/python3
"""Writes a candidate file for `cpgold check` from an implementation written in numpy: here the float64 oracle of
check_golden.py, rounded to the case dtype as a low-precision kernel would store its outputs.

    /usr/bin/python3 docs/python/write_candidate.py FIXTURE.h5 CANDIDATE.h5 [--per-rank] [--scale-o FACTOR]
    cpgold check FIXTURE.h5 CANDIDATE.h5            # exit 0 pass, 1 fail, 2 unusable input

Global outputs go to the root (/o, /lse, /dq, /dk, /dv); with --per-rank they go to /ranks/<r>/ in the rank-local
layout (rows gathered with /layout/partitioned_indices_*) and the gathered global outputs are marked
scope = "cp_gathered". --scale-o multiplies O by a factor (to see a failing check).
"""
import sys

import h5py
import numpy as np

from check_golden import oracle, round_to


def rank_outputs(out, idx_q, idx_kv, r):
    """Rank r's rows of the global outputs `out`, gathered with the fixture's /layout/partitioned_indices_q (o, dq,
    and the rows of lse [h, t]) and _kv (dk, dv): what /ranks/<r>/ of a candidate holds."""
    return {"o": out["o"][idx_q[r]], "dq": out["dq"][idx_q[r]], "dk": out["dk"][idx_kv[r]],
            "dv": out["dv"][idx_kv[r]], "lse": out["lse"][:, idx_q[r]]}


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    fixture, candidate = argv[0], argv[1]
    per_rank = "--per-rank" in argv
    scale_o = float(argv[argv.index("--scale-o") + 1]) if "--scale-o" in argv else 1.0
    with h5py.File(fixture, "r") as f:
        ref = oracle(f)
        dtype = f["case"].attrs["dtype"]
        cp_size = int(f["case"].attrs["cp_size"])
        idx_q, idx_kv = f["layout/partitioned_indices_q"][()], f["layout/partitioned_indices_kv"][()]
        inputs_sha256 = f["case"].attrs.get("inputs_sha256")
    # What a kernel stores: O, dQ, dK, dV in the dtype (written here as float32, the plain h5py path), LSE float32.
    out = {name: round_to(x, dtype).astype(np.float32) for name, x in ref.items() if name != "lse"}
    out["o"] = (out["o"] * np.float32(scale_o)).astype(np.float32)
    out["lse"] = ref["lse"].astype(np.float32)
    with h5py.File(candidate, "w") as c:
        if inputs_sha256 is not None:  # the inputs these outputs come from: check names another fixture's inputs
            c.attrs["inputs_sha256"] = inputs_sha256
        for name, x in out.items():
            c[name] = x  # lse as [h, t], the default layout
        if per_rank:
            c.attrs["scope"] = "cp_gathered"
            for r in range(cp_size):
                g = c.create_group(f"ranks/{r}")
                local = rank_outputs(out, idx_q, idx_kv, r)
                local["lse"] = local["lse"].T.copy()  # [t, h] this time, said so in an attribute
                for name, x in local.items():
                    g[name] = x
                g["lse"].attrs["lse_layout"] = "th"
    print(f"wrote {candidate}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
