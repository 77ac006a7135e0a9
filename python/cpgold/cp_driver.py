"""run_cp: your torch CP attention run on a fixture's shards, every rank and the gathered outputs checked.

    def my_ring_attention(q, k, v, ctx):        # this rank's shards [Lq, hq, d], [Lkv, hkv, d] (case dtype, on ctx.device)
        ...torch.distributed calls on ctx.group...
        return o, lse                           # rank-local layout; LSE [h, Lq], [Lq, h] or [Lq, h, 1]

    result = cpgold.run_cp(my_ring_attention, fx)                    # W thread ranks, forward and backward
    result = cpgold.run_cp(my_ring_attention, fx, backward=False)    # forward only: o and lse checked

What TransformerEngine's own CP test harness does, for any torch function: shard the fixture's inputs per rank
(`Fixture.rank_inputs`), run the function on every rank, take dQ, dK, dV by autograd from the fixture's dout shard
(or from the function, when it returns dq, dk, dv itself), gather every rank's outputs to the global layout, and check
every rank (the CP budget, rank-local layout) and the gathered outputs (scope "cp_gathered"). Ranks are W threads of
this process (`cpgold.thread_ranks.ThreadRanks`: CPU tensors, or one GPU), or, when torch.distributed is initialized
(torchrun, one process per GPU, NCCL) or `group=` is given, this process's rank of that group: every process runs its
rank, the outputs are all-gathered, and every process checks all ranks (the same verdict everywhere).
"""
import numpy as np

from . import _arrays
from .candidate import lse_to_ht
from .check import check_outputs, summary, tensor_names
from .errors import InputError
from .fixture import OUTPUT_NAMES, SIDE, Fixture

__all__ = ["run_cp", "RankContext", "CPResult"]

BACKWARD_NAMES = ("dq", "dk", "dv")


class RankContext:
    """What a rank's function gets besides its shards: rank, world_size, group (a torch ProcessGroup: thread ranks or
    the real one), fixture, device, and the rank-local layout as torch tensors on the device. Another rank's layout
    comes from the fixture: `fixture.partitioned_indices(r, "kv")` are the global key rows rank r holds (the keys a
    ring step receives from it), `fixture.cu_seqlens("kv", padded=True)` turns them into sequences and positions."""

    def __init__(self, fixture, rank, world_size, group, device):
        self.fixture, self.rank, self.world_size, self.group, self.device = fixture, rank, world_size, group, device

    def cu_seqlens(self, side, padded=False):
        """[B+1] int32: this rank's cumulative row counts per sequence, or with padded=True the rank-local padded
        offsets (cu_seqlens_padded / W), as TransformerEngine passes them."""
        import torch

        return torch.as_tensor(self.fixture.rank_cu_seqlens(self.rank, side, padded), device=self.device)

    def global_rows(self, side):
        """[L] int64: the global row of every local row (the fixture's partition)."""
        import torch

        return torch.as_tensor(self.fixture.partitioned_indices(self.rank, side), device=self.device)

    def positions(self, side):
        """(sequence, position, valid) per local row, torch tensors on the device: the sequence a row belongs to (-1
        for a tail row), its position in that sequence (the index a mask compares; -1 for a tail row) and whether it
        holds a token (False on pad and tail rows)."""
        import torch

        fx = self.fixture
        rows = fx.partitioned_indices(self.rank, side)
        offsets = fx.cu_seqlens(side, padded=True).astype(np.int64)
        lengths = fx.seqlens(side).astype(np.int64)
        seq = np.searchsorted(offsets, rows, side="right") - 1
        inside = seq < len(lengths)
        safe = np.clip(seq, 0, max(len(lengths) - 1, 0))
        pos = np.where(inside, rows - offsets[safe], -1)
        valid = inside & (pos < np.where(inside, lengths[safe] if len(lengths) else 0, 0))
        return tuple(torch.as_tensor(a, device=self.device) for a in (np.where(inside, seq, -1), pos, valid))

    def __repr__(self):
        return f"RankContext(rank={self.rank}, world_size={self.world_size}, device={self.device})"


class CPResult:
    """outputs: every rank's outputs (float32 numpy, LSE as [h, t]); gathered: the global layout; reports: the per-rank
    report ("ranks") and the gathered one ("gathered"); passed: both pass."""

    def __init__(self, outputs, gathered, reports):
        self.outputs, self.gathered, self.reports = outputs, gathered, reports

    @property
    def passed(self):
        return all(r["pass"] for r in self.reports.values())

    def summary(self):
        """One line per report that failed, as the assertion's first lines."""
        return [f"{what}: {summary(r)}" for what, r in self.reports.items() if not r["pass"]]

    def __repr__(self):
        return f"CPResult(passed={self.passed}, ranks={len(self.outputs)})"


