"""TransformerEngine's attention as an outsider: `DotProductAttention` non-CP (adapter `te`) and its context
parallelism with W thread ranks on one GPU (adapter `te_cp`), with the backend TE's own variables select:
FusedAttention (cuDNN, `backend="fused"`) or FlashAttention (`backend="flash"`: FlashAttention-3 where
`flash-attn-3` is installed, else FlashAttention-4 where `flash-attn-4` is; TE says which in its debug lines).

Translation of a case (docs/outsiders.md, "TransformerEngine"):
  mask causal  -> attn_mask_type "padding_causal" when every sequence has L_q == L_kv (both alignments coincide),
                  "padding_causal_bottom_right" otherwise (the fixture's mask is bottom-right aligned);
  mask none    -> "padding";
  window       -> window_size=(left, right) as stored (FlashAttention-3's normalised form), omitted when unbounded;
  THD          -> qkv_format "thd", cu_seqlens_* (actual) and cu_seqlens_*_padded (physical offsets), so TE sets
                  pad_between_seqs itself; max_seqlen_* left to TE, as TE's own CP tests do.
  CP           -> set_context_parallel_group(group, ranks, stream, comm) as TE's CP tests call it (a2a+p2p: [a2a
                  group, p2p group], a2a groups of consecutive ranks) on the fixture's rank-local inputs (TE's
                  dual-chunk layout, what thd_get_partitioned_indices selects) with the global cu_seqlens.
Nothing else is adapted: a case TE refuses is recorded with TE's message, never changed to fit. TE reads its
variables when it is imported: one process runs one backend (the runner starts a child per adapter anyway).

LSE: the non-CP FusedAttention path gives its softmax statistics (captured from fused_attn_fwd); TE's CP API and its
FlashAttention path give none, so LSE is not checked there (the summary says so per fixture).
"""
import logging
import os
import threading
import types

import numpy as np

from .adapter import Adapter, Outcome, Refused, as_refusal, library_refusals
from .environment import CUDNN_DISTRIBUTIONS, FA4_RUNS_ON, build_of, environment, packages
from .flash import flash_attn_versions, serialize_cute_compiles
from .rank_adapter import cp_group_ranks

BACKENDS = {"fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
            "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}}
DEBUG = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
TENSORS = ("o", "dq", "dk", "dv")
TE_DISTRIBUTIONS = ("transformer_engine_torch", "transformer_engine_cu12")   # beside transformer_engine.__version__


def te_environment(backend, deterministic=False, thread_ranks=False):
    """The variables TE reads at import for a run: the backend, its debug log, deterministic backward
    (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) and, under thread ranks, TE's torch.compile'd helpers run eagerly
    (NVTE_TORCH_COMPILE=0: dynamo refuses to be traced from several threads, a setting TE supports)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    env = {**BACKENDS[backend], **DEBUG, "NCCL_NVLS_ENABLE": "0"}
    if deterministic:
        env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    if thread_ranks:
        env["NVTE_TORCH_COMPILE"] = "0"
    return env


_LOADED = {}   # the environment TE was imported with, and its modules


def load(env):
    """Imports TransformerEngine with `env` set. TE reads its variables at import: a second environment in the same
    process is refused rather than silently ignored."""
    if _LOADED:
        if _LOADED["env"] != env:
            raise RuntimeError(f"TransformerEngine was imported here with {_LOADED['env']}; {env} needs another "
                               "process")
        return _LOADED["m"]
    os.environ.update(env)
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.attention.dot_product_attention import backends as te_backends
    from transformer_engine.pytorch.attention.dot_product_attention import context_parallel as te_cp
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa
    m = types.SimpleNamespace(torch=torch, transformer_engine=transformer_engine, te=te, tex=tex,
                              te_backends=te_backends, te_cp=te_cp, te_dpa=te_dpa)
    for name in ("DotProductAttention", "FlashAttention", "FusedAttention", "UnfusedDotProductAttention",
                 te_dpa.__name__, "transformer_engine.pytorch.attention.dot_product_attention.utils"):
        logging.getLogger(name).addHandler(TE_LOG)
    _LOADED.update(env=dict(env), m=m)
    return m


def versions(m, backend=None):
    """The environment (environment.py: torch with its CUDA and its own cuDNN, or the error torch's cuDNN check
    gives when TE loaded another cuDNN first; the libcudnn files mapped; the device, the driver, NCCL, the NVTE_
    variables), TE's version and the cuDNN TE reports, TE's distributions, the installed FlashAttention-3 and -4 with
    what FA3's wheel records of its build, and under backend "flash" the packages FlashAttention-4 runs on (the CuTe
    DSL among them)."""
    try:
        te_cudnn = ".".join(str(x) for x in m.te_dpa.dpa_utils.get_cudnn_version())
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        te_cudnn = f"unknown ({type(e).__name__}: {str(e).strip()[:200]})"
    out = {**environment(), "transformer_engine": m.transformer_engine.__version__, "cudnn_te": te_cudnn,
           **packages(*TE_DISTRIBUTIONS, *CUDNN_DISTRIBUTIONS)}
    out.update(flash_attn_versions())
    out["flash-attn-3 build"] = build_of("flash-attn-3")
    if backend == "flash":
        out.update(packages(*FA4_RUNS_ON))
    return out


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


def backend_chosen(m):
    """TE's cached backend selection (dot_product_attention._attention_backends): the backend of the last call."""
    b = m.te_dpa._attention_backends
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


