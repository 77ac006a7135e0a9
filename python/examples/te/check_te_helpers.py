#!/usr/bin/env python3
"""TransformerEngine's THD CP helper kernels (`transformer_engine_torch.thd_*`) run on coded and random tensors; every
call's inputs, parameters and outputs go into a dump that `cpgold helpers-check DUMP` recomputes with cpgold's CPU
twins, bit for bit (docs/helpers-check.md has the format).

    python3 python/examples/te/check_te_helpers.py --dump te_helpers.h5 [--seed 26] [--layouts 6]
    build/bin/cpgold helpers-check te_helpers.h5

Layouts: random batches with zero-length sequences and lengths not divisible by 2W, W in {2, 3, 4, 8}, every rank.
Row tensors hold coded values (each float32 element encodes sequence, row, head and dim, exactly) for the copies and
reorders; the corrections get random values in bf16, fp16 and fp32 (zeros included, for the zero guard of the out
correction), LSE packed and unpacked, all six grad-correction modes.
"""
import argparse
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from cpgold.outsiders import te as te_adapter  # noqa: E402

TE = te_adapter.load(te_adapter.te_environment("fused"))
torch, tex = TE.torch, TE.tex
HEADS, DIM = 2, 8          # a row of 2 x 8 float32 = 64 bytes (TE's copies need multiples of 16 bytes)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRAD_MODES = (("add", "none"), ("copy", "none"), ("none", "add"), ("none", "copy"), ("add", "copy"), ("copy", "add"))


class Dump:
    def __init__(self, path, implementation):
        self.f = h5py.File(path, "w")
        self.f.attrs["format"] = "cpgold-thd-helpers"
        self.f.attrs["version"] = np.int64(1)
        self.f.attrs["implementation"] = implementation
        self.n = 0

    def call(self, op, attrs, **datasets):
        g = self.f.create_group(f"calls/{self.n:05d}_{op}")
        self.n += 1
        g.attrs["op"] = op
        for k, v in attrs.items():
            g.attrs[k] = v if isinstance(v, str) else np.int64(v)
        for k, v in datasets.items():
            a = v.detach().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(v)
            if a.dtype in (torch.bfloat16, torch.float16):
                a = a.float()
            g.create_dataset(k, data=a.numpy())

    def close(self):
        self.f.close()


def coded(rows, seq_of_row, pos_of_row):
    """[rows, HEADS, DIM] float32: element (r, h, d) = ((seq + 1) * 4096 + pos) * 64 + h * DIM + d, exact in float32
    for the sizes used here (sequence and position of every row; -1 for rows outside every sequence)."""
    s = torch.as_tensor(seq_of_row, dtype=torch.float64)[:, None, None] + 1
    p = torch.as_tensor(pos_of_row, dtype=torch.float64)[:, None, None]
    h = torch.arange(HEADS, dtype=torch.float64)[None, :, None]
    d = torch.arange(DIM, dtype=torch.float64)[None, None, :]
    return (((s * 4096 + p) * 64) + h * DIM + d).float()


def row_positions(cu_padded, rows):
    idx = np.arange(rows)
    seq = np.searchsorted(cu_padded, idx, side="right") - 1
    seq = np.where(idx < cu_padded[-1], seq, len(cu_padded) - 1)
    pos = idx - cu_padded[np.clip(seq, 0, len(cu_padded) - 1)]
    return seq, pos