def _as_dict(out, rank):
    """The function's return value of one rank as {name: tensor}; InputError naming the rank and the key otherwise."""
    expected = f"(o, lse) or a dict of some of {', '.join(OUTPUT_NAMES)}"
    if isinstance(out, dict):
        if not out:
            raise InputError(f"rank {rank}: the function returned an empty dict: expected {expected}", "fn")
        unknown = [n for n in out if n not in OUTPUT_NAMES]
        if unknown:
            raise InputError(f"rank {rank}: the function returned the key(s) {', '.join(map(repr, unknown))}: "
                             f"expected {expected}", "fn")
        out = dict(out)
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        out = {"o": out[0], "lse": out[1]}
    else:
        what = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise InputError(f"rank {rank}: the function must return {expected}, got {what}", "fn")
    for name, t in out.items():
        if t is None:
            raise InputError(f"rank {rank}: {name!r} is None: expected a torch tensor or a numpy array", name)
        device = getattr(t, "device", None)
        if getattr(device, "type", None) == "meta":
            raise InputError(f"rank {rank}: {name!r} is a meta tensor (a shape without values, shape "
                             f"{tuple(t.shape)}): expected a tensor that holds values, on the CPU or a GPU", name)
    return out


def _run_rank(fn, fixture, ctx, backward):
    __tracebackhide__ = True
    import torch

    x = fixture.rank_inputs(ctx.rank, "torch", ctx.device)
    q, k, v = (x[n].detach().requires_grad_(backward) for n in ("q", "k", "v"))
    out = _as_dict(fn(q, k, v, ctx), ctx.rank)
    if backward and not all(n in out for n in BACKWARD_NAMES):
        o = out.get("o")
        if o is None or not getattr(o, "requires_grad", False):
            raise InputError(f"rank {ctx.rank}: backward=True, but o {'is missing' if o is None else 'does not require grad'}"
                             " (it is not computed from q, k, v under autograd): return dq, dk, dv from the function, "
                             "or check the forward alone with backward=False (tensors o, lse)", "o")
        grads = torch.autograd.grad(o, (q, k, v), x["dout"].to(o.dtype), allow_unused=True)
        for name, g, ref in zip(BACKWARD_NAMES, grads, (q, k, v)):
            out[name] = g if g is not None else torch.zeros_like(ref)
    return {n: (t.detach() if hasattr(t, "detach") else t) for n, t in out.items()}


def _float32(fixture, out, rank, lse_layout):
    res = {}
    for name, t in out.items():
        try:
            if name == "lse":
                res[name] = lse_to_ht(t, fixture.heads_q, lse_layout)
            else:
                res[name] = _arrays.to_float32(t, name)
        except ValueError as e:
            raise InputError(f"rank {rank}: {e}", name) from None
    return res


def _same_names(names, tensors):
    """names: the tensor names every rank returned, in rank order. InputError naming the rank and the key when the
    ranks differ, or when a tensor `tensors` asks for is missing."""
    every = [n for n in OUTPUT_NAMES if any(n in got for got in names)]
    for r, got in enumerate(names):
        absent = [n for n in every if n not in got]
        if absent:
            other = next(i for i, g in enumerate(names) if absent[0] in g)
            raise InputError(f"rank {r}: the function returned no {absent[0]!r} (it returned "
                             f"{', '.join(n for n in OUTPUT_NAMES if n in got)}), rank {other} did: every rank must "
                             "return the same tensors", absent[0])
    for n in tensor_names(tensors) or ():
        if n not in every:
            ranks = "rank 0" if len(names) == 1 else f"ranks 0 to {len(names) - 1}"
            raise InputError(f"{ranks}: the function returned no {n!r} (it returned {', '.join(every)}), which "
                             f"tensors= checks ({','.join(tensor_names(tensors))}): return it, or leave it out of "
                             "tensors=", n)


def _gather(fixture, outputs):
    gathered = {}
    for name in outputs[0]:
        side = SIDE[name]
        first = outputs[0][name]
        axis = 1 if name == "lse" else 0
        shape = list(first.shape)
        shape[axis] = fixture.total_rows(side)
        g = np.full(shape, -np.inf if name == "lse" else 0.0, dtype=np.float32)
        for r, out in enumerate(outputs):
            idx = fixture.partitioned_indices(r, side)
            if out[name].shape[axis] != len(idx):
                raise InputError(f"rank {r}: {name} has {out[name].shape[axis]} rows on axis {axis}, the fixture's "
                                 f"partition gives the rank {len(idx)} (shape {tuple(out[name].shape)})", name)
            if axis == 0:
                g[idx] = out[name]
            else:
                g[:, idx] = out[name]
        gathered[name] = g
    return gathered


def _in_process_group(group):
    import torch.distributed as dist

    from .thread_ranks import _thread_world

    return group is not None or (dist.is_available() and dist.is_initialized() and _thread_world() is None)


