"""Capture: the attention calls of a user's training step recorded per call and per rank (docs/capture.md).

    cap = cpgold.capture.Capture("capture/")          # a new folder, an empty one or one of its own
    cap.attach(model)                                   # TransformerEngine's DotProductAttention in the model, and
                                                        # the module path of every call as its layer name
    with cap.step(0):
        loss = model(batch); loss.backward()            # the user's step, unchanged

What happens to a call: its q, k, v are copied to the host, then handed to the attention as views of themselves whose
gradient hooks see exactly the attention's own dQ, dK, dV (nothing else reads those views); a hook on the output sees
the dout that reached the call. Hooks return nothing, so the gradients the user's step computes are the same
tensors, bit for bit, as without the capture; the outputs are the very tensors the attention returned. A call that
cannot be recorded (BSHD, FP8, a layout cpgold has no case for, a full disk, a bug of this module) is written to the
rank's index with the reason and a warning, and the user's step goes on as if there were no capture: nothing here
raises into the user's code.
"""
import atexit
import contextlib
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
import threading
import time
import warnings
import weakref

import numpy as np

from ..errors import InputError
from . import _folder
from ._folder import safe_name

__all__ = ["Capture", "CaptureWarning", "attention"]

SOURCES = ("te", "fa3", "fa4", "varlen", "user")
COMMS = ("p2p", "a2a", "all_gather", "a2a+p2p")
AUTO_PROGRESS_BYTES = 256 << 20
_UNSET = object()


class CaptureWarning(UserWarning):
    """A call that was not captured (unsupported layout, size cap, a write that failed), or a problem of the
    capture itself; the user's step is never affected."""


class Unsupported(Exception):
    """The call's layout is not one cpgold captures; the message says why."""


# ---------------------------------------------------------------------------------------------- small helpers


def _dtype_name(t):
    s = str(t.dtype)
    names = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
    if s in names:
        return names[s]
    if "float8" in s:
        raise Unsupported(f"{s} tensors: FP8 attention is not captured")
    raise Unsupported(f"dtype {s}: bf16, fp16 and fp32 attention is captured")


def _quantized(t):
    name = type(t).__name__
    return "Float8" in name or "FP8" in name or "Quantized" in name or "float8" in str(getattr(t, "dtype", ""))


def _ints(x, what):
    """A 1-D list of ints from a torch tensor, a numpy array or a sequence; None stays None."""
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").tolist()
    elif isinstance(x, np.ndarray):
        x = x.tolist()
    try:
        values = [int(v) for v in x]
    except (TypeError, ValueError):
        raise Unsupported(f"{what}: expected a 1-D list of integers, got {type(x).__name__}") from None
    return values


def _window(w, causal):
    if w is None:
        left, right = -1, -1
    else:
        try:
            left, right = w
        except (TypeError, ValueError):
            raise Unsupported(f"window_size {w!r}: expected (left, right)") from None
        left = -1 if left is None or int(left) < 0 else int(left)
        right = -1 if right is None or int(right) < 0 else int(right)
    if causal:
        right = 0
    return [left, right]


def _group_info(group):
    """(size, rank, global ranks or None) of a torch.distributed process group (thread ranks' groups too)."""
    import torch.distributed as dist

    size = int(dist.get_world_size(group))
    rank = int(dist.get_rank(group))
    ranks = None
    if hasattr(group, "global_ranks"):
        ranks = [int(r) for r in group.global_ranks()]
    else:
        get = getattr(dist, "get_process_group_ranks", None)
        if get is not None:
            try:
                ranks = [int(r) for r in get(group)]
            except Exception:  # noqa: BLE001 - an older torch or a group it does not know
                ranks = None
    return size, rank, ranks


def global_rank():
    """This rank: torch.distributed's rank when it is initialised (inside a thread rank of cpgold.thread_ranks, the
    thread's rank, which thread ranks report through torch.distributed), else the rank thread ranks keep for the
    current thread, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001
        pass
    try:
        from .. import thread_ranks

        world = thread_ranks._thread_world()
        if world is not None:
            return int(world.rank())
    except Exception:  # noqa: BLE001
        pass
    return 0


def _process_rank_hint():
    """The rank of this process when it can be known before any call: torch.distributed's (outside thread ranks), or
    torchrun's RANK; None otherwise (one process, or thread ranks)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001
        pass
    rank = os.environ.get("RANK")
    if rank is not None and rank.isdigit():
        return int(rank)
    return None


def _lse_ht(lse, heads, rows, layout):
    """LSE as an [h, t] torch tensor from [h, t], [t, h] or [t, h, 1]; None when it fits none."""
    if lse.dim() == 3 and lse.shape[2] == 1 and lse.shape[1] == heads:
        return lse[:, :, 0].transpose(0, 1)
    if lse.dim() != 2:
        return None
    if layout == "ht" or (layout is None and tuple(lse.shape) == (heads, rows)):
        return lse if tuple(lse.shape) == (heads, rows) else None
    if layout == "th" or (layout is None and tuple(lse.shape) == (rows, heads)):
        return lse.transpose(0, 1) if tuple(lse.shape) == (rows, heads) else None
    return None


class _View:
    """What a source adapter makes of one call: the q, k, v it takes, its layout (part of the meta), how to call it
    again with other q, k, v (replace), and where its outputs are (outputs(result) -> (o [t, h, dv], the tensor whose
    gradient is dout, lse or None))."""

    def __init__(self, q, k, v, layout, replace, outputs, lse_layout=None, sources=None):
        self.q, self.k, self.v, self.layout, self.replace, self.outputs = q, k, v, layout, replace, outputs
        self.lse_layout = lse_layout
        # The tensors the call takes, in the order replace() takes them, each with the gradients it carries:
        # [(tensor, [(gradient name, dim, index) or (name, None, None) for the whole tensor])].
        self.sources = sources if sources is not None else [
            (q, [("dq", None, None)]), (k, [("dk", None, None)]), (v, [("dv", None, None)])]


