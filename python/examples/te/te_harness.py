"""TransformerEngine's attention on cpgold fixtures: how a fixture's case becomes TE's arguments, and what TE said.

Shared by check_te_dpa.py (non-CP), check_te_cp.py (CP with W thread ranks on one GPU) and check_te_helpers.py
(the THD CP helper kernels). Import it after setting TE's environment (te_environment() does it: FusedAttention
only, NVTE_DEBUG=1, NVTE_DEBUG_LEVEL=2).

Translation of a case (docs/outsiders.md, "TransformerEngine"):
  mask causal  -> attn_mask_type "padding_causal" when every sequence has L_q == L_kv (both alignments coincide),
                  "padding_causal_bottom_right" otherwise (the fixture's mask is bottom-right aligned);
  mask none    -> "padding";
  window       -> window_size=(left, right) as stored (FlashAttention-3's normalised form), omitted when unbounded;
  THD          -> qkv_format "thd", cu_seqlens_* (actual) and cu_seqlens_*_padded (physical offsets), so TE sets
                  pad_between_seqs itself; max_seqlen_* left to TE, as TE's own CP tests do.
Nothing else is adapted: a case TE refuses is recorded with TE's message, never changed to fit.
"""
import logging
import os
import threading

import numpy as np

TE_ENV = {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0", "NVTE_DEBUG": "1",
          "NVTE_DEBUG_LEVEL": "2"}


def te_environment():
    """TE reads these at import: FusedAttention (cuDNN) as the only backend, its debug log on."""
    for k, v in TE_ENV.items():
        os.environ.setdefault(k, v)


te_environment()
import torch  # noqa: E402
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
import transformer_engine_torch as tex  # noqa: E402
from transformer_engine.pytorch.attention.dot_product_attention import backends as te_backends  # noqa: E402
from transformer_engine.pytorch.attention.dot_product_attention import context_parallel as te_cp  # noqa: E402
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa  # noqa: E402


def versions():
    """Versions as the libraries report them (TE loads its own cuDNN: torch's cuDNN check may refuse then)."""
    try:
        te_cudnn = ".".join(str(x) for x in te_dpa.dpa_utils.get_cudnn_version())
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        te_cudnn = f"unknown ({type(e).__name__})"
    return {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn_te": te_cudnn, "device": torch.cuda.get_device_name(0),
            "compute_capability": "sm%d%d" % torch.cuda.get_device_capability(0)}


class Refused(Exception):
    """TE refused the configuration (an assert, a gating message, no backend): not a wrong result."""


# ------------------------------------------------------------------ what TE logged and chose
class TeLog(logging.Handler):
    """Collects TE's attention log records (NVTE_DEBUG) per thread, so each rank keeps its own lines."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records = {}
        self.records_lock = threading.Lock()   # not Handler.lock, which handle() already holds around emit()

    def emit(self, record):
        with self.records_lock:
            self.records.setdefault(threading.get_ident(), []).append(f"[{record.name}] {record.getMessage()}")

    def take(self):
        with self.records_lock:
            return self.records.pop(threading.get_ident(), [])


TE_LOG = TeLog()
for _name in ("DotProductAttention", "FlashAttention", "FusedAttention", "UnfusedDotProductAttention",
              te_dpa.__name__, "transformer_engine.pytorch.attention.dot_product_attention.utils"):
    logging.getLogger(_name).addHandler(TE_LOG)


def backend_chosen():
    """TE's cached backend selection (dot_product_attention._attention_backends): the backend of the last call."""
    b = te_dpa._attention_backends
    if b.get("use_fused_attention"):
        return f"FusedAttention (sub-backend {int(b.get('fused_attention_backend'))})"
    if b.get("use_flash_attention"):
        return f"FlashAttention ({b.get('flash_attention_backend')})"
    if b.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return "none"


def debug_summary(lines):
    """The lines that say what TE ran and why: backend choice, disabling reasons, the run config."""
    keep = [ln for ln in lines if "Running with" in ln or "Disabling" in ln or "config" in ln.lower()]
    return keep[:12]


# ------------------------------------------------------------------ softmax statistics from the fused call
class StatsSpy:
    """Wraps TE's fused_attn_fwd where the attention backends and the CP code call it, keeping the softmax
    statistics (aux_ctx_tensors[0]) of every forward call of the current thread."""

    def __init__(self):
        self.calls = {}
        self.lock = threading.Lock()
        self.original = te_backends.fused_attn_fwd

    def __enter__(self):
        original = self.original

        def spy(*args, **kwargs):
            result = original(*args, **kwargs)
            out, aux = result[0], result[1]
            with self.lock:
                self.calls.setdefault(threading.get_ident(), []).append(
                    {"stats": aux[0] if aux else None, "kwargs": {k: v for k, v in kwargs.items()
                                                                  if isinstance(v, (int, float, str, tuple, bool))}})
            return result

        te_backends.fused_attn_fwd = spy
        if hasattr(te_cp, "fused_attn_fwd"):
            te_cp.fused_attn_fwd = spy
        return self

    def __exit__(self, *exc):
        te_backends.fused_attn_fwd = self.original
        if hasattr(te_cp, "fused_attn_fwd"):
            te_cp.fused_attn_fwd = self.original

    def take(self):
        with self.lock:
            return self.calls.pop(threading.get_ident(), [])


