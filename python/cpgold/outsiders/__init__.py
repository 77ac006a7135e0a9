"""Outsiders: other implementations of attention checked against cpgold fixtures through one interface
(docs/outsiders.md).

    python3 -m cpgold.outsiders fa3 fixtures-quick/ --summary fa3.json          # one line per implementation
    python3 -m cpgold.outsiders te --backend flash --deterministic DIR...

Adapters (name: implementation): varlen (PyTorch's varlen_attn, FlashAttention-2 inside), fa3
(FlashAttention-3, flash_attn_interface), fa4 (FlashAttention-4, flash_attn.cute), cudnn (cuDNN's THD graph through
its frontend), te (TransformerEngine's DotProductAttention, non-CP), te_cp (TransformerEngine's CP with W thread
ranks on one GPU). From Python: `make("fa3")`, then `runner.run_fixture(adapter, path, suite, workdir)` or your own
loop over `adapter.run(fixture)`. A new implementation is a subclass of `Adapter` (adapter.py).

A resident adapter for `cpgold shrink` (the implementation loaded once): `python3 -m cpgold.outsiders.serve start
SOCKET ADAPTER ...`, then COMMAND `python3 -m cpgold.outsiders.serve run SOCKET {fixture} {candidate}` (serve.py).

One process per rank (torchrun, NCCL or gloo): `torchrun --nproc-per-node W -m cpgold.outsiders.ranks te_cp DIR...
--out OUT` with per-rank adapters (rank_adapter.py; docs/outsiders-nccl.md).
"""
import importlib

from .adapter import Adapter, Outcome, Refused

ADAPTERS = {
    "varlen": ("flash", "VarlenAttn", "PyTorch's varlen_attn (FlashAttention-2): valid tokens compacted"),
    "fa3": ("flash", "FlashAttn3", "FlashAttention-3: padded offsets + seqused_q/k, pad rows unwritten"),
    "fa4": ("flash", "FlashAttn4", "FlashAttention-4 (CuTe DSL): padded offsets + seqused_q/k, pad rows unwritten"),
    "cudnn": ("cudnn", "CudnnThd", "cuDNN fused attention, THD with ragged offsets (cudnn frontend)"),
    "te": ("te", "TeDotProductAttention", "TransformerEngine DotProductAttention, non-CP (--backend fused|flash)"),
    "te_cp": ("te", "TeContextParallel",
              "TransformerEngine CP with W thread ranks on one GPU (--backend fused|flash; --set timeout=, repeat=, "
              "poison=, trace=)"),
}


def make(name, **options):
    """An adapter by name, constructed with its options (deterministic=, backend=, ...). ValueError for an unknown
    name or option; ImportError (with the module named) when the implementation is not installed."""
    if name not in ADAPTERS:
        raise ValueError(f"adapter: {name!r} is not one of {', '.join(ADAPTERS)}")
    module, cls, _ = ADAPTERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(**options)


__all__ = ["Adapter", "Outcome", "Refused", "ADAPTERS", "make"]
