#!/usr/bin/env python3
"""PyTorch's varlen_attn (FlashAttention-2 inside) checked against cpgold fixtures, forward and backward, global and
per rank.

    python3 python/examples/check_varlen_attn.py --cpgold build/bin/cpgold --summary varlen.json DIR...

How the fixture maps onto the kernel: varlen_attn has no per-sequence used length for queries (no seqused_q), so
the valid tokens are compacted sequence after sequence and cu_seqlens are the actual lengths; the outputs are
scattered back into the padded layout with zeros on pad rows. GQA/MQA by repeating each KV head hq/hkv times; the
gradients of the repeated heads are summed in float32. Not expressible: fp32 (FlashAttention-2 takes fp16/bf16),
dim_qk != dim_v (MLA), head dims that are not a multiple of 8 or above 256, windows when the installed varlen_attn
has no window_size.
"""
import inspect
import sys

import torch
from torch.nn.attention import varlen as torch_varlen

import kernel_sweep


class VarlenAttn:
    name = "varlen"

    def __init__(self):
        self.params = inspect.signature(torch_varlen.varlen_attn).parameters
        self.signature = str(inspect.signature(torch_varlen.varlen_attn))
        self.lse_shapes = set()  # what the installed torch returns, recorded in the summary

    def unsupported(self, fx):
        if fx.dtype not in ("bf16", "fp16"):
            return f"dtype {fx.dtype}: FlashAttention-2 takes fp16/bf16"
        if fx.dim_qk != fx.dim_v:
            return f"dim_qk {fx.dim_qk} != dim_v {fx.dim_v}: FlashAttention-2 needs equal head dims"
        if fx.dim_qk % 8 or fx.dim_qk > 256:
            return f"head dim {fx.dim_qk}: FlashAttention-2 needs a multiple of 8 up to 256"
        windowed = fx.window[0] >= 0 or (fx.window[1] >= 0 and not fx.causal)
        if windowed and "window_size" not in self.params:
            return f"window {list(fx.window)}: this varlen_attn has no window_size"
        if "scale" not in self.params and abs(fx.softmax_scale * fx.dim_qk ** 0.5 - 1) > 1e-12:
            return f"softmax_scale {fx.softmax_scale}: this varlen_attn has no scale argument"
        return None

    def __call__(self, fx):
        x = fx.inputs("torch", "cuda")
        q = fx.compact(x["q"], "q").detach().requires_grad_()
        dout = fx.compact(x["dout"], "q")
        group = fx.heads_q // fx.heads_kv
        # Repeated KV heads are leaves of their own, so their gradients come back per query head.
        k = fx.compact(x["k"], "kv").repeat_interleave(group, dim=1).detach().requires_grad_()
        v = fx.compact(x["v"], "kv").repeat_interleave(group, dim=1).detach().requires_grad_()
        cu_q = torch.as_tensor(fx.cu_seqlens("q"), dtype=torch.int32, device="cuda")
        cu_kv = torch.as_tensor(fx.cu_seqlens("kv"), dtype=torch.int32, device="cuda")
        kwargs = {"return_aux": torch_varlen.AuxRequest(lse=True)}
        if "scale" in self.params:
            kwargs["scale"] = fx.softmax_scale
        if "window_size" in self.params:
            kwargs["window_size"] = list(fx.window)
        elif fx.causal:
            kwargs["is_causal"] = True
        out, lse = torch_varlen.varlen_attn(q, k, v, cu_q, cu_kv, max(fx.max_seqlen("q"), 1),
                                            max(fx.max_seqlen("kv"), 1), **kwargs)
        dq, dk_rep, dv_rep = torch.autograd.grad(out, (q, k, v), dout)
        t_kv = k.shape[0]
        dk = dk_rep.float().view(t_kv, fx.heads_kv, group, fx.dim_qk).sum(2)
        dv = dv_rep.float().view(t_kv, fx.heads_kv, group, fx.dim_v).sum(2)
        self.lse_shapes.add(f"{list(lse.shape)} for {q.shape[0]} tokens, {fx.heads_q} heads")
        if lse.dim() == 2 and lse.shape[0] != fx.heads_q:
            lse = lse.transpose(0, 1)  # [t, h] -> [h, t]
        return {"o": fx.expand(out.detach(), "q"), "lse": fx.expand(lse.float(), "q", axis=1, fill=float("-inf")),
                "dq": fx.expand(dq, "q"), "dk": fx.expand(dk, "kv"), "dv": fx.expand(dv, "kv")}


def header(kernel):
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; varlen_attn{kernel.signature}", flush=True)
    return kernel


def summary_extra(kernel):
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "signature": kernel.signature,
            "lse_shapes_seen": sorted(kernel.lse_shapes)[:5]}


if __name__ == "__main__":
    sys.exit(kernel_sweep.main(lambda: header(VarlenAttn()), __doc__.splitlines()[1], summary_extra))