def poison_cuda_cache():
    """Fills the CUDA caching allocator's free memory with 0xFF bytes (NaN in fp16, bf16 and fp32), small and large
    blocks: a kernel that later reads memory nobody wrote then reads NaN, not whatever an earlier call left."""
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF) for n in [1 << 16] * 256 + [1 << 24] * 16]
    torch.cuda.synchronize()
    del keep


class RowIndex:
    """Where a row of a tensor TE hands its kernel comes from: every (row, head) vector of the fixture's global q
    and k is keyed by its bytes (in float32, where bf16/fp16 values are exact) and mapped to its global row, the
    rank owning that row (the partition) and whether the row holds a token or is padding. All-zero vectors and
    vectors that occur more than once are left out (ambiguous)."""

    def __init__(self, fx, limit=400_000):
        self.ok = True
        g = fx.inputs()
        self.maps, self.owner, self.valid = {}, {}, {}
        for side, name in (("q", "q"), ("kv", "k")):
            x = np.ascontiguousarray(np.asarray(g[name], dtype=np.float32))
            t, h = x.shape[0], x.shape[1]
            if t * h > limit:
                self.ok = False
                return
            owner = np.full(t, -1, dtype=np.int64)
            for r in range(fx.cp_size):
                owner[fx.partitioned_indices(r, side)] = r
            self.owner[side], self.valid[side] = owner, fx.valid_rows(side)
            seen = {}
            for row in range(t):
                for head in range(h):
                    v = x[row, head]
                    if not np.any(v):
                        continue
                    key = v.tobytes()
                    seen[key] = -1 if key in seen else row
            self.maps[side] = seen

    def describe(self, tensor, side, offsets, counts):
        """Per sequence slot b: the global rows the kernel reads as tokens (offsets[b], counts[b] rows): how many
        come from each rank, how many are padding rows, how many match no input row, and the global row range."""
        x = tensor.detach().float().cpu().numpy()
        m, owner, valid = self.maps[side], self.owner[side], self.valid[side]
        out = {"from_rank": {}, "pad_rows": 0, "unknown": 0, "zero": 0, "slots": []}
        for b, (off, n) in enumerate(zip(offsets, counts)):
            rows = []
            for row in range(int(off), int(off) + int(n)):
                if row >= x.shape[0]:
                    out["unknown"] += 1
                    continue
                hits = set()
                for head in range(x.shape[1]):
                    v = x[row, head]
                    if not np.any(v):
                        out["zero"] += 1
                        continue
                    g = m.get(v.tobytes())
                    if g is None or g < 0:
                        out["unknown"] += 1
                        continue
                    hits.add(g)
                for g in hits:
                    rows.append(g)
                    key = str(int(owner[g]))
                    out["from_rank"][key] = out["from_rank"].get(key, 0) + 1
                    if not valid[g]:
                        out["pad_rows"] += 1
            out["slots"].append([min(rows), max(rows), len(rows)] if rows else None)
        return out