def random_layout(rng, w):
    b = int(rng.integers(1, 6))
    lens = rng.integers(0, 6 * w, size=b)
    lens[rng.random(b) < 0.25] = 0
    padded = [int(-(-int(n) // (2 * w)) * 2 * w) + (2 * w if rng.random() < 0.3 else 0) for n in lens]
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if cu_p[-1] == 0:  # at least one row
        return random_layout(rng, w)
    return cu, cu_p


def random_values(rng, shape, dtype, zeros=0.1):
    x = torch.as_tensor(rng.standard_normal(shape), dtype=torch.float32)
    x[torch.as_tensor(rng.random(shape) < zeros)] = 0
    return x.to(DTYPES[dtype]).cuda()


def lse_values(rng, shape, neg_inf=0.05):
    x = torch.as_tensor(rng.standard_normal(shape) * 3, dtype=torch.float32)
    x[torch.as_tensor(rng.random(shape) < neg_inf)] = float("-inf")
    return x.cuda()


def out_correction(out, step, lse, lse_step, cu, only_second, packed):
    """TE 2.20.2's thd_out_correction takes the rank's LSE before and after the step's merge (it rescales `out` by
    exp(before - after) as well); TE up to 2.19 took one LSE. The dump's twin models the one-LSE kernel, so the new
    signature gets the same LSE twice: the rescale factor is exp(0) = 1 and what is compared is the weighted add."""
    try:
        tex.thd_out_correction(out, step, lse, lse_step, cu, only_second, packed)
    except TypeError:
        tex.thd_out_correction(out, step, lse.clone(), lse, lse_step, cu, only_second, packed)


def run_layout(dump, rng, w, cu, cu_p):
    dev = "cuda"
    cu_p_t = torch.as_tensor(cu_p, device=dev)
    total = int(cu_p[-1])
    cu_local = (cu_p // w).astype(np.int32)
    cu_local_t = torch.as_tensor(cu_local, device=dev)
    t = int(cu_local[-1])
    b = len(cu) - 1
    seq, pos = row_positions(cu_p, total)
    glob = coded(total, seq, pos).to(dev)
    # partitioned indices and both reorders (global offsets)
    for r in range(w):
        idx = tex.thd_get_partitioned_indices(cu_p_t, total, w, r)
        dump.call("partitioned_indices", {"cp_size": w, "rank": r, "total_rows": total}, cu_seqlens_padded=cu_p,
                  output=idx)
    dump.call("sequence_to_rank_order", {"cp_size": w}, cu_seqlens_padded=cu_p, input=glob,
              output=tex.thd_sequence_order_to_cp_rank_order(glob, cu_p_t, w, total))
    dump.call("rank_to_sequence_order", {"cp_size": w}, cu_seqlens_padded=cu_p, input=glob,
              output=tex.thd_cp_rank_order_to_sequence_order(glob, cu_p_t, w, total))
    # rank-local tensors of one rank (coded by local row)
    lseq, lpos = row_positions(cu_local, t)
    local = coded(t, lseq, lpos).to(dev)
    for half in (0, 1):
        dump.call("read_half", {"cp_size": w, "half": half}, cu_seqlens_padded=cu_local, input=local,
                  output=tex.thd_read_half_tensor(local, cu_local_t, half))
    max_local = int(np.max(np.diff(cu_local))) if b else 0
    for packed in (1, 0):
        shape = (HEADS, t) if packed else (b, HEADS, max_local)
        half_shape = (HEADS, t // 2) if packed else (b, HEADS, max_local // 2)
        lse = lse_values(rng, shape)
        lse_half = lse_values(rng, half_shape)
        before = lse.clone()
        tex.thd_second_half_lse_correction(lse, lse_half, cu_local_t, bool(packed))
        dump.call("second_half_lse_correction", {"cp_size": w, "packed": packed}, cu_seqlens_padded=cu_local,
                  lse=before, lse_half=lse_half, output=lse)
        s2 = t // 2 if packed else max_local // 2   # TE's binding: packed S2 >= S/2, unpacked S2 == S/2
        out = tex.thd_read_second_half_lse(before, cu_local_t, bool(packed), s2)
        dump.call("read_second_half_lse", {"cp_size": w, "packed": packed, "second_half_lse_seqlen": s2},
                  cu_seqlens_padded=cu_local, lse=before, output=out)
        for dtype in DTYPES:
            for only_second in (0, 1):
                rows = t // 2 if only_second else t
                out = random_values(rng, (t, HEADS, DIM), dtype)
                step = random_values(rng, (rows, HEADS, DIM), dtype)
                lse_full = lse_values(rng, shape, neg_inf=0.0)
                lse_step = lse_values(rng, half_shape if only_second else shape, neg_inf=0.05)
                before = out.clone()
                out_correction(out, step, lse_full, lse_step, cu_local_t, bool(only_second), bool(packed))
                dump.call("out_correction", {"cp_size": w, "only_second_half": only_second, "packed": packed,
                                             "dtype": dtype},
                          cu_seqlens_padded=cu_local, out=before, out_step=step, lse=lse_full, lse_step=lse_step,
                          output=out)
    for dtype in DTYPES:
        for first, second in GRAD_MODES:
            rows = t if "none" not in (first, second) else t // 2
            grad = random_values(rng, (t, HEADS, DIM), dtype)
            step = random_values(rng, (rows, HEADS, DIM), dtype)
            before = grad.clone()
            tex.thd_grad_correction(grad, step, cu_local_t, first, second)
            dump.call("grad_correction", {"cp_size": w, "first": first, "second": second, "dtype": dtype},
                      cu_seqlens_padded=cu_local, grad=before, grad_step=step, output=grad)
    # copy of valid tokens: step offsets that need not start at 0, actual counts inside each padded length
    start = int(rng.integers(0, 4))
    step_padded = np.concatenate([[start], start + np.cumsum(rng.integers(0, 7, size=b))]).astype(np.int32)
    step_lens = [int(rng.integers(0, n + 1)) for n in np.diff(step_padded)]
    step_cu = np.concatenate([[0], np.cumsum(step_lens)]).astype(np.int32)
    rows = int(step_padded[-1]) + int(rng.integers(0, 3))
    if rows:
        sq, ps = row_positions(step_padded, rows)
        inp = coded(rows, sq, ps).to(dev)
        out = -coded(rows, sq, ps).to(dev) - 1
        before = out.clone()
        tex.thd_copy_valid_tokens_from_per_split_to_rank_local(out, inp, torch.as_tensor(step_padded, device=dev),
                                                                torch.as_tensor(step_cu, device=dev))
        dump.call("copy_valid_tokens", {}, cu_seqlens_padded_step=step_padded, cu_seqlens_step=step_cu, out=before,
                  input=inp, output=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--layouts", type=int, default=6, help="random layouts per W (default 6)")
    args = ap.parse_args()
    v = te_adapter.versions(TE)
    impl = f"TransformerEngine {v['transformer_engine']} transformer_engine_torch.thd_*, torch {v['torch']}, {v['device']}"
    print(impl, flush=True)
    rng = np.random.default_rng(args.seed)
    dump = Dump(args.dump, impl)
    errors = 0
    for w in (2, 3, 4, 8):
        layouts = [(np.array([0, 8, 24, 40], np.int32), np.array([0, 8, 24, 40], np.int32))] if w == 4 else []
        layouts += [random_layout(rng, w) for _ in range(args.layouts)]
        for cu, cu_p in layouts:
            try:
                run_layout(dump, rng, w, cu, cu_p)
            except RuntimeError as e:  # TE's own NVTE_CHECK on a layout: recorded, the others go on
                errors += 1
                print(f"W={w} cu_seqlens_padded={cu_p.tolist()}: TE raised {str(e).splitlines()[0][:300]}", flush=True)
    torch.cuda.synchronize()
    print(f"{dump.n} calls written to {args.dump}; {errors} layouts raised in TE", flush=True)
    dump.close()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
