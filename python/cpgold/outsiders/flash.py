"""FlashAttention as outsiders: PyTorch's varlen_attn (FlashAttention-2 inside), FlashAttention-3
(`flash_attn_interface`, built from FlashAttention's hopper/) and FlashAttention-4 (`flash_attn.cute`, CuTe DSL).

How a fixture's case becomes their arguments (docs/outsiders.md):
  FA3/FA4  q, k, v stay in the fixture's padded layout; cu_seqlens_q/k are the padded offsets (cu_seqlens_*_padded)
           and seqused_q/k the true lengths, so no pad row is read as a token. Their pad rows of O, dQ, dK, dV are
           never written (the maintainers say so), so their outputs are checked with `--pad-rows unwritten`.
           GQA/MQA and dim_qk != dim_v are native. Masks are bottom-right aligned, as the fixture's.
  FA2      varlen_attn has no seqused_q: the valid tokens are compacted and the outputs scattered back with zeros on
           pad rows; GQA by repeating KV heads, their gradients summed in float32.
Nothing is adapted to make a case fit: what the library refuses at run time comes back as Refused with its message.
The functions that build arguments need only numpy and a fixture, so they are tested on any machine (CPU, fakes).
"""
import importlib
import inspect
import threading

import numpy as np

from .adapter import Adapter, Outcome, Refused
from .environment import FA4_RUNS_ON, build_of, packages


def flash_attn_versions():
    """The installed FlashAttention-3 and -4 distributions, as pip knows them ("not installed" otherwise)."""
    return packages("flash-attn-3", "flash-attn-4")


_COMPILE_LOCK = threading.RLock()


def serialize_cute_compiles():
    """FlashAttention-4 compiles its kernels on first use with the CuTe DSL (`cute.compile`). The DSL is one object
    per process, and its AST preprocessor keeps one session at a time (`DSLPreprocessor._session_data`): two thread
    ranks compiling at once end each other's session ("Please start a session before accessing session data"). Under
    thread ranks every compile therefore takes one process-wide lock. A compile waits for no other rank, so the lock
    cannot deadlock the ranks, and launches of compiled kernels do not take it. Returns whether the DSL is here (and
    now serialized)."""
    import importlib.util

    if importlib.util.find_spec("cutlass") is None:
        return False
    from cutlass.base_dsl.compiler import CompileCallable

    original = CompileCallable._compile
    if getattr(original, "cpgold_serialized", False):
        return True

    def _compile(self, *args, **kwargs):
        with _COMPILE_LOCK:
            return original(self, *args, **kwargs)

    _compile.cpgold_serialized = True
    CompileCallable._compile = _compile
    return True


def padded_lengths(fx, side):
    """[B] int32: every sequence's padded length (the difference of its padded offsets)."""
    return np.diff(fx.cu_seqlens(side, padded=True)).astype(np.int32)


def fa3_window(fx):
    """FlashAttention-3's window_size: (left, right) with -1 unbounded; causal fixes the right side at 0."""
    left, right = (int(w) for w in fx.window)
    return (left if left >= 0 else -1, 0 if fx.causal else (right if right >= 0 else -1))


def fa4_window(fx):
    """FlashAttention-4's window_size: None for an unbounded side (it does not take -1 on one side only)."""
    left, right = fa3_window(fx)
    return (None if left < 0 else left, None if right < 0 else right)


def seqused_arguments(fx):
    """The varlen arguments of FA3 and FA4 for padding between sequences, as int32 numpy arrays and ints:
    padded offsets as cu_seqlens, true lengths as seqused, max_seqlen the longest padded range.

    max_seqlen_k is the true longest K range, 0 when every K range is empty (it was raised to 1 before, describing a
    key that is not there). FlashAttention-3's varlen entry (built by lab/outsiders/build_fa3.sh) takes it
    as the K length for its tile sizes and window normalisation, with no lower bound, and starts no kernel for a K
    without rows. lab/outsiders/fa3_empty_k_repro.py runs 16 queries on no keys with 1 and with 0 on a
    GPU, each in a child process, so that a crash of either shows as such. max_seqlen_q is kept at least 1."""
    return {"cu_seqlens_q": fx.cu_seqlens("q", padded=True), "cu_seqlens_k": fx.cu_seqlens("kv", padded=True),
            "seqused_q": fx.seqlens("q"), "seqused_k": fx.seqlens("kv"),
            "max_seqlen_q": max(int(padded_lengths(fx, "q").max(initial=0)), 1),
            "max_seqlen_k": int(padded_lengths(fx, "kv").max(initial=0)),
            "softmax_scale": float(fx.softmax_scale), "causal": bool(fx.causal)}


