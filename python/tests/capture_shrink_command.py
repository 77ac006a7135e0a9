"""COMMANDs of test_capture_shrink.py.

`capture_shrink_command.py FIXTURE CANDIDATE [BUG]` reruns the user's CP ring attention of capture_ring.py (BUG
planted, as in the captured step: "chunks_swapped@r1", ...; "none": no bug) on every rank's inputs of FIXTURE on thread
ranks, forward and backward with the fixture's dout, and writes every rank's outputs to CANDIDATE (cpgold.write_ranks,
the cpgold candidate format).

`capture_shrink_command.py --copy-rank OUTPUTS FIXTURE CANDIDATE RANK` writes rank RANK's outputs of the candidate
file OUTPUTS (a joined call's captured candidate.h5) as that rank's candidate file of FIXTURE (cpgold.write_rank): a
COMMAND of one process per rank that gives the captured outputs on the captured case and no candidate (exit 1, the
shapes differ) on a cut one."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpgold  # noqa: E402


def rerun(fx, bug):
    """Every rank's outputs of the ring attention with `bug` on the fixture's rank inputs."""
    import torch

    import capture_ring as ring
    from cpgold.thread_ranks import ThreadRanks

    def rank_main(rank, ranks):
        x = fx.rank_inputs(rank, "torch")
        q, k, v = (x[n].requires_grad_() for n in ("q", "k", "v"))
        cu = {s: (torch.as_tensor(fx.cu_seqlens(s)), torch.as_tensor(fx.cu_seqlens(s, padded=True)))
              for s in ("q", "kv")}
        o, lse = ring.ring_attention(q, k, v, cu["q"][0], cu["kv"][0], cu["q"][1], cu["kv"][1], ranks.group(),
                                     causal=fx.causal, scale=fx.softmax_scale, bug=bug)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["dout"])
        return {"o": o.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}
    return ThreadRanks(fx.cp_size, device="cpu", timeout=30).run(rank_main)


def main(argv):
    if argv[:1] == ["--copy-rank"] and len(argv) == 5:
        outputs, fixture, candidate, rank = argv[1:]
        with cpgold.Fixture(fixture) as fx:
            cpgold.write_rank(candidate, int(rank), cpgold.read_candidate(outputs, rank=int(rank)), fixture=fx)
        return 0
    if len(argv) not in (2, 3):
        print("usage: capture_shrink_command.py FIXTURE CANDIDATE [BUG] | --copy-rank OUTPUTS FIXTURE CANDIDATE RANK",
              file=sys.stderr)
        return 2
    bug = argv[2] if len(argv) == 3 and argv[2] != "none" else None
    with cpgold.Fixture(argv[0]) as fx:
        cpgold.write_ranks(argv[1], rerun(fx, bug), fixture=fx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