def _check_qkv(q, k, v):
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(t):
            raise Unsupported(f"{name} is {type(t).__name__}, not a tensor")
        if _quantized(t):
            raise Unsupported(f"{name} is a {type(t).__name__} ({t.dtype}): FP8 attention is not captured")
        if t.dim() != 3:
            raise Unsupported(f"{name} has shape {tuple(t.shape)}: the THD layout [tokens, heads, dim] is captured "
                              "(BSHD and SBHD are not)")
    names = {_dtype_name(t) for t in (q, k, v)}
    if len(names) != 1:
        raise Unsupported(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: one dtype is captured")
    if q.shape[2] != k.shape[2] or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise Unsupported(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit one attention")
    if q.shape[1] % k.shape[1]:
        raise Unsupported(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    return names.pop()


def _o3(o, heads):
    """An output [t, h, dv] from [t, h, dv] or TransformerEngine's [t, h * dv]."""
    if o.dim() == 3:
        return o
    if o.dim() == 2 and o.shape[1] % heads == 0:
        return o.view(o.shape[0], heads, o.shape[1] // heads)
    raise Unsupported(f"the output has shape {tuple(o.shape)}: expected [t, {heads}, dv] or [t, {heads} * dv]")


def _o_lse(result, heads):
    """(o as [t, h, dv], o as returned, lse or None) from a FlashAttention-style result: o, or a tuple whose first
    item is o and whose second, when a tensor, is the LSE."""
    if isinstance(result, (tuple, list)):
        o = result[0]
        lse = result[1] if len(result) > 1 and hasattr(result[1], "dim") else None
    else:
        o, lse = result, None
    return _o3(o, heads), o, lse


# ---------------------------------------------------------------------------------------------- sources


def _bind(sig, args, kwargs, what):
    try:
        return sig.bind(*args, **kwargs)
    except TypeError as e:
        raise Unsupported(f"{what}: the arguments do not bind to its signature ({e})") from None


def te_view(module, sig):
    """TransformerEngine's DotProductAttention.forward, read with the names TE 2.x gives its arguments and module
    attributes (qkv_format, attn_mask_type, window_size, bottom_right_diagonal, cp_group, cp_global_ranks,
    cp_comm_type, the backends' softmax_scale)."""

    def view(args, kwargs):
        b = _bind(sig, args, kwargs, "DotProductAttention.forward")
        a = b.arguments
        packed_qkv, packed_kv = a.get("qkv_layer"), a.get("kv_layer")
        dim = a.get("qkv_interleave_dim")
        if dim is None and "qkv_interleave_dim" in sig.parameters:
            dim = sig.parameters["qkv_interleave_dim"].default
        sources = None
        if packed_qkv is not None:
            # TE 2.20's declared packed input: q, k, v are qkv_layer.select(qkv_interleave_dim, 0 / 1 / 2)
            if getattr(packed_qkv, "dim", lambda: 0)() != 4 or packed_qkv.shape[dim] != 3:
                raise Unsupported(f"qkv_layer of shape {tuple(getattr(packed_qkv, 'shape', ()))}: expected THD "
                                  f"[t, ..., d] with 3 at qkv_interleave_dim {dim}")
            q, k, v = (packed_qkv.select(dim, i) for i in range(3))
            sources = [(packed_qkv, [("dq", dim, 0), ("dk", dim, 1), ("dv", dim, 2)])]
        elif packed_kv is not None:
            q = a.get("query_layer")
            if getattr(packed_kv, "dim", lambda: 0)() != 4 or packed_kv.shape[dim] != 2:
                raise Unsupported(f"kv_layer of shape {tuple(getattr(packed_kv, 'shape', ()))}: expected THD "
                                  f"[t, ..., d] with 2 at qkv_interleave_dim {dim}")
            k, v = (packed_kv.select(dim, i) for i in range(2))
            sources = [(q, [("dq", None, None)]), (packed_kv, [("dk", dim, 0), ("dv", dim, 1)])]
        else:
            q, k, v = a.get("query_layer"), a.get("key_layer"), a.get("value_layer")
        fmt = a.get("qkv_format") or getattr(module, "qkv_format", None)
        if fmt != "thd":
            raise Unsupported(f"qkv_format {fmt!r}: the THD layout is captured (BSHD and SBHD are not)")
        dtype = _check_qkv(q, k, v)
        _te_fp8(module)
        if a.get("fp8_output"):
            raise Unsupported("fp8_output=True: FP8 attention is not captured")
        mask = str(a.get("attn_mask_type") or getattr(module, "attn_mask_type", "padding")).replace(",", "_")
        if mask == "causal_padding":
            mask = "padding_causal"
        known = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                 "padding_causal_bottom_right")
        if mask not in known:
            raise Unsupported(f"attn_mask_type {mask!r}: captured are {', '.join(known)}")
        if a.get("attention_mask") is not None:
            raise Unsupported("attention_mask: THD calls are captured with cu_seqlens, not a mask tensor")
        bias = a.get("core_attention_bias_type") or "no_bias"
        if bias != "no_bias" or a.get("core_attention_bias") is not None or a.get("alibi_slopes") is not None:
            raise Unsupported(f"core_attention_bias_type {bias!r} / ALiBi: attention bias is not captured")
        if a.get("inference_params") is not None:
            raise Unsupported("inference_params: KV-cache inference is not captured")
        for name in ("score_mod", "score_mod_bprop"):
            if a.get(name) is not None:
                raise Unsupported(f"{name}: score modifiers are not captured")
        softmax_type = getattr(module, "softmax_type", "vanilla")
        if softmax_type not in (None, "vanilla"):
            raise Unsupported(f"softmax_type {softmax_type!r}: only the vanilla softmax is captured")
        dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        if dropout > 0 and module.training:
            raise Unsupported(f"attention_dropout {dropout} in training: outputs with dropout are random")
        causal = "causal" in mask
        window = a.get("window_size")
        if window is None:
            window = getattr(module, "window_size", None)
        window = _window(window, causal)
        diagonal = a.get("bottom_right_diagonal")
        if diagonal is None:
            diagonal = getattr(module, "bottom_right_diagonal", None)
        top_left = mask in ("causal", "padding_causal") or (not causal and "bottom_right" not in mask
                                                             and diagonal is False)
        cu_q = _ints(a.get("cu_seqlens_q"), "cu_seqlens_q")
        cu_kv = _ints(a.get("cu_seqlens_kv"), "cu_seqlens_kv")
        if cu_q is None or cu_kv is None:
            raise Unsupported("THD without cu_seqlens_q / cu_seqlens_kv is not captured")
        lengths_differ = np.diff(cu_q).tolist() != np.diff(cu_kv).tolist()
        if top_left and lengths_differ and (causal or window != [-1, -1]):
            raise Unsupported(f"attn_mask_type {mask!r} aligns the mask top-left and some sequence has L_q != L_kv: "
                              "cpgold's masks are bottom-right aligned")
        scale = None
        for holder in (module, getattr(module, "fused_attention", None), getattr(module, "flash_attention", None),
                       getattr(module, "unfused_attention", None)):
            scale = getattr(holder, "softmax_scale", None) if holder is not None else None
            if scale is not None:
                break
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[2])
        layout = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                      cu_seqlens_q_padded=_ints(a.get("cu_seqlens_q_padded"), "cu_seqlens_q_padded"),
                      cu_seqlens_kv_padded=_ints(a.get("cu_seqlens_kv_padded"), "cu_seqlens_kv_padded"),
                      causal=causal, window=window, softmax_scale=float(scale), dtype=dtype, lse=False,
                      pad_rows="zero", empty_row_lse="neg-inf", notes=[f"attn_mask_type {mask}"])
        layout.update(_te_cp(module))

        def replace(*tensors):
            if packed_qkv is not None:
                (a["qkv_layer"],) = tensors
            elif packed_kv is not None:
                a["query_layer"], a["kv_layer"] = tensors
            else:
                a["query_layer"], a["key_layer"], a["value_layer"] = tensors
            return b.args, b.kwargs

        def outputs(result):
            o = result if hasattr(result, "dim") else result[0]
            return _o3(o, q.shape[1]), o, None

        return _View(q, k, v, layout, replace, outputs, sources=sources)

    return view


def _te_fp8(module):
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        m = sys.modules.get(name)
        manager = getattr(m, "FP8GlobalStateManager", None) if m is not None else None
        if manager is None:
            continue
        try:
            enabled = manager.is_fp8_enabled()
            recipe = manager.get_fp8_recipe() if enabled else None
        except Exception:  # noqa: BLE001
            return
        if enabled and getattr(recipe, "fp8_dpa", False):
            raise Unsupported("FP8 autocast with fp8_dpa: FP8 attention is not captured")
        return


def _te_cp(module):
    group = getattr(module, "cp_group", None)
    comm = getattr(module, "cp_comm_type", None) or "p2p"
    if group is None:
        return dict(cp_size=1, cp_rank=0, cp_group=None, comm="p2p", a2a_size=1)
    if isinstance(group, (list, tuple)):
        if len(group) != 2:
            raise Unsupported(f"cp_group: a list of {len(group)} groups (a2a+p2p takes [a2a group, p2p group])")
        sa, ra, _ = _group_info(group[0])
        sp, rp, _ = _group_info(group[1])
        if sa == 1:
            w, r, comm, a2a = sp, rp, "p2p", 1
        elif sp == 1:
            w, r, comm, a2a = sa, ra, "a2a", sa
        else:
            w, r, comm, a2a = sa * sp, rp * sa + ra, "a2a+p2p", sa
        ranks = None
    else:
        w, r, ranks = _group_info(group)
        if comm == "a2a+p2p":
            raise Unsupported("cp_comm_type a2a+p2p with a single cp_group")
        a2a = w if comm == "a2a" else 1
    declared = getattr(module, "cp_global_ranks", None)
    if declared is not None and len(declared) == w:
        ranks = [int(x) for x in declared]
    if comm not in COMMS:
        raise Unsupported(f"cp_comm_type {comm!r}: captured are {', '.join(COMMS)}")
    if w == 1:
        comm, a2a = "p2p", 1
    return dict(cp_size=w, cp_rank=r, cp_group=ranks, comm=comm, a2a_size=a2a)


def flash_view(source, sig):
    """FlashAttention-3's flash_attn_interface.flash_attn_varlen_func and FlashAttention-4's
    flash_attn.cute.flash_attn_varlen_func: cu_seqlens_q/k (with seqused_q/k: the padded offsets, seqused the true
    lengths), softmax_scale, causal, window_size; the LSE when the call asks for it (return_attn_probs, return_lse)."""

    def view(args, kwargs):
        b = _bind(sig, args, kwargs, "flash_attn_varlen_func")
        a = b.arguments
        q, k, v = a.get("q"), a.get("k"), a.get("v")
        for name in ("qv", "q_descale", "k_descale", "v_descale", "page_table", "block_table", "learnable_sink",
                     "score_mod", "aux_tensors", "alibi_slopes", "mask_mod"):
            if a.get(name) is not None:
                raise Unsupported(f"{name} is given: not captured")
        for name in ("softcap", "attention_chunk", "dropout_p"):
            if a.get(name) not in (None, 0, 0.0):
                raise Unsupported(f"{name}={a.get(name)!r}: not captured")
        if getattr(q, "dim", lambda: 0)() != 3:
            raise Unsupported(f"q has shape {tuple(getattr(q, 'shape', ()))}: varlen THD [tokens, heads, dim] is "
                              "captured (BSHD is not)")
        dtype = _check_qkv(q, k, v)
        cu_q = _ints(a.get("cu_seqlens_q"), "cu_seqlens_q")
        cu_k = _ints(a.get("cu_seqlens_k"), "cu_seqlens_k")
        if cu_q is None or cu_k is None:
            raise Unsupported("no cu_seqlens_q / cu_seqlens_k: only varlen calls are captured")
        used_q = _ints(a.get("seqused_q"), "seqused_q")
        used_k = _ints(a.get("seqused_k"), "seqused_k")
        causal = bool(a.get("causal") or False)
        scale = a.get("softmax_scale")
        layout = dict(causal=causal, window=_window(a.get("window_size"), causal),
                      softmax_scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2]), dtype=dtype,
                      pad_rows="unwritten" if (used_q is not None or used_k is not None) else "zero",
                      empty_row_lse="neg-inf", cp_size=1, cp_rank=0, cp_group=None, comm="p2p", a2a_size=1)
        for side, cu, used in (("q", cu_q, used_q), ("kv", cu_k, used_k)):
            if used is not None:
                if len(used) != len(cu) - 1:
                    raise Unsupported(f"seqused_{side[0]} has {len(used)} entries for {len(cu) - 1} sequences")
                layout[f"cu_seqlens_{side}"] = np.concatenate([[0], np.cumsum(used)]).astype(np.int64).tolist()
                layout[f"cu_seqlens_{side}_padded"] = cu
            else:
                layout[f"cu_seqlens_{side}"] = cu
                layout[f"cu_seqlens_{side}_padded"] = None
        wants_lse = bool(a.get("return_attn_probs") or a.get("return_lse"))
        layout["lse"] = wants_lse

        def replace(q2, k2, v2):
            a["q"], a["k"], a["v"] = q2, k2, v2
            return b.args, b.kwargs

        return _View(q, k, v, layout, replace, lambda result: _o_lse(result, q.shape[1]))

    return view


