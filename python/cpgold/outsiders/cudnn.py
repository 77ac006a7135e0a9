"""cuDNN's fused attention (THD with ragged offsets, padding between sequences kept) as an outsider, through the
cuDNN frontend's Python API (cudnn_thd.py builds the graphs).

Q/K/V/dO are handed to cuDNN in the fixture's padded layout: the kernel reads only the actual rows of every sequence,
pad rows (random, NaN or inf in the fixtures) must not leak. Output buffers are zeroed first: cuDNN does not write
pad rows, and the contract wants them 0. GQA/MQA and dim_qk != dim_v (MLA) are native. Not expressible: fp32 (cuDNN's
fused attention takes fp16/bf16), head dims that are not a multiple of 8; whatever cuDNN refuses when the graph is
built comes back as Refused with cuDNN's message.
"""
from .adapter import Adapter, Outcome, Refused
from .environment import CUDNN_DISTRIBUTIONS, packages


class CudnnThd(Adapter):
    name = "cudnn"

    def __init__(self, deterministic=False, **options):
        super().__init__(deterministic, **options)
        import cudnn
        import torch
        from . import cudnn_thd
        self.cudnn, self.torch, self.thd = cudnn, torch, cudnn_thd
        self.handle = cudnn.create_handle()
        self.graphs = {}

    def versions(self):
        """The environment (CUDA, the device, the driver, the libcudnn files mapped, torch's own cuDNN), the cuDNN
        the frontend runs (its backend version) and the frontend's version, with their distributions."""
        try:
            backend = self.cudnn.backend_version_string()
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            backend = f"error: {type(e).__name__}: {e}"
        return {**super().versions(), "cudnn": backend, "frontend": self.cudnn.__version__,
                **packages("nvidia-cudnn-frontend", *CUDNN_DISTRIBUTIONS)}

    def unsupported(self, fx):
        if fx.dtype not in ("bf16", "fp16"):
            return f"dtype {fx.dtype}: cuDNN fused attention takes fp16/bf16"
        if fx.dim_qk % 8 or fx.dim_v % 8:
            return f"head dims {fx.dim_qk}/{fx.dim_v}: cuDNN needs multiples of 8"
        if fx.max_seqlen("q") == 0:
            return "no query token in the batch"
        return None

    def graph(self, fx):
        torch, thd = self.torch, self.thd
        key = (fx.dtype, fx.heads_q, fx.heads_kv, fx.dim_qk, fx.dim_v, fx.causal, fx.window, fx.softmax_scale,
               thd.bucket(fx.num_sequences, 4), thd.bucket(fx.max_seqlen("q"), 64), thd.bucket(fx.max_seqlen("kv"), 64))
        if key not in self.graphs:
            try:
                self.graphs[key] = thd.ThdAttention(self.handle, torch.bfloat16 if fx.dtype == "bf16" else
                                                    torch.float16, *key[1:5], *key[8:11], fx.softmax_scale,
                                                    fx.causal, fx.window)
            except (self.cudnn.cudnnGraphNotSupportedError, RuntimeError) as e:
                self.graphs[key] = e
        if isinstance(self.graphs[key], Exception):
            raise Refused(f"cuDNN refuses the graph: {self.graphs[key]}")
        return self.graphs[key]

    def run(self, fx):
        torch = self.torch
        att = self.graph(fx)
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
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
        built = sum(not isinstance(g, Exception) for g in self.graphs.values())
        return Outcome(outputs={"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, backend="cuDNN SDPA (THD)",
                       notes={"graphs_built": built})
