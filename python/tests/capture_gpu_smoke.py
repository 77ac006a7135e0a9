"""The capture tests' model on one GPU (thread ranks on CUDA), for a machine with a GPU but without cpgold's C++ core:
records the step with a planted chunk swap in layer 1 and compares its outputs and gradients, bit for bit, with the
step run without capture. The folder is then checked anywhere:

    python3 python/tests/capture_gpu_smoke.py OUT_FOLDER [W]
    python3 -m cpgold.capture check OUT_FOLDER/cap_fp32   # (and cap_bf16) exit 1: layer 1 fails, chunk_order

Prints one line per comparison and exits 1 when outputs or gradients differ."""
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

import torch  # noqa: E402

import capture_ring as ring  # noqa: E402
import cpgold.capture as capture  # noqa: E402
from cpgold.thread_ranks import ThreadRanks  # noqa: E402

SPEC = dict(cu_seqlens_q="cu_seqlens_q", cu_seqlens_kv="cu_seqlens_kv", cu_seqlens_q_padded="cu_seqlens_q_padded",
            cu_seqlens_kv_padded="cu_seqlens_kv_padded", causal="causal", scale="scale", cp_group="group",
            returns=("o", "lse"))


def run(w, folder, dtype):
    batch = ring.batch_of(w)
    base = ring.Model(3, bugs={1: "chunks_swapped@r1"}, dtype=dtype).cuda()
    replicas = [copy.deepcopy(base) for _ in range(w)]
    cap = capture.Capture(folder) if folder else None
    if cap:
        fn = cap.attention(ring.ring_attention, **SPEC)
        for m in replicas:
            ring.set_attention(m, fn)

    def rank_main(rank, ranks):
        if cap:
            cap.attach(replicas[rank])
            with cap.step(0):
                return ring.train_step(replicas[rank], batch, rank, ranks.group())
        return ring.train_step(replicas[rank], batch, rank, ranks.group())

    results = ThreadRanks(w, device="cuda", timeout=120).run(rank_main)
    if cap:
        cap.close()
    return results


def main(out, w=2):
    same = True
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain = run(w, None, dtype)
        captured = run(w, os.path.join(out, f"cap_{name}"), dtype)
        for r, (a, b) in enumerate(zip(plain, captured)):
            equal = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(
                torch.equal(a[2][n], b[2][n]) for n in a[2])
            same &= equal
            print(f"{name} rank {r}: loss, outputs and gradients {'bit-identical' if equal else 'DIFFER'}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2))