def varlen_view(sig):
    """PyTorch's torch.nn.attention.varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...):
    valid tokens packed at cu_seq_q/k; is_causal or window_size, scale, return_aux=AuxRequest(lse=True). Its LSE on
    rows without keys is +inf (FlashAttention-2's convention), recorded as such."""
    names = list(sig.parameters)

    def view(args, kwargs):
        b = _bind(sig, args, kwargs, "varlen_attn")
        a = b.arguments
        q, k, v = (a.get(names[i]) for i in range(3))
        dtype = _check_qkv(q, k, v)
        cu_q = _ints(a.get(names[3]), names[3])
        cu_k = _ints(a.get(names[4]), names[4])
        if cu_q is None or cu_k is None:
            raise Unsupported("no cu_seq_q / cu_seq_k")
        causal = bool(a.get("is_causal") or False)
        window = a.get("window_size")
        if window is not None and list(window)[1:] == [0]:
            causal = True
        scale = a.get("scale")
        aux = a.get("return_aux")
        layout = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                      causal=causal, window=_window(window, causal),
                      softmax_scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2]), dtype=dtype,
                      lse=bool(aux is not None and getattr(aux, "lse", False)), pad_rows="zero",
                      empty_row_lse="pos-inf", cp_size=1, cp_rank=0, cp_group=None, comm="p2p", a2a_size=1)

        def replace(q2, k2, v2):
            a[names[0]], a[names[1]], a[names[2]] = q2, k2, v2
            return b.args, b.kwargs

        return _View(q, k, v, layout, replace, lambda result: _o_lse(result, q.shape[1]))

    return view