def lse_rows_ht(lse, heads):
    """An LSE as the library returns it, [h, t] (FA2/FA3/FA4 varlen) or [t, h]: as [h, t]."""
    if lse.dim() == 2 and lse.shape[0] != heads:
        return lse.transpose(0, 1)
    return lse


def _torch():
    import torch
    return torch


def _to_device(args, device):
    torch = _torch()
    return {k: torch.as_tensor(v, dtype=torch.int32, device=device) if isinstance(v, np.ndarray) else v
            for k, v in args.items()}


class refusals:
    """Turns the library's refusals of a configuration (its asserts, argument errors and TORCH_CHECK messages)
    into Refused, naming the pass; CUDA errors and crashes stay errors."""

    def __init__(self, where):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is None:
            return False
        if issubclass(kind, (AssertionError, ValueError, NotImplementedError, TypeError)) or (
                issubclass(kind, RuntimeError) and "CUDA error" not in str(e) and "illegal" not in str(e)):
            raise Refused(f"{self.where}: {kind.__name__}: {str(e).strip()[:600]}") from e
        return False


def _run_padded(fx, call, device, deterministic):
    """Forward and backward of a seqused kernel on the padded layout; outputs in the fixture's global layout.
    `call(fx, q, k, v, arguments, deterministic)` returns (out, lse)."""
    torch = _torch()
    x = fx.inputs("torch", device)
    q, k, v = (x[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    args = _to_device(seqused_arguments(fx), device)
    with refusals("forward"):
        out, lse = call(fx, q, k, v, args, deterministic)
    with refusals("backward"):  # some configurations are refused only by the backward (FA4: GQA with d != dv)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["dout"])
    return {"o": out.detach(), "lse": lse_rows_ht(lse.detach().float(), fx.heads_q), "dq": dq, "dk": dk, "dv": dv}


class _FlashAdapter(Adapter):
    module_name = ""
    runs_on = ()   # distributions the library runs on, recorded with their versions
    dtypes = ("bf16", "fp16")
    isolate = True   # a crash of the library (SIGSEGV, a device-side assert) costs only its fixture (--in-process: not)

    def __init__(self, deterministic=False, device="cuda", **options):
        super().__init__(deterministic, **options)
        self.device = device
        self.module = importlib.import_module(self.module_name)
        self.function = self.module.flash_attn_varlen_func
        self.signature = str(inspect.signature(self.function))

    def unsupported(self, fx):
        if fx.dtype not in self.dtypes:
            return f"dtype {fx.dtype}: {self.label} takes {'/'.join(self.dtypes)}"
        return None

    def run(self, fx):
        torch = _torch()
        outputs = _run_padded(fx, self.call, self.device, self.deterministic)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return Outcome(outputs=outputs, backend=self.label)

    def versions(self):
        """The environment, the library's distribution (and its build where the wheel records one), the packages it
        runs on (FA4: the CuTe DSL, quack, TVM FFI), the module's file; cuDNN is not used by these kernels."""
        return {**super().versions(), "library": f"{self.distribution} {_distribution_version(self.distribution)}",
                f"{self.distribution} build": build_of(self.distribution), **packages(*self.runs_on),
                "module": getattr(self.module, "__file__", "?"), "cudnn": "not used"}


def _distribution_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - a build without metadata
        return "unknown"


class FlashAttn3(_FlashAdapter):
    """FlashAttention-3 (`flash_attn_interface.flash_attn_varlen_func`), padded offsets plus seqused_q/k."""
    name, label, module_name, distribution = "fa3", "FlashAttention-3", "flash_attn_interface", "flash-attn-3"
    pad_rows = "unwritten"

    def call(self, fx, q, k, v, args, deterministic):
        result = self.function(q, k, v, window_size=fa3_window(fx), deterministic=deterministic,
                               return_attn_probs=True, **args)
        return result[0], result[1]


class FlashAttn4(_FlashAdapter):
    """FlashAttention-4 (`flash_attn.cute.flash_attn_varlen_func`), padded offsets plus seqused_q/k."""
    name, label, module_name, distribution = "fa4", "FlashAttention-4", "flash_attn.cute", "flash-attn-4"
    pad_rows = "unwritten"
    runs_on = FA4_RUNS_ON

    def call(self, fx, q, k, v, args, deterministic):
        return self.function(q, k, v, window_size=fa4_window(fx), deterministic=deterministic, return_lse=True,
                             **args)


class VarlenAttn(Adapter):
    """PyTorch's varlen_attn (FlashAttention-2 inside): valid tokens compacted (it has no seqused_q), outputs
    scattered back with zeros on pad rows. Not expressible: fp32, dim_qk != dim_v, head dims not a multiple of 8 or
    above 256, windows or a softmax scale when the installed varlen_attn has no such argument."""
    name = "varlen"
    isolate = True   # FlashAttention-2 kernels: a crash costs only its fixture, as for FA3/FA4

    def __init__(self, deterministic=False, device="cuda", **options):
        super().__init__(deterministic, **options)
        from torch.nn.attention import varlen as torch_varlen
        self.varlen = torch_varlen
        self.device = device
        self.params = inspect.signature(torch_varlen.varlen_attn).parameters
        self.signature = str(inspect.signature(torch_varlen.varlen_attn))

    def versions(self):
        """The environment (torch, its CUDA and cuDNN, the device, the driver) and varlen_attn's signature."""
        return {**super().versions(), "varlen_attn": self.signature}

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

    def run(self, fx):
        torch = _torch()
        x = fx.inputs("torch", self.device)
        q = fx.compact(x["q"], "q").detach().requires_grad_()
        dout = fx.compact(x["dout"], "q")
        group = fx.heads_q // fx.heads_kv
        # Repeated KV heads are leaves of their own, so their gradients come back per query head.
        k = fx.compact(x["k"], "kv").repeat_interleave(group, dim=1).detach().requires_grad_()
        v = fx.compact(x["v"], "kv").repeat_interleave(group, dim=1).detach().requires_grad_()
        cu_q = torch.as_tensor(fx.cu_seqlens("q"), dtype=torch.int32, device=self.device)
        cu_kv = torch.as_tensor(fx.cu_seqlens("kv"), dtype=torch.int32, device=self.device)
        kwargs = {"return_aux": self.varlen.AuxRequest(lse=True)}
        if "scale" in self.params:
            kwargs["scale"] = fx.softmax_scale
        if "window_size" in self.params:
            kwargs["window_size"] = list(fx.window)
        elif fx.causal:
            kwargs["is_causal"] = True
        out, lse = self.varlen.varlen_attn(q, k, v, cu_q, cu_kv, max(fx.max_seqlen("q"), 1),
                                           max(fx.max_seqlen("kv"), 1), **kwargs)
        dq, dk_rep, dv_rep = torch.autograd.grad(out, (q, k, v), dout)
        t_kv = k.shape[0]
        dk = dk_rep.float().view(t_kv, fx.heads_kv, group, fx.dim_qk).sum(2)
        dv = dv_rep.float().view(t_kv, fx.heads_kv, group, fx.dim_v).sum(2)
        lse = lse_rows_ht(lse, fx.heads_q)
        outputs = {"o": fx.expand(out.detach(), "q"), "lse": fx.expand(lse.float(), "q", axis=1, fill=float("-inf")),
                   "dq": fx.expand(dq, "q"), "dk": fx.expand(dk, "kv"), "dv": fx.expand(dv, "kv")}
        return Outcome(outputs=outputs, backend="varlen_attn (FlashAttention-2)")