def _values(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist() if x.numel() <= 4096 else f"tensor{tuple(x.shape)}"
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if isinstance(x, (tuple, list)) and all(isinstance(v, (int, float, bool)) or v is None for v in x):
        return list(x)
    return type(x).__name__


class CallSpy:
    """Wraps fused_attn_fwd and fused_attn_bwd where TE's attention backends and CP code call them and records,
    per thread and in call order, the arguments each kernel call receives: max_seqlen_q/kv, cu_seqlens_q/kv, the
    padded offsets, attn_mask_type, window_size, bottom_right_diagonal, the shapes of q, k, v, and (with a
    RowIndex) where the q and k rows it reads as tokens come from. These are what cpgold's replay of TE
    (`cpgold explain --te-audit --format json`) predicts per rank and step."""

    FWD = ("is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v")
    BWD = ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v")
    KEEP = ("cu_seqlens_q_padded", "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "bottom_right_diagonal",
            "qkv_layout", "attn_scale")

    def __init__(self, index=None):
        self.index = index
        self.calls = {}
        self.lock = threading.Lock()
        self.saved = []

    def _wrap(self, original, names, kind):
        def spy(*args, **kwargs):
            named = dict(zip(names, args))
            rec = {"pass": kind}
            for k in ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv"):
                rec[k] = _values(named.get(k))
            for k in self.KEEP:
                if k in kwargs:
                    rec[k] = _values(kwargs[k])
            for k in ("q", "k", "v"):
                if isinstance(named.get(k), torch.Tensor):
                    rec[f"{k}_shape"] = list(named[k].shape)
            if self.index is not None and self.index.ok and named.get("q") is not None and named["q"].dim() == 3:
                try:
                    for side, name, cu, pad in (("q", "q", "cu_seqlens_q", "cu_seqlens_q_padded"),
                                                ("kv", "k", "cu_seqlens_kv", "cu_seqlens_kv_padded")):
                        c = np.asarray(rec[cu], dtype=np.int64)
                        off = np.asarray(rec.get(pad) if isinstance(rec.get(pad), list) else c[:-1], dtype=np.int64)
                        rec[f"{name}_rows"] = self.index.describe(named[name], side, off[:len(c) - 1], np.diff(c))
                except Exception as e:  # noqa: BLE001 - recorded: the spy must not change what TE does
                    rec["rows_error"] = f"{type(e).__name__}: {e}"
            with self.lock:
                self.calls.setdefault(threading.get_ident(), []).append(rec)
            return original(*args, **kwargs)
        return spy

    def __enter__(self):
        for mod in (te_backends, te_cp):
            for name, names, kind in (("fused_attn_fwd", self.FWD, "forward"), ("fused_attn_bwd", self.BWD,
                                                                                 "backward")):
                if hasattr(mod, name):
                    orig = getattr(mod, name)
                    self.saved.append((mod, name, orig))
                    setattr(mod, name, self._wrap(orig, names, kind))
        return self

    def __exit__(self, *exc):
        for mod, name, orig in reversed(self.saved):
            setattr(mod, name, orig)
        self.saved.clear()

    def take(self):
        with self.lock:
            return self.calls.pop(threading.get_ident(), [])


def stats_to_lse(stats, fx, t, heads):
    """TE's softmax statistics -> LSE [h, t] over the padded Q rows. THD with cuDNN on sm90 keeps them packed,
    [t, h, 1] at the physical row (the ragged offset of the stats is cu_seqlens_q_padded); [B, h, S, 1] otherwise,
    row i of sequence b at padded offset b + i. Rows that hold no token get -inf (never compared)."""
    s = stats.detach().float()
    lse = torch.full((heads, t), float("-inf"), dtype=torch.float32, device=s.device)
    off, lens = fx.cu_seqlens("q", padded=True), fx.seqlens("q")
    if s.dim() == 3 and s.shape[0] >= t and s.shape[1] == heads:
        layout = "packed [t, h, 1] at the padded row"
        for b, n in enumerate(lens):
            if n:
                lse[:, off[b]:off[b] + n] = s[off[b]:off[b] + n, :, 0].T
    elif s.dim() == 4 and s.shape[1] == heads:
        layout = "[B, h, S, 1]"
        for b, n in enumerate(lens):
            if n:
                lse[:, off[b]:off[b] + n] = s[b, :, :n, 0]
    else:
        raise RuntimeError(f"softmax statistics of shape {tuple(s.shape)}: not a layout this harness knows")
    return lse, layout


# ------------------------------------------------------------------ the case as TE's arguments
def torch_dtype(fx):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fx.dtype]


def mask_type(fx):
    if not fx.causal:
        return "padding"
    same = np.array_equal(fx.seqlens("q"), fx.seqlens("kv"))
    return "padding_causal" if same else "padding_causal_bottom_right"


def window_size(fx):
    left, right = fx.window
    if fx.causal:
        right = 0
    if left < 0 and (right < 0 or fx.causal):
        return None
    return (int(left), int(right))


def te_arguments(fx):
    """The DotProductAttention constructor arguments for a fixture's case (see the module docstring)."""
    kwargs = dict(num_attention_heads=fx.heads_q, kv_channels=(fx.dim_qk, fx.dim_v), num_gqa_groups=fx.heads_kv,
                  attention_dropout=0.0, qkv_format="thd", attn_mask_type=mask_type(fx),
                  softmax_scale=float(fx.softmax_scale))
    w = window_size(fx)
    if w is not None:
        kwargs["window_size"] = w
    return kwargs


def cu_tensors(fx, device="cuda"):
    return {f"cu_seqlens_{side}{suffix}": torch.as_tensor(fx.cu_seqlens(side, padded=padded), dtype=torch.int32,
                                                          device=device)
            for side in ("q", "kv") for suffix, padded in (("", False), ("_padded", True))}


def make_dpa(fx):
    try:
        return te.DotProductAttention(**te_arguments(fx))
    except (AssertionError, ValueError, NotImplementedError) as e:
        raise Refused(f"DotProductAttention({te_arguments(fx)}): {type(e).__name__}: {e}") from e


def run_dpa(dpa, fx, q, k, v, dout, cu):
    """Forward and backward of one DotProductAttention call. q, k, v, dout: [t, h, d] on the GPU in the case dtype.
    Returns o, dq, dk, dv as [t, h, d] tensors, plus TE's log lines and backend. TE's refusals raise Refused."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    TE_LOG.take()
    try:
        o = dpa(q, k, v, **cu)
    except (AssertionError, ValueError, NotImplementedError) as e:
        raise Refused(f"{type(e).__name__}: {str(e).strip()[:600]}") from e
    o3 = o.view(o.shape[0], fx.heads_q, fx.dim_v)
    o.backward(dout.reshape(o.shape))
    return {"o": o3.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, TE_LOG.take(), backend_chosen()
