#!/usr/bin/env python3
"""Cases at the shapes of TransformerEngine's own CP tests (tests/pytorch/attention/test_attention_with_cp.py,
FusedAttention THD configs), scaled so the CPU generates them in minutes: two sequences as in every TE config
(batch 2), 700 and 989 tokens instead of up to 4096 (lengths not divisible by 2W, so padding sits between the
sequences), heads and head dims as TE's configs except cp_3_1's 128 heads (32 here). Each config runs on the comm
types TE's test runs it on: p2p, a2a, all_gather at W = 2 and a2a+p2p at W = 4 (a2a groups of 2); sliding windows
are skipped on p2p and a2a+p2p as TE's test skips them. Prints `name case-json` lines for `cpgold gen --case`."""
import json

CONFIGS = {  # TE config name: heads_q, heads_kv, dim_qk, dim_v, causal, window
    "cp_1_0": (12, 12, 128, 128, True, None),
    "cp_1_1": (12, 12, 128, 128, False, None),
    "cp_1_5": (12, 12, 128, 128, True, (512, 0)),
    "cp_2_0": (32, 4, 128, 128, True, None),
    "cp_2_1": (32, 32, 128, 128, True, (128, 0)),
    "cp_2_6": (12, 2, 128, 128, True, (512, 0)),
    "cp_3_0": (12, 12, 128, 64, True, None),
    "cp_3_1": (32, 32, 192, 128, True, None),
    "cp_4_0": (64, 8, 64, 64, True, None),
}
COMMS = (("p2p", 2, None), ("a2a", 2, None), ("all_gather", 2, None), ("a2a+p2p", 4, 2))


def cases():
    for name, (hq, hkv, dqk, dv, causal, window) in CONFIGS.items():
        for comm, w, a2a in COMMS:
            if window is not None and comm in ("p2p", "a2a+p2p"):
                continue
            case = {"seqlens_q": [700, 989], "heads_q": hq, "heads_kv": hkv, "dim_qk": dqk, "dim_v": dv,
                    "dtype": "bf16", "mask": "causal" if causal else "none", "cp_size": w, "comm": comm, "seed": 7}
            if window is not None:
                case["window"] = list(window)
            if a2a:
                case["a2a_size"] = a2a
            yield f"te_{name}_{comm.replace('+', '')}_w{w}", case


if __name__ == "__main__":
    for n, c in cases():
        print(n, json.dumps(c, separators=(",", ":")))