class UserSpec:
    """How a user's attention function takes and gives its tensors (see Capture.attention)."""

    ARGUMENT_FIELDS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    EITHER_FIELDS = ("causal", "window", "scale", "cp_group", "cp_size", "cp_rank")

    def __init__(self, fn, q="q", k="k", v="v", cu_seqlens_q="cu_seqlens_q", cu_seqlens_kv="cu_seqlens_kv",
                 cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, causal=False, window=None, scale=None,
                 cp_group=None, cp_size=None, cp_rank=None, comm="p2p", a2a_size=None, returns="o", lse_layout=None,
                 layer=None, empty_row_lse="neg-inf", pad_rows="zero"):
        try:
            self.sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise InputError(f"fn: {fn!r} has no signature to read ({e})", "fn") from None
        params = self.sig.parameters
        open_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        name = getattr(fn, "__qualname__", repr(fn))

        def argument(field, value, required):
            if value is None and not required:
                return None
            if not isinstance(value, str):
                raise InputError(f"{field}: expected the name of an argument of {name}, got {value!r}", field)
            if value not in params and not open_kwargs:
                raise InputError(f"{field}: {name} has no argument {value!r} (its arguments: "
                                 f"{', '.join(params)})", field)
            return value

        self.args = {}
        for field, value, required in (("q", q, True), ("k", k, True), ("v", v, True),
                                       ("cu_seqlens_q", cu_seqlens_q, True), ("cu_seqlens_kv", cu_seqlens_kv, True),
                                       ("cu_seqlens_q_padded", cu_seqlens_q_padded, False),
                                       ("cu_seqlens_kv_padded", cu_seqlens_kv_padded, False)):
            self.args[field] = argument(field, value, required)
        self.either = {}
        for field, value in (("causal", causal), ("window", window), ("scale", scale), ("cp_group", cp_group),
                             ("cp_size", cp_size), ("cp_rank", cp_rank)):
            if isinstance(value, str):
                self.either[field] = ("arg", argument(field, value, True))
            else:
                self.either[field] = ("const", value)
        if self.either["cp_group"][0] == "const" and self.either["cp_group"][1] is not None:
            raise InputError("cp_group: give the name of the argument that holds the process group", "cp_group")
        if self.either["causal"][0] == "const" and not isinstance(causal, bool):
            raise InputError(f"causal: expected True, False or an argument name, got {causal!r}", "causal")
        for field in ("cp_size", "cp_rank"):
            kind, value = self.either[field]
            if kind == "const" and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                          or value < (1 if field == "cp_size" else 0)):
                raise InputError(f"{field}: expected an integer or an argument name, got {value!r}", field)
        if self.either["scale"][0] == "const" and self.either["scale"][1] is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
                raise InputError(f"scale: expected a positive number or an argument name, got {scale!r}", "scale")
        size_kind, size = self.either["cp_size"]
        if self.either["cp_group"][1] is None and size_kind == "const" and (size or 1) > 1 \
                and self.either["cp_rank"][1] is None:
            raise InputError("cp_rank: with cp_size > 1 and no cp_group, name the argument (or give the value) that "
                             "holds this rank's CP rank", "cp_rank")
        if comm not in COMMS:
            raise InputError(f"comm: expected one of {', '.join(COMMS)}, got {comm!r}", "comm")
        self.comm, self.a2a_size = comm, a2a_size
        if returns == "o":
            returns = ("o",)
        elif returns == "dict":
            returns = "dict"
        elif isinstance(returns, (tuple, list)) and "o" in returns and all(r in ("o", "lse", None) for r in returns):
            returns = tuple(returns)
        else:
            raise InputError(f"returns: expected 'o', ('o', 'lse') (None for a position to ignore) or 'dict', got "
                             f"{returns!r}", "returns")
        self.returns = returns
        if lse_layout not in (None, "ht", "th"):
            raise InputError(f"lse_layout: expected 'ht', 'th' or None, got {lse_layout!r}", "lse_layout")
        if empty_row_lse not in ("neg-inf", "pos-inf"):
            raise InputError(f"empty_row_lse: expected 'neg-inf' or 'pos-inf', got {empty_row_lse!r}",
                             "empty_row_lse")
        if pad_rows not in ("zero", "unwritten"):
            raise InputError(f"pad_rows: expected 'zero' or 'unwritten', got {pad_rows!r}", "pad_rows")
        if layer is not None and not isinstance(layer, str):
            raise InputError(f"layer: expected a name, got {layer!r}", "layer")
        self.lse_layout, self.layer, self.empty_row_lse, self.pad_rows = lse_layout, layer, empty_row_lse, pad_rows

    def view(self, args, kwargs):
        b = _bind(self.sig, args, kwargs, "the attention function")
        a = b.arguments

        def get(name):
            if name in a:
                return a[name]
            p = self.sig.parameters.get(name)
            if p is None or p.default is p.empty:
                return None
            return p.default

        def either(field):
            kind, value = self.either[field]
            return get(value) if kind == "arg" else value

        q, k, v = (get(self.args[n]) for n in ("q", "k", "v"))
        dtype = _check_qkv(q, k, v)
        layout = {f: _ints(get(self.args[f]), f) if self.args[f] else None
                  for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")}
        if layout["cu_seqlens_q"] is None or layout["cu_seqlens_kv"] is None:
            raise Unsupported("cu_seqlens_q / cu_seqlens_kv is None")
        causal = bool(either("causal"))
        scale = either("scale")
        group = either("cp_group")
        if group is not None:
            size, rank, ranks = _group_info(group)
        else:
            size = int(either("cp_size") or 1)
            rank = int(either("cp_rank") or 0)
            ranks = None
        if ranks is None and size > 1:
            first = global_rank() - rank
            ranks = list(range(first, first + size))
        comm = self.comm if size > 1 else "p2p"
        a2a = self.a2a_size or (size if comm == "a2a" else 1)
        layout.update(causal=causal, window=_window(either("window"), causal),
                      softmax_scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2]), dtype=dtype,
                      cp_size=size, cp_rank=rank, cp_group=ranks, comm=comm, a2a_size=int(a2a),
                      lse="lse" in self.returns or self.returns == "dict", pad_rows=self.pad_rows,
                      empty_row_lse=self.empty_row_lse)

        def replace(q2, k2, v2):
            for n, t in (("q", q2), ("k", k2), ("v", v2)):
                a[self.args[n]] = t
            return b.args, b.kwargs

        def outputs(result):
            lse = None
            if self.returns == "dict":
                o, lse = result["o"], result.get("lse")
            elif self.returns == ("o",):
                o = result
            else:
                o = result[self.returns.index("o")]
                if "lse" in self.returns:
                    lse = result[self.returns.index("lse")]
            return _o3(o, q.shape[1]), o, lse

        return _View(q, k, v, layout, replace, outputs, self.lse_layout)