def run_cp(fn, fixture, backward=True, tensors=None, device=None, group=None, timeout=120.0, lse_layout=None,
           empty_row_lse="neg-inf", diagnosis=True, check=True, msg=None):
    """Runs fn(q, k, v, ctx) on every CP rank of the fixture and checks every rank and the gathered outputs.

    fn: your CP attention for one rank: q, k, v are the rank's shards (torch tensors of the case dtype on the device,
    requiring grad when backward); ctx a RankContext (rank, world_size, group, cu_seqlens, positions, ...). It returns
    (o, lse) or a dict of some of o, lse, dq, dk, dv in the rank-local layout (LSE [h, t], [t, h] or [t, h, 1]).
    backward: dq, dk, dv by autograd of o against the fixture's dout shard, unless fn returns them; False checks the
    forward alone (tensors "o,lse"). tensors: what is checked (default: all five, or o and lse without backward).
    device: "cpu", "cuda", ... (default: cuda when torch has a GPU, else cpu). group: run under this process group
    (one process per rank) instead of thread ranks; an initialized torch.distributed selects that mode as well.
    timeout (thread ranks): seconds a rank waits for its peers at one torch.distributed call, default 120; None waits
    without bound; anything but None or a positive finite number is an InputError. Past it the run raises
    ThreadRankError naming the rank that never arrived and what it was last doing, and stops every rank thread
    (cpgold.thread_ranks: "Stopping"); so does KeyboardInterrupt, which is raised again.
    Unusable returns (an empty dict, a tensor that is None or a meta tensor, ranks returning different tensors, a
    tensor `tensors` names that no rank returned) are an InputError naming the rank and the key.
    check: raise AssertionError (summary line first) when a check fails; False returns the result either way.
    Returns a CPResult (outputs per rank, gathered outputs, the two reports)."""
    __tracebackhide__ = True
    import torch

    from .thread_ranks import timeout_seconds

    timeout = timeout_seconds(timeout)
    if not isinstance(fixture, Fixture):
        with Fixture(fixture) as opened:
            return run_cp(fn, opened, backward, tensors, device, group, timeout, lse_layout, empty_row_lse, diagnosis,
                          check, msg)
    if tensors is None and not backward:
        tensors = "o,lse"
    w = fixture.cp_size
    if _in_process_group(group):
        import torch.distributed as dist

        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        if size != w:
            raise InputError(f"group: the process group has {size} ranks, the fixture {fixture.path} has cp_size {w}: "
                             "pass the CP group (group=) or a fixture of that many ranks", "group")
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        ctx = RankContext(fixture, rank, w, group if group is not None else dist.group.WORLD, torch.device(device))
        mine = _run_rank(fn, fixture, ctx, backward)
        # Which tensors every rank returned, first: a rank that returned other tensors is then the same InputError on
        # every process, not all-gathers that never match.
        have = torch.tensor([int(n in mine) for n in OUTPUT_NAMES], dtype=torch.int32, device=ctx.device)
        parts = [torch.empty_like(have) for _ in range(w)]
        dist.all_gather(parts, have, group=group)
        _same_names([[n for n, b in zip(OUTPUT_NAMES, p.tolist()) if b] for p in parts], tensors)
        raw = [dict() for _ in range(w)]
        for name in sorted(mine):
            t = mine[name].contiguous()
            parts = [torch.empty_like(t) for _ in range(w)]
            dist.all_gather(parts, t, group=group)
            for r in range(w):
                raw[r][name] = parts[r]
    else:
        from .thread_ranks import ThreadRankError, ThreadRanks

        ranks = ThreadRanks(w, device=device, timeout=timeout)

        def rank_main(rank, world):
            __tracebackhide__ = True
            return _run_rank(fn, fixture, RankContext(fixture, rank, w, world.group(), world.device), backward)

        try:
            raw = ranks.run(rank_main)
        except ThreadRankError as e:
            # The rank's own exception, with its own traceback (the user's code), not chained under the thread runner's.
            cause = e.__cause__
            if cause is None or isinstance(cause, ThreadRankError) or not isinstance(cause, Exception):
                raise
            if hasattr(cause, "add_note"):
                cause.add_note(f"cpgold.run_cp: raised on {str(e).split(':')[0]}")
                if ranks.left_running:
                    cause.add_note(f"cpgold.run_cp: rank threads still running after the run stopped (inside C code): "
                                   f"{', '.join(ranks.left_running)}")
            raise cause from None
        _same_names([list(out) for out in raw], tensors)
    outputs = [_float32(fixture, out, r, lse_layout) for r, out in enumerate(raw)]
    gathered = _gather(fixture, outputs)
    options = dict(tensors=tensors, empty_row_lse=empty_row_lse, lse_layout="ht", diagnosis=diagnosis)
    reports = {"ranks": check_outputs(fixture, outputs, **options),
               "gathered": check_outputs(fixture, gathered, scope="cp_gathered", **options)}
    result = CPResult(outputs, gathered, reports)
    if check and not result.passed:
        lines = [f"cpgold: {line}" for line in result.summary()]
        details = [f"--- {what}: {'pass' if r['pass'] else 'FAIL'} (fixture {fixture.path})\n\n{r.text}"
                   for what, r in reports.items() if not r["pass"]]
        raise AssertionError((f"{msg}\n" if msg else "") + "\n".join(lines) + "\n\n" + "\n".join(details))
    return result
