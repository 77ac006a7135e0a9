#!/usr/bin/env python3
"""TransformerEngine's DotProductAttention (THD, padding between sequences, FusedAttention) checked against cpgold
fixtures, forward and backward, global and per rank.

    python3 python/examples/te/check_te_dpa.py --cpgold build/bin/cpgold --summary te_dpa.json DIR...

Each fixture's full inputs go to one DotProductAttention call built from the case (te_harness.py says how); O, dQ,
dK, dV come from TE's forward and backward, LSE from the softmax statistics of TE's own fused-attention call (the
forward DotProductAttention made). The candidate holds the global outputs and their shards by the partition, and
`cpgold check` judges both levels. TE's refusals (asserts, no backend) are recorded as `unsupported` with TE's
message; every result keeps the backend TE chose and its NVTE_DEBUG lines.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kernel_sweep
import kernel_sweep  # noqa: E402
import te_harness as th  # noqa: E402
import torch  # noqa: E402


class TeDpa:
    name = "te_dpa"

    def __init__(self):
        self.records = {}
        self.spy = th.StatsSpy()

    def unsupported(self, fx):
        return None   # TE decides: every case is tried, refusals come back as kernel_sweep.Unsupported

    def __call__(self, fx):
        x = fx.inputs("torch", "cuda")
        cu = th.cu_tensors(fx)
        try:
            dpa = th.make_dpa(fx)
            with self.spy:
                self.spy.take()
                out, log, backend = th.run_dpa(dpa, fx, x["q"], x["k"], x["v"], x["dout"], cu)
                calls = self.spy.take()
        except th.Refused as e:
            self.records[fx.path] = {"refused": str(e), "nvte_debug": th.debug_summary(th.TE_LOG.take())}
            raise kernel_sweep.Unsupported(f"TE refuses: {e}") from None
        torch.cuda.synchronize()
        record = {"backend": backend, "nvte_debug": th.debug_summary(log), "arguments": th.te_arguments(fx),
                  "fused_forward_calls": len(calls)}
        stats = [c["stats"] for c in calls if c["stats"] is not None]
        if len(stats) == 1:
            lse, layout = th.stats_to_lse(stats[0], fx, x["q"].shape[0], fx.heads_q)
            record["lse_from"] = f"fused_attn_fwd softmax statistics, {layout}"
            out["lse"] = lse
        else:
            record["lse_from"] = f"none: {len(stats)} softmax statistics captured (expected 1)"
        self.records[fx.path] = record
        return out


def make_kernel():
    v = th.versions()
    print(", ".join(f"{k} {val}" for k, val in v.items()), flush=True)
    return TeDpa()


def summary_extra(kernel):
    return {"versions": th.versions(), "te_environment": th.TE_ENV,
            "records": {os.path.basename(k): r for k, r in kernel.records.items()}}


if __name__ == "__main__":
    sys.exit(kernel_sweep.main(make_kernel, __doc__.splitlines()[0], summary_extra))