# ---------------------------------------------------------------------------------------------- one call


class _Call:
    """One captured call on one rank between its forward and the last of its gradients."""

    def __init__(self, meta, path, partial, selection, expected):
        self.meta, self.path, self.partial = meta, path, partial
        self.selection = selection      # (q-head index, kv-head index) torch-free lists, or None for all heads
        self.expected = set(expected)   # gradient names still to come
        self.grads = {}
        self.lock = threading.Lock()
        self.state = "forward"          # forward -> pending -> written / failed


def _host(t, dim=None, index=None):
    """A detached host copy as numpy: bf16 widened to float32 (exactly), fp16 and fp32 as they are."""
    import torch

    x = t.detach()
    if index is not None:
        x = x.index_select(dim, torch.as_tensor(index, dtype=torch.long, device=x.device))
    x = x.to("cpu")
    if x.dtype == torch.bfloat16:
        x = x.float()
    return np.ascontiguousarray(x.numpy())


# ---------------------------------------------------------------------------------------------- Capture


class Capture:
    """Records attention calls of a training step into `folder` (docs/capture.md).

    folder: a new folder, an empty one or an earlier capture's own (InputError when it holds anything a capture does
    not write, or an index of this process's rank from an earlier capture). layers: None (all) or names / fnmatch
    patterns of the layers to record ("layers.3.*"; calls without a module name are "call0", "call1", ... per step).
    steps: None (all, including calls outside any `step`), an int, or an iterable of ints. heads: None (all), n (the
    first n KV heads with their query heads) or a list of KV heads. max_bytes: stop recording (each further call is
    listed in the index as skipped) once this many bytes would be written by this process. progress: "auto" (a line
    on stderr for calls of 256 MiB or more), True (every call), False, or a callable taking a dict."""

    def __init__(self, folder, layers=None, steps=None, heads=None, max_bytes=None, progress="auto"):
        self.layers = self._layers(layers)
        self.steps = self._steps(steps)
        self.heads = self._heads(heads)
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral)
                                      or max_bytes <= 0):
            raise InputError(f"max_bytes: expected a positive number of bytes or None, got {max_bytes!r}",
                             "max_bytes")
        if not (progress in ("auto", True, False) or callable(progress)):
            raise InputError(f"progress: expected 'auto', True, False or a callable, got {progress!r}", "progress")
        self.max_bytes, self.progress = max_bytes, progress
        self.folder = _folder.open_for_capture(folder)
        hint = _process_rank_hint()
        earlier = sorted(n for n in os.listdir(self.folder) if n.startswith("index.rank"))
        if (hint is None and earlier) or (hint is not None and f"index.rank{hint}.jsonl" in earlier):
            mine = earlier if hint is None else [f"index.rank{hint}.jsonl"]
            raise _folder.CaptureFolderError(
                f"folder: {self.folder!r} already holds the records of an earlier capture ({', '.join(mine)}): a "
                "capture never adds to another's; choose a new folder", os.path.join(self.folder, mine[0]))
        self._lock = threading.RLock()
        self._local = threading.local()
        self._process_step = None
        self._names = {}          # (rank, step) -> {"unnamed": n, "seen": {layer: count}, "safe": {safe: layer}}
        self._order = {}          # rank -> calls begun
        self._pending = []        # _Call waiting for gradients
        self._index = {}          # rank -> file descriptor, or None (refused)
        self._bytes = 0
        self._undo = []           # callables restoring what attach/patch changed
        self._warned = set()
        self._closed = False
        self.calls = 0            # calls written
        self.not_captured = 0     # calls recorded as unsupported, skipped or failed
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    # ------------------------------------------------------------------ options
    @staticmethod
    def _layers(layers):
        if layers is None:
            return None
        if isinstance(layers, str):
            layers = [layers]
        try:
            out = list(layers)
        except TypeError:
            raise InputError(f"layers: expected None, a name or a list of names / patterns, got {layers!r}",
                             "layers") from None
        bad = [x for x in out if not isinstance(x, str) or not x]
        if bad or not out:
            raise InputError(f"layers: expected non-empty names or patterns, got {bad[0] if bad else out!r}", "layers")
        return out

    @staticmethod
    def _steps(steps):
        if steps is None:
            return None
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            steps = [steps]
        try:
            out = set(steps)
        except TypeError:
            raise InputError(f"steps: expected None, an int or a list of ints, got {steps!r}", "steps") from None
        bad = [s for s in out if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0]
        if bad or not out:
            raise InputError(f"steps: expected step numbers >= 0, got {bad[0] if bad else steps!r}", "steps")
        return {int(s) for s in out}

    @staticmethod
    def _heads(heads):
        if heads is None:
            return None
        if isinstance(heads, numbers.Integral) and not isinstance(heads, bool):
            if heads < 1:
                raise InputError(f"heads: expected a count >= 1 or a list of KV heads, got {heads}", "heads")
            return ("first", int(heads))
        try:
            out = sorted(set(int(h) for h in heads))
        except (TypeError, ValueError):
            raise InputError(f"heads: expected None, a count or a list of KV heads, got {heads!r}", "heads") from None
        if not out or out[0] < 0:
            raise InputError(f"heads: expected KV head indices >= 0, got {heads!r}", "heads")
        return ("list", out)

    # ------------------------------------------------------------------ user-facing
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Capture({self.folder!r}, calls={self.calls}, not_captured={self.not_captured})"

    @contextlib.contextmanager
    def step(self, n):
        """Marks the calls inside as step n of the run (per thread: every thread rank marks its own). Entering a step
        writes out what this rank still holds of its earlier steps."""
        st = self._thread()
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            self._warn(("step", repr(n)), f"cpgold.capture: step({n!r}) is not a step number >= 0: the calls inside "
                                          "are recorded without a step")
            n = None
        previous = getattr(st, "step", _UNSET)
        st.step = None if n is None else int(n)
        st.modules = []
        with self._lock:
            self._process_step = st.step
        try:
            self._flush(rank=global_rank(), before=st.step)
        except Exception as e:  # noqa: BLE001
            self._internal(e)
        try:
            yield self
        finally:
            st.step = previous
            st.modules = []

    def attach(self, model, name=None):
        """Records every TransformerEngine DotProductAttention of `model` (any torch.nn.Module; the module itself
        when it is one), named by its path in model.named_modules(), and names function calls (patch_flash,
        patch_varlen, the attention decorator) by the path of the innermost module running them. Returns the number
        of DotProductAttention modules found."""
        found = 0
        try:
            modules = list(model.named_modules())
        except Exception as e:  # noqa: BLE001
            self._internal(e)
            return 0
        for path, module in modules:
            label = path or name or type(module).__name__
            try:
                if _is_te_dpa(module):
                    self._patch_te(module, label)
                    found += 1
                if path:
                    self._hook_module(module, path)
            except Exception as e:  # noqa: BLE001
                self._internal(e)
        return found

    def patch_flash(self):
        """Records calls of FlashAttention-3's flash_attn_interface.flash_attn_varlen_func and FlashAttention-4's
        flash_attn.cute.flash_attn_varlen_func (where installed): the module attribute, and every name other loaded
        modules bound to it (`from flash_attn_interface import flash_attn_varlen_func`), except inside
        TransformerEngine (its CP steps call them per step; DotProductAttention is captured whole by attach).
        Returns the names patched."""
        patched = []
        for module_name, source in (("flash_attn_interface", "fa3"), ("flash_attn.cute", "fa4"),
                                    ("flash_attn.cute.interface", "fa4")):
            try:
                module = sys.modules.get(module_name)
                if module is None:
                    if importlib.util.find_spec(module_name.split(".")[0]) is None:
                        continue
                    module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - not installed, or not importable here
                continue
            if self._patch_function(module, "flash_attn_varlen_func", source, flash_view):
                patched.append(f"{module_name}.flash_attn_varlen_func")
        return patched

    def patch_varlen(self):
        """Records calls of PyTorch's torch.nn.attention.varlen.varlen_attn (where this torch has it). Returns the
        names patched."""
        try:
            module = importlib.import_module("torch.nn.attention.varlen")
        except Exception:  # noqa: BLE001
            return []
        if self._patch_function(module, "varlen_attn", "varlen", lambda source, sig: varlen_view(sig)):
            return ["torch.nn.attention.varlen.varlen_attn"]
        return []

    def attention(self, fn=None, **spec):
        """Decorator for a user's own attention function: @cap.attention(q="q", k="k", v="v", cu_seqlens_q=...,
        cu_seqlens_kv=..., cu_seqlens_q_padded=..., cu_seqlens_kv_padded=..., causal=..., window=..., scale=...,
        cp_group=..., cp_size=..., cp_rank=..., comm="p2p", returns="o" | ("o", "lse") | "dict", lse_layout=...,
        layer=..., empty_row_lse="neg-inf", pad_rows="zero"). A string names an argument of the function; causal,
        window, scale, cp_size and cp_rank may also be given as values. cu_seqlens are global (as TransformerEngine
        takes them): the actual token counts, and the row offsets of the sequences in the global padded layout (None:
        the tokens are packed at cu_seqlens). Under CP the CP group gives size and rank (or cp_size and cp_rank)."""
        if fn is None:
            return lambda f: self.attention(f, **spec)
        user = UserSpec(fn, **spec)
        cap = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return cap._run("user", user.view, fn, args, kwargs, layer=user.layer)

        wrapper._cpgold_capture = self
        return wrapper

    def flush(self):
        """Writes out every call still waiting for its gradients (with the gradients seen so far)."""
        try:
            self._flush()
        except Exception as e:  # noqa: BLE001
            self._internal(e)

    def close(self):
        """Writes out what is pending, undoes attach / patch_*, closes the indexes. Calls after close pass through."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            for undo in reversed(self._undo):
                try:
                    undo()
                except Exception as e:  # noqa: BLE001
                    self._internal(e)
            self._undo.clear()
            for fd in self._index.values():
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._index = {r: None for r in self._index}

    # ------------------------------------------------------------------ patching
    def _patch_te(self, module, label):
        if "forward" in module.__dict__ and getattr(module.__dict__["forward"], "_cpgold_capture", None) is self:
            return
        had = "forward" in module.__dict__
        original = module.forward
        sig = inspect.signature(original)
        cap = self
        view = te_view(module, sig)

        @functools.wraps(original)
        def forward(*args, **kwargs):
            return cap._run("te", view, original, args, kwargs, layer=label)

        forward._cpgold_capture = self
        module.forward = forward

        def undo():
            if had:
                module.forward = original
            else:
                module.__dict__.pop("forward", None)
        self._undo.append(undo)

    def _hook_module(self, module, path):
        cap = self

        def pre(mod, inputs):
            try:
                cap._thread().modules.append(path)
            except Exception:  # noqa: BLE001
                pass

        def post(mod, inputs, output):
            try:
                stack = cap._thread().modules
                if path in stack:
                    del stack[len(stack) - 1 - stack[::-1].index(path):]
            except Exception:  # noqa: BLE001
                pass

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        self._undo.append(lambda: [h.remove() for h in handles])

    def _patch_function(self, module, attr, source, make_view):
        original = getattr(module, attr, None)
        if original is None or getattr(original, "_cpgold_capture", None) is self:
            return False
        try:
            sig = inspect.signature(original)
        except (TypeError, ValueError):
            return False
        view = make_view(source, sig)
        cap = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return cap._run(source, view, original, args, kwargs)

        wrapper._cpgold_capture = self
        rebound = [(module, attr)]
        skip = ("transformer_engine", "flash_attn", "torch", "cpgold", "flash_attn_interface")
        for name, other in list(sys.modules.items()):
            if other is None or other is module or name.split(".")[0] in skip:
                continue
            try:
                items = list(vars(other).items())
            except TypeError:
                continue
            for key, value in items:
                if value is original:
                    rebound.append((other, key))
        for holder, key in rebound:
            setattr(holder, key, wrapper)

        def undo():
            for holder, key in rebound:
                if getattr(holder, key, None) is wrapper:
                    setattr(holder, key, original)
        self._undo.append(undo)
        return True

    # ------------------------------------------------------------------ the interception
    def _thread(self):
        st = self._local
        if not hasattr(st, "depth"):
            st.depth = 0
            st.modules = []
        return st

    def _current_step(self):
        st = self._thread()
        step = getattr(st, "step", _UNSET)
        if step is _UNSET:
            step = self._process_step
        return -1 if step is None else step

    def _run(self, source, view, original, args, kwargs, layer=None):
        st = self._thread()
        if self._closed or st.depth > 0:
            return original(*args, **kwargs)
        plan = None
        try:
            plan = self._begin(source, view, args, kwargs, layer)
        except Exception as e:  # noqa: BLE001 - never into the user's step
            self._internal(e)
            plan = None
        st.depth += 1
        try:
            if plan is None:
                return original(*args, **kwargs)
            call, new_args, new_kwargs, inputs = plan
            try:
                result = original(*new_args, **new_kwargs)
            except BaseException:
                self._discard(call)
                raise
        finally:
            st.depth -= 1
        try:
            self._forward_done(call, result, inputs)
        except Exception as e:  # noqa: BLE001
            self._internal(e)
            self._fail(call, f"internal error after the forward: {type(e).__name__}: {e}")
        return result

    def _name_call(self, rank, step, layer):
        with self._lock:
            names = self._names.setdefault((rank, step), {"unnamed": 0, "seen": {}, "safe": {}})
            if layer is None:
                layer = f"call{names['unnamed']}"
                names["unnamed"] += 1
            occurrence = names["seen"].get(layer, 0)
            names["seen"][layer] = occurrence + 1
            safe = safe_name(layer)
            owner = names["safe"].setdefault(safe, layer)
            if owner != layer:
                n = 2
                while names["safe"].setdefault(f"{safe}+{n}", layer) != layer:
                    n += 1
                safe = f"{safe}+{n}"
            order = self._order.get(rank, 0)
            self._order[rank] = order + 1
        call = f"{'nostep' if step < 0 else f'step{step}'}.{safe}" + (f"~{occurrence}" if occurrence else "")
        return layer, occurrence, call, order

    def _selected_step(self, step):
        return self.steps is None or step in self.steps

    def _selected_layer(self, layer):
        return self.layers is None or any(fnmatch.fnmatchcase(layer, p) for p in self.layers)

    def _begin(self, source, view_of, args, kwargs, layer):
        import torch

        rank = global_rank()
        if self._index.get(rank, 0) is None:
            return None   # this rank's index belongs to an earlier capture (warned once)
        step = self._current_step()
        if not self._selected_step(step):
            return None
        if layer is None:
            stack = self._thread().modules
            layer = stack[-1] if stack else None
        layer, occurrence, call_id, order = self._name_call(rank, step, layer)
        if not self._selected_layer(layer):
            return None
        base = {"call": call_id, "step": step, "layer": layer, "occurrence": occurrence, "source": source,
                "rank": rank, "order": order}
        try:
            view = view_of(args, kwargs)
        except Unsupported as e:
            self._not_captured(base, "unsupported", str(e))
            return None
        q, k, v = view.q, view.k, view.v
        hq, hkv = int(q.shape[1]), int(k.shape[1])
        group = hq // hkv
        kv_sel = None
        if self.heads is not None:
            kind, value = self.heads
            kv_sel = list(range(min(value, hkv))) if kind == "first" else [h for h in value if h < hkv]
            if not kv_sel:
                self._not_captured(base, "skipped", f"heads={value}: none of the call's {hkv} KV heads selected")
                return None
            if kv_sel == list(range(hkv)):
                kv_sel = None
        q_sel = None if kv_sel is None else [h * group + j for h in kv_sel for j in range(group)]
        meta = dict(base, **view.layout)
        meta.update(rows_q=int(q.shape[0]), rows_kv=int(k.shape[0]), heads_total_q=hq, heads_total_kv=hkv,
                    heads_q=hq if q_sel is None else len(q_sel), heads_kv=hkv if kv_sel is None else len(kv_sel),
                    dim_qk=int(q.shape[2]), dim_v=int(v.shape[2]), kv_heads=kv_sel)
        width = 4 if meta["dtype"] in ("bf16", "fp32") else 2
        estimate = width * 2 * (q.shape[0] * meta["heads_q"] * (meta["dim_qk"] + 2 * meta["dim_v"])
                                + k.shape[0] * meta["heads_kv"] * (meta["dim_qk"] + meta["dim_v"]))
        with self._lock:
            if self.max_bytes is not None and self._bytes + estimate > self.max_bytes:
                over = True
            else:
                over = False
                self._bytes += estimate
        if over:
            self._not_captured(base, "skipped", f"max_bytes {self.max_bytes}: {self._bytes} bytes written or "
                                                f"reserved, this call needs about {estimate}")
            return None
        # The inputs as the attention receives them, before it runs (it could change them in place).
        inputs = {"q": _host(q, 1, q_sel), "k": _host(k, 1, kv_sel), "v": _host(v, 1, kv_sel)}
        grad_on = torch.is_grad_enabled()
        taps = [grad_on and getattr(t, "requires_grad", False) for t, _ in view.sources]
        expected = [name for (t, parts), tap in zip(view.sources, taps) if tap for name, _, _ in parts]
        folder = os.path.join(self.folder, "calls", call_id)
        path = os.path.join(folder, f"rank{rank}.h5")
        call = _Call(meta, path, None, (q_sel, kv_sel), expected)
        tapped = []
        for (t, parts), tap in zip(view.sources, taps):
            if tap:
                # A view of the tensor that only the attention reads: its gradient is the attention's own dQ/dK/dV.
                tv = t.view_as(t)
                tv.register_hook(self._grad_hook(call, parts))
                tapped.append(tv)
            else:
                tapped.append(t)
        new_args, new_kwargs = view.replace(*tapped)
        return call, new_args, new_kwargs, (inputs, view, grad_on)

    def _forward_done(self, call, result, inputs):
        arrays, view, grad_on = inputs
        o3, o_grad, lse = view.outputs(result)
        meta = call.meta
        q_sel, kv_sel = call.selection
        arrays["o"] = _host(o3, 1, q_sel)
        if lse is not None:
            ht = _lse_ht(lse, meta["heads_total_q"], meta["rows_q"], view.lse_layout)
            if ht is None:
                meta.setdefault("notes", []).append(f"LSE of shape {tuple(lse.shape)} not recorded (no heads axis of "
                                                    f"{meta['heads_total_q']})")
            else:
                a = _host(ht, 0, q_sel)
                arrays["lse"] = a.astype(np.float32, copy=False)
        meta["lse"] = "lse" in arrays
        if "dout" not in call.expected and grad_on and getattr(o_grad, "requires_grad", False) and call.expected:
            call.expected.add("dout")
            shape = tuple(o3.shape)
            o_grad.register_hook(self._grad_hook(call, [("dout", None, None)], shape))
        os.makedirs(os.path.dirname(call.path), exist_ok=True)
        call.partial = _folder._partial_name(call.path)
        self._write_forward(call, arrays)
        with call.lock:
            if call.state == "failed":
                return
            call.state = "pending"
            done = not call.expected
        if done:
            self._finish(call)
        else:
            with self._lock:
                self._pending.append(call)

    def _grad_hook(self, call, parts, shape=None):
        """A tensor hook that records the gradient it sees (or its parts: (name, dim, index) selects a packed input's
        part) and returns nothing, so the gradient flows on unchanged."""
        cap = self

        def hook(grad):
            try:
                for name, dim, index in parts:
                    cap._receive(call, name, grad if dim is None else grad.select(dim, index), shape)
            except Exception as e:  # noqa: BLE001
                cap._internal(e)
            return None
        return hook

    def _receive(self, call, name, grad, shape):
        with call.lock:
            if call.state not in ("forward", "pending") or name in call.grads or name not in call.expected:
                return
        q_sel, kv_sel = call.selection
        g = grad.reshape(shape) if shape is not None else grad
        sel = q_sel if name in ("dq", "dout") else kv_sel
        array = _host(g, 1, sel)
        with call.lock:
            call.grads[name] = array
            ready = call.state == "pending" and set(call.grads) >= call.expected
        if ready:
            with self._lock:
                if call in self._pending:
                    self._pending.remove(call)
            self._finish(call)

    # ------------------------------------------------------------------ writing
    def _announce(self, call, nbytes, seconds=None):
        p = self.progress
        if p is False or (p == "auto" and nbytes < AUTO_PROGRESS_BYTES):
            return
        info = {"call": call.meta["call"], "rank": call.meta["rank"], "bytes": nbytes, "seconds": seconds}
        if callable(p) and p not in ("auto", True):
            try:
                p(info)
            except Exception as e:  # noqa: BLE001
                self._internal(e)
            return
        what = f"cpgold.capture: {call.meta['call']} rank {call.meta['rank']}: {nbytes / 2**20:.1f} MiB"
        print(what + (" ..." if seconds is None else f" written in {seconds:.1f} s"), file=sys.stderr, flush=True)

    def _write_forward(self, call, arrays):
        import h5py

        nbytes = sum(a.nbytes for a in arrays.values())
        self._announce(call, nbytes)
        try:
            with h5py.File(call.partial, "x") as f:
                for name, a in arrays.items():
                    f.create_dataset(name, data=a)
                    f[name].attrs["dtype"] = call.meta["dtype"] if name != "lse" else "fp32"
        except Exception as e:  # noqa: BLE001 - a full disk, a quota: recorded, never raised
            self._fail(call, f"cannot write {call.partial}: {type(e).__name__}: {e}")

    def _finish(self, call, missing=()):
        import h5py

        with call.lock:
            if call.state in ("written", "failed"):
                return
            call.state = "writing"
            grads = dict(call.grads)
        meta = dict(call.meta)
        meta["missing"] = sorted(set(missing) | (call.expected - set(grads)))
        t0 = time.monotonic()
        try:
            with h5py.File(call.partial, "r+") as f:
                for name, a in sorted(grads.items()):
                    f.create_dataset(name, data=a)
                    f[name].attrs["dtype"] = meta["dtype"]
                meta["tensors"] = sorted(f.keys())
                f.attrs["format"] = "cpgold-capture-call"
                f.attrs["version"] = _folder.FORMAT_VERSION
                f.attrs["meta_json"] = json.dumps(meta, allow_nan=False)
            nbytes = os.path.getsize(call.partial)
            try:
                os.link(call.partial, call.path)
            except FileExistsError:
                raise
            except OSError:
                fd = os.open(call.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)
                os.replace(call.partial, call.path)
        except Exception as e:  # noqa: BLE001
            self._fail(call, f"cannot write {call.path}: {type(e).__name__}: {e}")
            return
        finally:
            if call.partial and os.path.lexists(call.partial):
                try:
                    os.unlink(call.partial)
                except OSError:
                    pass
        with call.lock:
            call.state = "written"
        with self._lock:
            self.calls += 1
        rel = os.path.relpath(call.path, self.folder)
        self._record(meta["rank"], {k: meta[k] for k in ("call", "step", "layer", "occurrence", "source", "rank",
                                                           "order", "cp_rank", "cp_size", "cp_group")}
                     | {"status": "captured", "file": rel, "bytes": nbytes, "tensors": meta["tensors"],
                        "missing": meta["missing"]})
        self._announce(call, nbytes, time.monotonic() - t0)

    def _fail(self, call, reason):
        with call.lock:
            if call.state in ("written", "failed"):
                return
            call.state = "failed"
        with self._lock:
            if call in self._pending:
                self._pending.remove(call)
        if call.partial and os.path.lexists(call.partial):
            try:
                os.unlink(call.partial)
            except OSError:
                pass
        base = {k: call.meta[k] for k in ("call", "step", "layer", "occurrence", "source", "rank", "order")}
        self._not_captured(base, "write_failed", reason)

    def _discard(self, call):
        """The attention raised: nothing of the call is kept (the user's exception goes on as it was)."""
        with call.lock:
            call.state = "failed"
        if call.partial and os.path.lexists(call.partial):
            try:
                os.unlink(call.partial)
            except OSError:
                pass

    def _flush(self, rank=None, before=None):
        with self._lock:
            chosen = [c for c in self._pending
                      if (rank is None or c.meta["rank"] == rank)
                      and (before is None or c.meta["step"] < before or before < 0)]
            for c in chosen:
                self._pending.remove(c)
        for c in chosen:
            self._finish(c)

    # ------------------------------------------------------------------ records and warnings
    def _record(self, rank, record):
        line = (json.dumps(record, allow_nan=False, separators=(", ", ": ")) + "\n").encode()
        with self._lock:
            if self._closed:
                return
            fd = self._index.get(rank, 0)
            if fd == 0:
                path = os.path.join(self.folder, f"index.rank{rank}.jsonl")
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                except FileExistsError:
                    fd = None
                    self._warn(("index", rank), f"cpgold.capture: {path} exists (an earlier capture's): rank {rank} "
                                                "is not recorded in this folder")
                except OSError as e:
                    fd = None
                    self._warn(("index", rank), f"cpgold.capture: cannot create {path} ({e}): rank {rank} is not "
                                                "recorded")
                self._index[rank] = fd
            if fd is None:
                return
            try:
                os.write(fd, line)
            except OSError as e:
                self._warn(("index-write", rank), f"cpgold.capture: cannot write index.rank{rank}.jsonl ({e})")

    def _not_captured(self, base, status, reason):
        with self._lock:
            self.not_captured += 1
        self._record(base["rank"], dict(base, status=status, reason=reason))
        self._warn((status, base["source"], reason.split(":")[0]),
                   f"cpgold.capture: {base['call']} (rank {base['rank']}, {base['source']}) not captured: {reason}")

    def _warn(self, key, message):
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        try:
            warnings.warn(message, CaptureWarning, stacklevel=_outside_this_package())
        except Exception:  # noqa: BLE001 - warnings turned into errors must not reach the user's step
            try:
                print(message, file=sys.stderr)
            except Exception:  # noqa: BLE001
                pass

    def _internal(self, e):
        self._warn(("internal", type(e).__name__, str(e)[:200]),
                   f"cpgold.capture: a call was not captured because of an error in the capture itself "
                   f"({type(e).__name__}: {e}); the step goes on unchanged")


def _outside_this_package():
    """warnings.warn's stacklevel that names the first frame outside cpgold.capture (the user's line)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def _is_te_dpa(module):
    cls = type(module)
    return cls.__name__ == "DotProductAttention" and cls.__module__.split(".")[0] == "transformer_engine"


def attention(cap, fn=None, **spec):
    """cpgold.capture.attention(cap, fn, **spec) is cap.attention(fn, **spec): a user's own attention function
    recorded by `cap` (used as a decorator without fn)."""
    if not isinstance(cap, Capture):
        raise InputError(f"cap: expected a cpgold.capture.Capture, got {type(cap).__name__}", "cap")
    return cap.attention(fn, **spec)
