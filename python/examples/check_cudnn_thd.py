#!/usr/bin/env python3
"""cuDNN fused attention (THD with ragged offsets, padding between sequences kept) checked against cpgold fixtures,
forward and backward, global and per rank.

    python3 python/examples/check_cudnn_thd.py --cpgold build/bin/cpgold --summary cudnn.json DIR...

Q/K/V/dO are handed to cuDNN in the fixture's padded layout (cudnn_thd.py): the kernel reads only the actual rows of
every sequence, pad rows (random, NaN or inf in the fixtures) must not leak. Output buffers are zeroed first: cuDNN
does not write pad rows, and the contract wants them 0. GQA/MQA and dim_qk != dim_v (MLA) are native. Not
expressible: fp32 (cuDNN's fused attention takes fp16/bf16), head dims that are not a multiple of 8, and whatever
cuDNN refuses when the graph is built (reported with cuDNN's message).
"""
import sys

import cudnn
import torch

import cudnn_thd
import kernel_sweep


class CudnnThd:
    name = "cudnn"

    def __init__(self):
        self.handle = cudnn.create_handle()
        self.graphs = {}

    def unsupported(self, fx):
        if fx.dtype not in ("bf16", "fp16"):
            return f"dtype {fx.dtype}: cuDNN fused attention takes fp16/bf16"
        if fx.dim_qk % 8 or fx.dim_v % 8:
            return f"head dims {fx.dim_qk}/{fx.dim_v}: cuDNN needs multiples of 8"
        if fx.max_seqlen("q") == 0:
            return "no query token in the batch"
        return None

    def graph(self, fx):
        key = (fx.dtype, fx.heads_q, fx.heads_kv, fx.dim_qk, fx.dim_v, fx.causal, fx.window, fx.softmax_scale,
               cudnn_thd.bucket(fx.num_sequences, 4), cudnn_thd.bucket(fx.max_seqlen("q"), 64),
               cudnn_thd.bucket(fx.max_seqlen("kv"), 64))
        if key not in self.graphs:
            try:
                self.graphs[key] = cudnn_thd.ThdAttention(self.handle, torch.bfloat16 if fx.dtype == "bf16" else
                                                          torch.float16, *key[1:5], *key[8:11], fx.softmax_scale,
                                                          fx.causal, fx.window)
            except (cudnn.cudnnGraphNotSupportedError, RuntimeError) as e:
                self.graphs[key] = e
        if isinstance(self.graphs[key], Exception):
            raise kernel_sweep.Unsupported(f"cuDNN refuses the graph: {self.graphs[key]}")
        return self.graphs[key]

    def __call__(self, fx):
        att = self.graph(fx)
        cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        x = fx.inputs("torch", "cuda")
        bt = att.batch_tensors(fx.cu_seqlens("q", padded=True), fx.cu_seqlens("kv", padded=True),
                               fx.seqlens("q"), fx.seqlens("kv"))
        o = torch.zeros(x["q"].shape[0], fx.heads_q, fx.dim_v, dtype=x["q"].dtype, device="cuda")
        stats = torch.full((att.b, fx.heads_q, att.sq, 1), float("nan"), dtype=torch.float32, device="cuda")
        att.forward(x["q"], x["k"], x["v"], o, stats, bt)
        dq, dk, dv = (torch.zeros_like(x[n]) for n in ("q", "k", "v"))
        att.backward(x["q"], x["k"], x["v"], o, x["dout"], stats, dq, dk, dv, bt)
        torch.cuda.synchronize()
        # Stats [B, hq, S, 1] -> LSE [hq, Tq]: row i of sequence b sits at padded offset[b] + i.
        lse = torch.full((fx.heads_q, x["q"].shape[0]), float("-inf"), dtype=torch.float32, device="cuda")
        off, lens = fx.cu_seqlens("q", padded=True), fx.seqlens("q")
        for b, n in enumerate(lens):
            if n:
                lse[:, off[b]:off[b] + n] = stats[b, :, :n, 0]
        return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def make_kernel():
    print(f"{version()}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    return CudnnThd()


def version():
    return f"cuDNN {cudnn.backend_version_string()}, frontend {cudnn.__version__}"


def summary_extra(kernel):
    return {"cudnn": version(), "device": torch.cuda.get_device_name(0),
            "graphs_built": sum(not isinstance(g, Exception) for g in kernel.graphs.values()),
            "graphs_refused": [str(g)[:300] for g in kernel.graphs.values() if isinstance(g, Exception)]}


if __name__ == "__main__":
    sys.exit(kernel_sweep.main(make_kernel, __doc__.splitlines()[0], summary_extra))