# ------------------------------------------------------------------ the case as TE's arguments (pure)
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


def cu_arrays(fx):
    """cu_seqlens_q/kv (actual) and cu_seqlens_q/kv_padded (physical offsets), int32 numpy arrays."""
    return {f"cu_seqlens_{side}{suffix}": fx.cu_seqlens(side, padded=padded)
            for side in ("q", "kv") for suffix, padded in (("", False), ("_padded", True))}


def stats_to_lse(torch, stats, fx, t, heads):
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


# ------------------------------------------------------------------ spies on TE's kernel calls
class StatsSpy:
    """Wraps TE's fused_attn_fwd where the attention backends and the CP code call it, keeping the softmax
    statistics (aux_ctx_tensors[0]) of every forward call of the current thread."""

    def __init__(self, m):
        self.m = m
        self.calls = {}
        self.lock = threading.Lock()
        self.original = m.te_backends.fused_attn_fwd

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

        self.m.te_backends.fused_attn_fwd = spy
        if hasattr(self.m.te_cp, "fused_attn_fwd"):
            self.m.te_cp.fused_attn_fwd = spy
        return self

    def __exit__(self, *exc):
        self.m.te_backends.fused_attn_fwd = self.original
        if hasattr(self.m.te_cp, "fused_attn_fwd"):
            self.m.te_cp.fused_attn_fwd = self.original

    def take(self):
        with self.lock:
            return self.calls.pop(threading.get_ident(), [])


def poison_cuda_cache(torch):
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
        for off, n in zip(offsets, counts):
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


def _values(torch, x):
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

    def __init__(self, m, index=None):
        self.m = m
        self.index = index
        self.calls = {}
        self.lock = threading.Lock()
        self.saved = []

    def _wrap(self, original, names, kind):
        torch = self.m.torch

        def spy(*args, **kwargs):
            named = dict(zip(names, args))
            rec = {"pass": kind}
            for k in ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv"):
                rec[k] = _values(torch, named.get(k))
            for k in self.KEEP:
                if k in kwargs:
                    rec[k] = _values(torch, kwargs[k])
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
        for mod in (self.m.te_backends, self.m.te_cp):
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


# ------------------------------------------------------------------ one DotProductAttention call
def make_dpa(m, fx):
    with library_refusals(f"DotProductAttention({te_arguments(fx)}): "):
        return m.te.DotProductAttention(**te_arguments(fx))


