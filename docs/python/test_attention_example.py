"""An attention implementation tested against cpgold fixtures with pytest (docs/python.md, "pytest").

    pip install ./python                                         # the package and its pytest plugin
    pytest docs/python/test_attention_example.py                 # the quick suite (the default)
    pytest docs/python/test_attention_example.py --cpgold-suite te             # TransformerEngine's CP configurations
    pytest docs/python/test_attention_example.py --cpgold-random 50 --cpgold-seed 7

`cpgold_case` is a cpgold.Fixture, one per case; the test ids name the cases. Replace `my_attention` with a call of
your kernel. As shipped it is the float32 numpy attention of python/examples/numpy_varlen_attention.py, called the
way a varlen kernel is called (valid tokens compacted, cu_seqlens, FlashAttention's bottom-right mask), so that the
file runs anywhere: no GPU, no torch.
"""
import os
import sys

import cpgold
import cpgold.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "examples"))
from numpy_varlen_attention import round_to, varlen_attention  # noqa: E402


def my_attention(fx):
    """Global outputs of the fixture's case: o, lse [h, t], dq, dk, dv in the padded layout, zero on pad rows.

    With PyTorch and a varlen kernel (FlashAttention-2's API, torch's varlen_attn, TransformerEngine) it reads:
        x = fx.inputs("torch", "cuda")
        q, k, v = (fx.compact(x[n], s).requires_grad_() for n, s in (("q", "q"), ("k", "kv"), ("v", "kv")))
        o, lse = kernel(q, k, v, cu_seqlens_q=fx.cu_seqlens("q"), cu_seqlens_kv=fx.cu_seqlens("kv"),
                        scale=fx.softmax_scale, causal=fx.causal, window=fx.window)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), fx.compact(x["dout"], "q"))
        return {"o": fx.expand(o, "q"), "lse": fx.expand(lse, "q", axis=1, fill=float("-inf")),
                "dq": fx.expand(dq, "q"), "dk": fx.expand(dk, "kv"), "dv": fx.expand(dv, "kv")}
    """
    x = fx.inputs()  # numpy; bf16 values held exactly in float32
    side = {"q": "q", "dout": "q", "k": "kv", "v": "kv"}
    c = {name: fx.compact(x[name], side[name]) for name in x}
    out = varlen_attention(c["q"], c["k"], c["v"], c["dout"], fx.cu_seqlens("q"), fx.cu_seqlens("kv"),
                           fx.softmax_scale, fx.causal, fx.window)
    result = {"lse": fx.expand(out["lse"], "q", axis=1, fill=float("-inf"))}
    for name, s in (("o", "q"), ("dq", "q"), ("dk", "kv"), ("dv", "kv")):
        result[name] = fx.expand(round_to(out[name], fx.dtype), s)  # stored in the case dtype, as a kernel does
    return result


def test_attention(cpgold_case):
    # On failure: cpgold check's report (per-tensor table, exact rules broken, first divergence by rank, sequence,
    # row and head, and the `cpgold gen --case ...` line that reproduces the fixture).
    cpgold.testing.assert_close(cpgold_case, my_attention(cpgold_case), lse_layout="ht")


def test_attention_per_rank(cpgold_case):
    # A CP implementation checks what each rank holds, in the rank-local layout; here the shards of the global result
    # stand for it. Under torch.distributed each process passes its own rank: rank=dist.get_rank().
    shards = cpgold_case.shard_outputs(my_attention(cpgold_case))
    for rank, local in enumerate(shards):
        cpgold.testing.assert_close(cpgold_case, local, rank=rank, lse_layout="ht")
