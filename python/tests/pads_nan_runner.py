"""A fake implementation for `cpgold shrink` tests: the golden's own global outputs, with NaN on every pad and tail
row of o, dq, dk, dv (what FlashAttention-3/4 may leave there). Usage: pads_nan_runner.py FIXTURE CANDIDATE"""
import sys

import numpy as np

import cpgold

with cpgold.Fixture(sys.argv[1]) as fx:
    out = {}
    for name in ("o", "lse", "dq", "dk", "dv"):
        x = fx.golden(name)
        if name != "lse":
            x[~fx.valid_rows("q" if name in ("o", "dq") else "kv")] = np.nan
        out[name] = x
    cpgold.write_global(sys.argv[2], out, fixture=fx, lse_layout="ht")