def run_dpa(m, dpa, fx, q, k, v, dout, cu):
    """Forward and backward of one DotProductAttention call. q, k, v, dout: [t, h, d] on the GPU in the case dtype.
    Returns o, dq, dk, dv as [t, h, d] tensors, plus TE's log lines and backend. TE's refusals raise Refused."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    TE_LOG.take()
    with library_refusals():
        o = dpa(q, k, v, **cu)
    o3 = o.view(o.shape[0], fx.heads_q, fx.dim_v)
    # some configurations are refused only by the backward (FA4: GQA, dim_qk != dim_v)
    with library_refusals("backward: "):
        o.backward(dout.reshape(o.shape))
    return {"o": o3.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, TE_LOG.take(), backend_chosen(m)


def run_cp_rank(m, fx, rank, cp_group, cp_global_ranks, cu, spy=None):
    """One CP rank of TE's DotProductAttention: set_context_parallel_group(cp_group (or [a2a group, p2p group]),
    cp_global_ranks, a CUDA stream, the fixture's comm type), THD forward and backward on the rank's shard with the
    global cu_seqlens. (outputs as float32 numpy in the rank-local layout, TE log summary, backend, spied calls)."""
    torch = m.torch
    dpa = make_dpa(m, fx)
    dpa.set_context_parallel_group(cp_group, cp_global_ranks, torch.cuda.Stream(), fx.comm)
    x = fx.rank_inputs(rank, "torch", "cuda")
    if spy is not None:
        spy.take()
    out, log, backend = run_dpa(m, dpa, fx, x["q"], x["k"], x["v"], x["dout"], cu)
    torch.cuda.current_stream().synchronize()
    calls = spy.take() if spy is not None else None
    return {n: out[n].float().cpu().numpy() for n in TENSORS}, debug_summary(log), backend, calls


class _TeAdapter(Adapter):
    thread_ranks = False

    def __init__(self, deterministic=False, backend="fused", **options):
        super().__init__(deterministic, **options)
        self.backend = backend
        self.env = te_environment(backend, deterministic, self.thread_ranks)
        self.m = load(self.env)

    def options(self):
        return {"deterministic": self.deterministic, "backend": self.backend}

    def versions(self):
        return {**versions(self.m, self.backend), "environment": self.env}

    def cu(self, fx):
        torch = self.m.torch
        return {k: torch.as_tensor(v, dtype=torch.int32, device="cuda") for k, v in cu_arrays(fx).items()}


class TeDotProductAttention(_TeAdapter):
    """TE's non-CP DotProductAttention on the whole batch; LSE from FusedAttention's softmax statistics."""
    name = "te"

    def run(self, fx):
        torch = self.m.torch
        x = fx.inputs("torch", "cuda")
        spy = StatsSpy(self.m)
        try:
            dpa = make_dpa(self.m, fx)
            with spy:
                spy.take()
                out, log, backend = run_dpa(self.m, dpa, fx, x["q"], x["k"], x["v"], x["dout"], self.cu(fx))
                calls = spy.take()
        except Refused as e:
            raise Refused(f"{e}\n" + "\n".join(debug_summary(TE_LOG.take()))) from None
        torch.cuda.synchronize()
        notes = {"arguments": te_arguments(fx), "fused_forward_calls": len(calls)}
        stats = [c["stats"] for c in calls if c["stats"] is not None]
        if len(stats) == 1:
            lse, layout = stats_to_lse(torch, stats[0], fx, x["q"].shape[0], fx.heads_q)
            notes["lse_from"] = f"fused_attn_fwd softmax statistics, {layout}"
            out["lse"] = lse
        else:
            notes["lse_from"] = f"none: {len(stats)} softmax statistics captured (FusedAttention gives 1)"
        return Outcome(outputs=out, backend=backend, log=debug_summary(log), notes=notes)


class TeContextParallel(_TeAdapter):
    """TE's CP (the fixture's comm type and W) with W thread ranks of cpgold.thread_ranks on one GPU. Options:
    timeout (seconds a rank waits for a peer), repeat (runs compared bit for bit), poison (NaN bytes in the CUDA
    cache's free memory before every run), trace (every fused-attention call per rank with the rows it reads)."""
    name = "te_cp"
    isolate = True
    thread_ranks = True
    tensors = TENSORS

    def __init__(self, deterministic=False, backend="fused", timeout=60.0, repeat=1, poison=False, trace=False,
                 **options):
        super().__init__(deterministic, backend, **options)
        self.timeout, self.repeat = float(timeout), int(repeat)
        self.poison, self.trace = bool(int(poison)), bool(int(trace))

    def options(self):
        return {**super().options(), "timeout": self.timeout, "repeat": self.repeat, "poison": int(self.poison),
                "trace": int(self.trace)}

    def unsupported(self, fx):
        return "not a CP fixture (cp_size 1): the adapter te runs it" if fx.cp_size < 2 else None

    def _rank(self, rank, ranks, fx, cu, spy):
        lists = cp_group_ranks(fx.comm, fx.cp_size, rank, fx.case.get("a2a_size"))
        groups = [ranks.new_group(r) if len(lists) > 1 else ranks.group() for r in lists]
        return run_cp_rank(self.m, fx, rank, groups if len(groups) > 1 else groups[0], list(range(fx.cp_size)),
                           cu, spy)

    def _run_ranks(self, fx, cu, spy):
        from cpgold.thread_ranks import ThreadRanks
        if self.backend == "flash":
            serialize_cute_compiles()   # FlashAttention-4's compiler is not safe for compiles from several threads
        if self.poison:
            poison_cuda_cache(self.m.torch)
        return ThreadRanks(fx.cp_size, device="cuda", timeout=self.timeout).run(
            lambda r, ranks: self._rank(r, ranks, fx, cu, spy))

    def run(self, fx):
        from ..cp_driver import _gather
        from ..thread_ranks import ThreadRankError
        cu = self.cu(fx)
        spy = CallSpy(self.m, RowIndex(fx)) if self.trace else None
        try:
            if spy is not None:
                with spy:
                    results = self._run_ranks(fx, cu, spy)
            else:
                results = self._run_ranks(fx, cu, None)
            differing = []
            for k in range(1, self.repeat):  # identical bits: the result does not depend on timing between ranks
                again = self._run_ranks(fx, cu, None)
                for r, (a, b) in enumerate(zip(results, again)):
                    for n in TENSORS:
                        if not np.array_equal(a[0][n], b[0][n], equal_nan=True):
                            d = np.abs(a[0][n].astype(np.float64) - b[0][n])
                            differing.append(f"run {k + 1} rank {r} {n}: max |difference| "
                                             f"{np.nanmax(d) if np.isfinite(d).any() else float('nan'):.3g}")
        except ThreadRankError as e:
            cause = e.__cause__
            if isinstance(cause, AssertionError):
                cause = as_refusal(cause) or cause
            if isinstance(cause, Refused):
                raise Refused(f"{cause}\n" + "\n".join(debug_summary(TE_LOG.take()))) from None
            raise
        outs = [r[0] for r in results]
        notes = {"arguments": te_arguments(fx), "lse_from": "none: TE's CP API returns no LSE"}
        if self.repeat > 1:
            notes.update(repeats=self.repeat, repeat_differences=differing)
        if self.trace:
            notes["calls"] = {str(r): res[3] for r, res in enumerate(results)}
        return Outcome(outputs=_gather(fx, outs), rank_outputs=outs, scope="cp_gathered",
                       backend=", ".join(sorted({r[2] for r in results})), log=results[0][1], notes=notes)


class TeContextParallelProcess(_TeAdapter):
    """TE's CP the way its users run it: one process per GPU (torchrun), NCCL process groups made by the harness
    (cpgold.outsiders.ranks, adapter te_cp there). Per rank what TeContextParallel does for a thread rank:
    DotProductAttention with set_context_parallel_group(group or [a2a group, p2p group], every CP rank, a CUDA
    stream, the fixture's comm type), THD, forward and backward on the rank's shard with the global cu_seqlens."""
    name = "te_cp"
    tensors = TENSORS
    requires_cuda = True

    def unsupported(self, fx):
        return "not a CP fixture (cp_size 1): the adapter te runs it" if fx.cp_size < 2 else None

    def run_rank(self, fx, rank, groups):
        from .rank_adapter import RankResult
        outputs, log, backend, _ = run_cp_rank(self.m, fx, rank, groups.cp_group, list(groups.cp_global_ranks),
                                               self.cu(fx))
        return RankResult(outputs, backend=backend, log=log,
                          notes={"arguments": te_arguments(fx), "lse_from": "none: TE's CP API returns no LSE"})
