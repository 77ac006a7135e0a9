#!/usr/bin/env python3
"""The smallest cases that show each finding of docs/te-findings.md, as `name case-json` lines for
`cpgold gen --case` (device_run.sh minimal generates them and runs check_te_dpa.py and check_te_cp.py on them).
Every case is bf16 with 2 query heads of dimension 64 unless it says otherwise; lengths are the fewest tokens the
finding needs."""
import json

BASE = {"dtype": "bf16", "heads_q": 2, "dim_qk": 64, "seed": 11}
CASES = {
    # 1. CP p2p, causal, Q and K/V padded to different lengths: TE's arguments compute wrong (query, key) pairs
    "f1_p2p_causal_padded_q_ne_kv": {"seqlens_q": [2], "padded_q": [8], "padded_kv": [4], "mask": "causal",
                                     "cp_size": 2, "comm": "p2p"},
    # 1. CP all_gather, two-sided sliding window: cuDNN's per-chunk calls are top-left aligned
    "f1_all_gather_window_two_sided": {"seqlens_q": [2], "padded_q": [4], "padded_kv": [4], "window": [0, 3],
                                       "cp_size": 2, "comm": "all_gather"},
    # 2. CP p2p merge: a step holding queries of sequence 0 but none of its keys adds exp(0) to their softmax sum
    "f2_p2p_keyless_step": {"seqlens_q": [4, 4], "seqlens_kv": [1, 4], "cp_size": 2, "comm": "p2p"},
    # 3. non-CP GQA: dK/dV of a sequence with keys and no queries are not zero
    "f3_gqa_query_less_sequence": {"seqlens_q": [4, 0], "seqlens_kv": [4, 6], "heads_q": 4, "heads_kv": 1,
                                   "cp_size": 1},
    # 3. CP p2p GQA: rank 0's backward step 0 gets sequences with keys and no queries
    "f3_p2p_gqa_query_less_step": {"seqlens_q": [6, 2], "heads_q": 4, "heads_kv": 1, "mask": "causal",
                                   "cp_size": 2, "comm": "p2p"},
    # 4. CP p2p backward with rows after the last sequence (THD tail padding): device-side assert
    "f4_p2p_tail_rows": {"seqlens_q": [3], "total_tokens_q": 8, "total_tokens_kv": 8, "mask": "causal",
                         "cp_size": 2, "comm": "p2p"},
    # Found by cpgold shrink on the device (run N3, docs/shrink.md), each exactly as it ran there (seed 0, zero pads):
    # 5. non-CP backward at head dim 256: head dims 128-255 of dQ/dK/dV not written (--same-tensors, TE non-CP)
    "f5_d256_two_tokens": {"seqlens_q": [2], "heads_q": 1, "dim_qk": 256, "cp_size": 1, "seed": 0,
                           "pad_fill": "zero"},
    # 2. one token at W = 2 p2p: the step holding rank 1's keys (pad rows only) adds exp(0), O is halved (the
    #    d 256 search's end without --same-tensors; at dim_v 256 its dV half may also meet finding 5)
    "f2_p2p_one_token": {"seqlens_q": [1], "heads_q": 1, "dim_qk": 64, "dim_v": 256, "cp_size": 2, "comm": "p2p",
                         "seed": 0, "pad_fill": "zero"},
    # 3. one token at W = 2 p2p causal, GQA 2/1: rank 1 holds keys and no query (dK/dV; NaN with a poisoned cache)
    "f3_p2p_gqa_one_token": {"seqlens_q": [1], "heads_q": 2, "heads_kv": 1, "dim_qk": 32, "mask": "causal",
                             "cp_size": 2, "comm": "p2p", "seed": 0, "pad_fill": "zero"},
}

if __name__ == "__main__":
    for name, case in CASES.items():
        print(name, json.dumps({**BASE, **case}, separators=(",", ":")))
