"""W ranks of torch.distributed as threads of one process: check torch CP code without W GPUs.

    from cpgold.thread_ranks import ThreadRanks

    def rank_main(rank, ranks):                 # runs once per rank, each in its own thread
        group = ranks.group()                   # this rank's handle of the world group (a ProcessGroup)
        ...torch.distributed calls with group=group, exactly as under NCCL...
        return outputs

    results = ThreadRanks(4).run(rank_main)     # [result of rank 0, ..., rank 3]; device: "cuda" when torch has a
                                                # GPU, else "cpu" (give device= to choose)

Every rank is a thread; every message is a device-to-device copy on the one GPU (or a host copy for CPU
tensors). While `run` is active, torch.distributed's functions route calls whose group is one of these groups
(`ranks.group()`, `ranks.new_group(members)`), or that name no group inside a rank thread (the default group is then
the world of thread ranks, as under `init_process_group`), to the thread ranks, and every other call to torch itself:
`is_initialized`, `get_rank`, `get_world_size`, `send`, `recv` (blocking), `isend`, `irecv`, `P2POp`,
`batch_isend_irecv`, `all_to_all_single`, `all_gather_into_tensor`, `all_gather`, `reduce_scatter_tensor`,
`all_reduce`, `broadcast`, `barrier`. That is what TransformerEngine's CP paths call (p2p, a2a, all_gather, a2a+p2p)
and what simple rings use; code that calls another collective of torch.distributed on a thread group (or without a
group inside a rank thread) gets a ThreadRankError naming the call. A group is a `torch.distributed.ProcessGroup`, so
`isinstance` checks pass.

Ordering follows NCCL's contract: sends and receives between two ranks of one group match in the order they were
posted, and the k-th collective of a group on one rank meets the k-th on every other. A transfer is enqueued on a
stream of its own as soon as both sides have posted, after the events recorded on each poster's current stream;
`Work.wait()` (or a synchronous call) makes the caller's current stream wait for it. Nothing buffers silently:
a send whose receive never comes, or a collective a rank never joins, fails after `timeout` seconds (default 120;
None waits without bound) naming the rank, the operation, the rank that never arrived and what that rank was last
doing (its last thread-rank call, or none, and where its code is now). A rank that returned waits for the others the
same way: when no rank has made a thread-rank call for `timeout` seconds while another rank is still running outside
one, the run stops naming it. Reductions sum in rank order in the tensor's dtype, so a rerun gives the same bits.

Stopping: a timeout (or another failed communication) or KeyboardInterrupt in the main thread stops the run at
once: every rank waiting in a thread-rank call raises ThreadRankError, and a rank busy outside one (computing,
sleeping, looping in Python) gets RankStopped raised asynchronously in its thread, so it unwinds at its next Python
instruction. After an exception of a rank's own code, the waiting ranks raise at once and the busy ones run on to
their next thread-rank call (which raises) or their return, for up to `timeout` seconds before they are stopped the
same way: the lowest rank whose code raises is the one reported, whichever raised first. Rank threads are daemon
threads: `run` waits up to STOP_GRACE seconds for them to end, then raises anyway, naming any rank thread still
running (one inside a long C call) and where it is.

Backward passes run on the calling thread (`torch.autograd.set_multithreading_enabled(False)` in every rank
thread): the autograd engine's one worker thread per GPU would otherwise run the ranks' backwards one after the
other, and a ring backward waiting for its neighbour would never finish.
"""
import collections
import contextlib
import ctypes
import math
import numbers
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .errors import InputError

__all__ = ["ThreadRanks", "RankGroup", "ThreadRankError", "RankStopped", "STOP_GRACE"]

# Seconds `run` waits for the rank threads to end once the run stops (an exception, a timeout, KeyboardInterrupt).
STOP_GRACE = 5.0


class ThreadRankError(RuntimeError):
    """A communication between thread ranks that cannot complete (timeout, aborted peer, mismatched call)."""


class RankStopped(BaseException):
    """Raised asynchronously in a rank thread that is busy outside any thread-rank call when the run stops (another
    rank failed, a timeout, KeyboardInterrupt in the main thread), so that it unwinds. A BaseException, as
    KeyboardInterrupt is, so that `except Exception` in the rank's code does not keep it running."""


def timeout_seconds(timeout, field="timeout"):
    """None (no bound) or a positive finite number of seconds as a float; InputError naming `field` otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise InputError(f"{field}: expected None or a positive finite number of seconds, got {timeout!r}", field)
    return float(timeout)


def _where(thread, depth=3):
    """Where a thread's Python code is now: its innermost frames, innermost first."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident is not None else None
    parts = []
    while frame is not None and len(parts) < depth:
        parts.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return " <- ".join(parts) if parts else "not running Python code"


def _process_group_base():
    return getattr(dist, "ProcessGroup", object)


class RankGroup(_process_group_base()):
    """One rank's handle of a group of thread ranks: rank() and size() as in torch, plus the global ranks."""

    def __init__(self, comm, rank_in_group):
        base = _process_group_base()
        if base is not object:
            try:
                base.__init__(self, rank_in_group, len(comm.members))
            except TypeError:  # torch versions whose ProcessGroup takes a store first
                base.__init__(self, None, rank_in_group, len(comm.members))
        self._comm = comm
        self._rank = rank_in_group

    def rank(self):
        return self._rank

    def size(self):
        return len(self._comm.members)

    def global_ranks(self):
        return list(self._comm.members)

    def group_rank(self, global_rank):
        try:
            return self._comm.members.index(global_rank)
        except ValueError:
            raise ThreadRankError(f"rank {global_rank} is not a member of group {self._comm.members}") from None

    def __repr__(self):
        return f"RankGroup(members={self._comm.members}, rank={self._rank})"

    # torch.distributed.ProcessGroup's own methods are not used: the module functions below are patched instead.
    def name(self):
        return f"cpgold-thread-ranks{tuple(self._comm.members)}"

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


class _Work:
    """What isend/irecv/async collectives return: wait() blocks until the transfer is enqueued, then orders the
    caller's current stream after it."""

    def __init__(self, world, what):
        self._world = world
        self._what = what
        self.done_event = None   # a torch.cuda.Event once the transfer is enqueued, or True for host copies
        self.error = None

    def _ready(self):
        return self.done_event is not None or self.error is not None

    def missing(self):
        """Global ranks whose matching call has not come (set by the poster)."""
        return []

    def wait(self, timeout=None):
        self._world.wait_for(self._ready, self._what, self.missing)
        if self.error is not None:
            raise ThreadRankError(f"{self._what}: {self.error}")
        if self.done_event is not True:
            torch.cuda.current_stream().wait_event(self.done_event)
        return True

    def is_completed(self):
        return self._ready()

    def is_success(self):
        return self.done_event is not None and self.error is None

    def synchronize(self):
        self.wait()

    def get_future(self):
        raise ThreadRankError(f"{self._what}: Work.get_future() is not offered by thread ranks")


class _Half:
    """One side of a point-to-point transfer, or one rank's part of a collective."""

    def __init__(self, tensor, work, event, extra=None):
        self.tensor = tensor
        self.work = work
        self.event = event
        self.extra = extra


class _Comm:
    def __init__(self, members):
        self.members = tuple(members)
        self.sends = collections.defaultdict(collections.deque)   # (src, dst) -> posted sends not yet matched
        self.recvs = collections.defaultdict(collections.deque)   # (src, dst) -> posted receives not yet matched
        self.collective_count = collections.Counter()              # group rank -> collectives posted
        self.rounds = {}                                           # sequence number -> {group rank: _Half}


class P2POp:
    """torch.distributed.P2POp for thread-rank groups (torch's own refuses the patched isend/irecv)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = op, tensor, peer, group, tag, \
            group_peer


class ThreadRanks:
    """World of `world_size` thread ranks on one device. `run(fn)` calls fn(rank, self) in one thread per rank and
    returns the results in rank order; the first exception of any rank is raised (naming the rank) once all threads
    have ended."""

    def __init__(self, world_size, device=None, timeout=120.0):
        """timeout: seconds a rank waits for its peers at one thread-rank call (and a rank that returned for the
        others' next call), default 120; None waits without bound. InputError for anything but None or a positive
        finite number."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
        self.timeout = timeout_seconds(timeout)
        self.world_size = world_size
        if device is None:  # a CPU-only torch runs the ranks on the CPU
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}, but this torch has no CUDA device (torch.cuda.is_available() is "
                             "False): use device='cpu' with CPU tensors")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cond = threading.Condition()
        self._comms = {}
        self._local = threading.local()
        self._abort = None          # why the run stops (a sentence), or None
        self._abort_now = False     # stop the busy ranks at once (else once they had `timeout` to get to a call)
        self._abort_at = None
        self._transfer_stream = None
        self.transfers = collections.Counter()   # operation -> count, for the record of a run
        self._threads = []
        self._doing = {}          # rank -> [last thread-rank call, since (monotonic), waiting in it, returned]
        self._activity = 0.0      # monotonic time of the last thread-rank call of any rank, or of a rank's return
        self._stop_sent = set()   # ranks RankStopped was raised in
        self.left_running = []    # names of rank threads still running when the last run returned or raised

    # ---------------------------------------------------------------- groups
    def rank(self):
        r = getattr(self._local, "rank", None)
        if r is None:
            raise ThreadRankError("not called from a rank thread of ThreadRanks.run")
        return r

    def _comm(self, members):
        members = tuple(int(m) for m in members)
        if not members or len(set(members)) != len(members) or not all(0 <= m < self.world_size for m in members):
            raise ValueError(f"group members: expected distinct ranks in [0, {self.world_size}), got {list(members)}")
        with self._cond:
            return self._comms.setdefault(members, _Comm(members))

    def group(self):
        """This rank's handle of the world group."""
        return self.new_group(range(self.world_size))

    def new_group(self, members):
        """This rank's handle of the group `members` (global ranks; this rank must be one of them)."""
        comm = self._comm(members)
        r = self.rank()
        if r not in comm.members:
            raise ThreadRankError(f"rank {r} asked for a handle of group {list(comm.members)} it is not in")
        return RankGroup(comm, comm.members.index(r))

    # ---------------------------------------------------------------- waiting
    def _note(self, rank, what, waiting=False):
        """Records what a rank does (its last thread-rank call); called with self._cond held."""
        now = time.monotonic()
        self._doing[rank] = [what, now, waiting, False]
        self._activity = now

    def describe(self, rank):
        """What a rank was last doing, for an error: its last thread-rank call (or none), and where its code is."""
        what, since, waiting, returned = self._doing.get(rank, (None, time.monotonic(), False, False))
        age = time.monotonic() - since
        if returned:
            return f"rank {rank} returned from the rank function {age:.1f} s ago"
        if waiting:
            return f"rank {rank} is waiting in {what} (for {age:.1f} s)"
        thread = self._threads[rank] if rank < len(self._threads) else None
        last = f"since {what}, {age:.1f} s ago" if what else f"yet ({age:.1f} s into the run)"
        return f"rank {rank} has made no thread-rank call {last}; its code is now at {_where(thread)}"

    def wait_for(self, predicate, what, missing=None):
        me = self.rank()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            self._note(me, what, waiting=True)
            ended = "gave up on"
            try:
                while not predicate():
                    if self._abort is not None:
                        raise ThreadRankError(f"rank {me}: {what}: stopped because {self._abort}")
                    left = 1.0 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        absent = [r for r in (missing() if missing else []) if r != me]
                        raise ThreadRankError(f"rank {me}: {what}: no matching call within {self.timeout:g} s" +
                                              "".join(f"; rank {r} never arrived: {self.describe(r)}" for r in absent))
                    self._cond.wait(min(left, 1.0))
                ended = "returned from"
            finally:
                self._note(me, f"{ended} {what}")

    def _event(self):
        if self.device.type != "cuda":
            return None
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    @contextlib.contextmanager
    def _on_transfer_stream(self, halves, tensors):
        """Runs the enclosed copies after every poster's event, and sets each half's work done."""
        if self.device.type != "cuda":
            yield
            for h in halves:
                h.work.done_event = True
            return
        stream = self._transfer_stream
        for h in halves:
            if h.event is not None:
                stream.wait_event(h.event)
        with torch.cuda.stream(stream):
            yield
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
        for h in halves:
            h.work.done_event = done

    # ---------------------------------------------------------------- point to point
    def _p2p(self, kind, tensor, peer, group, group_peer=None):
        comm = group._comm
        me = group.rank()
        other = group_peer if group_peer is not None else group.group_rank(peer)
        src, dst = (me, other) if kind == "send" else (other, me)
        what = f"{kind} {'to' if kind == 'send' else 'from'} rank {comm.members[other]} in group {list(comm.members)}"
        work = _Work(self, what)
        work.missing = lambda: [comm.members[other]]
        half = _Half(tensor, work, self._event())
        with self._cond:
            self._note(self.rank(), f"posted {what}")
            mine, theirs = (comm.sends, comm.recvs) if kind == "send" else (comm.recvs, comm.sends)
            if theirs[(src, dst)]:
                other_half = theirs[(src, dst)].popleft()
                send, recv = (half, other_half) if kind == "send" else (other_half, half)
                if send.tensor.numel() != recv.tensor.numel() or send.tensor.dtype != recv.tensor.dtype:
                    err = (f"send of {tuple(send.tensor.shape)} {send.tensor.dtype} meets receive of "
                           f"{tuple(recv.tensor.shape)} {recv.tensor.dtype}")
                    send.work.error = recv.work.error = err
                else:
                    with self._on_transfer_stream([send, recv], [send.tensor, recv.tensor]):
                        recv.tensor.copy_(send.tensor.view(recv.tensor.shape))
                    self.transfers["send/recv"] += 1
                self._cond.notify_all()
            else:
                mine[(src, dst)].append(half)
        return work

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._p2p("send", tensor, dst, group, group_dst)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        if src is None and group_src is None:
            raise ThreadRankError("irecv without src (receive from any rank) is not offered by thread ranks: name the "
                                  "sending rank")
        return self._p2p("recv", tensor, src, group, group_src)

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        """Blocking send: returns once the matching receive has been posted and the copy enqueued."""
        self.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        """Blocking receive from `src`; returns the sender's global rank, as torch does."""
        self.irecv(tensor, src, group, tag, group_src).wait()
        return src if src is not None else group._comm.members[group_src]

    def batch_isend_irecv(self, ops):
        works = []
        for op in ops:
            kind = "send" if op.op in (_patched["isend"], dist.isend, self.isend) else "recv"
            works.append(self._p2p(kind, op.tensor, op.peer, op.group, op.group_peer))
        return works

    # ---------------------------------------------------------------- collectives
    def _collective(self, name, group, tensor_in, tensor_out, execute, extra=None, async_op=False):
        comm = group._comm
        me = group.rank()
        work = _Work(self, f"{name} in group {list(comm.members)}")
        half = _Half(tensor_in, work, self._event(), extra)
        half.out = tensor_out
        with self._cond:
            self._note(self.rank(), f"joined {work._what}")
            seq = comm.collective_count[me]
            comm.collective_count[me] += 1
            work.missing = lambda: [comm.members[r] for r in range(len(comm.members))
                                    if r not in comm.rounds.get(seq, {})]
            parts = comm.rounds.setdefault(seq, {})
            parts[me] = (name, half)
            if len(parts) == len(comm.members):
                del comm.rounds[seq]
                names = {n for n, _ in parts.values()}
                halves = [parts[r][1] for r in range(len(comm.members))]
                if len(names) != 1:
                    for h in halves:
                        h.work.error = f"collective {seq} of the group is {sorted(names)} on different ranks"
                else:
                    tensors = [t for h in halves for t in (h.tensor, h.out)]
                    try:
                        with self._on_transfer_stream(halves, tensors):
                            execute(halves)
                        self.transfers[name] += 1
                    except Exception as e:  # a shape mismatch, for example: every rank gets the message
                        for h in halves:
                            h.work.error = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
        if async_op:
            return work
        work.wait()
        return None

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        def execute(halves):
            n = input_tensor.shape[0]
            for receiver in halves:
                for r, sender in enumerate(halves):
                    receiver.out.narrow(0, r * n, n).copy_(sender.tensor)
        return self._collective("all_gather_into_tensor", group, input_tensor, output_tensor, execute,
                                async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        def execute(halves):
            for r, h in enumerate(halves):
                for x in halves:
                    x.extra[r].copy_(h.tensor)
        return self._collective("all_gather", group, tensor, None, execute, extra=tensor_list, async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        w = group.size()

        def splits(sizes, t):
            if sizes is None or len(sizes) == 0:
                if t.shape[0] % w:
                    raise ValueError(f"all_to_all_single: {t.shape[0]} rows do not split evenly over {w} ranks")
                sizes = [t.shape[0] // w] * w
            starts = [sum(sizes[:i]) for i in range(w)]
            return list(zip(starts, sizes))

        def execute(halves):
            for s, hs in enumerate(halves):
                src_splits = splits(hs.extra[1], hs.tensor)
                for d, hd in enumerate(halves):
                    dst_splits = splits(hd.extra[0], hd.out)
                    (a, n), (b, m) = src_splits[d], dst_splits[s]
                    if n != m:
                        raise ValueError(f"all_to_all_single: rank {s} sends {n} rows to rank {d}, which expects {m}")
                    hd.out.narrow(0, b, m).copy_(hs.tensor.narrow(0, a, n))
        return self._collective("all_to_all_single", group, input, output, execute,
                                extra=(output_split_sizes, input_split_sizes), async_op=async_op)

    def _reduce(self, parts, op):
        acc = parts[0].clone()
        for p in parts[1:]:
            if op == dist.ReduceOp.SUM:
                acc.add_(p)
            elif op == dist.ReduceOp.MAX:
                torch.maximum(acc, p, out=acc)
            elif op == dist.ReduceOp.MIN:
                torch.minimum(acc, p, out=acc)
            else:
                raise ValueError(f"reduce op {op} is not offered by thread ranks (SUM, MAX, MIN are)")
        return acc

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        def execute(halves):
            n = output.shape[0]
            for r, h in enumerate(halves):
                h.out.copy_(self._reduce([x.tensor.narrow(0, r * n, n) for x in halves], op))
        return self._collective("reduce_scatter_tensor", group, input, output, execute, async_op=async_op)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        def execute(halves):
            total = self._reduce([h.tensor for h in halves], op)
            for h in halves:
                h.tensor.copy_(total)
        return self._collective("all_reduce", group, tensor, None, execute, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        root = group.group_rank(src)

        def execute(halves):
            for h in halves:
                if h is not halves[root]:
                    h.tensor.copy_(halves[root].tensor)
        return self._collective("broadcast", group, tensor, None, execute, async_op=async_op)

    def barrier(self, group=None, async_op=False, device_ids=None):
        return self._collective("barrier", group, None, None, lambda halves: None, async_op=async_op)

    # ---------------------------------------------------------------- running
    def run(self, fn):
        """fn(rank, self) in one thread per rank; returns [results]. Raises ThreadRankError naming the first rank
        that failed (with its exception chained), or the rank that never arrived (timeout). KeyboardInterrupt in the
        main thread stops every rank and is raised again. Either way no rank thread is left running, but one stuck in
        C code past STOP_GRACE seconds: those are named in the error (and in `left_running`)."""
        __tracebackhide__ = True
        if self.device.type == "cuda":
            self._transfer_stream = torch.cuda.Stream(self.device)
        results = [None] * self.world_size
        errors = [None] * self.world_size
        with self._cond:   # a fresh world: nothing of an earlier run (its abort, its half-posted calls) carries over
            self._abort = None
            self._abort_now = False
            self._abort_at = None
            self._comms = {}
            self._activity = time.monotonic()
            self._doing = {r: [None, self._activity, False, False] for r in range(self.world_size)}
            self._stop_sent = set()
            self.left_running = []

        def finished(rank):
            with self._cond:
                e = errors[rank]
                self._doing[rank] = [None, time.monotonic(), False, True]
                self._activity = time.monotonic()
                if e is not None and not isinstance(e, RankStopped) and self._abort is None:
                    first = str(e).splitlines()[0][:300] if str(e) else ""
                    self._abort = f"rank {rank} raised {type(e).__name__}: {first}"
                    self._abort_at = time.monotonic()
                    # A communication that failed (a timeout names a rank that never came) stops the busy ranks at
                    # once; after an exception of the rank's own code they run on to their next thread-rank call,
                    # which raises, or to their return (up to `timeout`), so that the lowest rank whose code raises
                    # is the one reported, whichever raised first.
                    self._abort_now = isinstance(e, ThreadRankError)
                self._cond.notify_all()

        def main(rank):
            __tracebackhide__ = True
            try:
                try:
                    self._local.rank = rank
                    ctx = getattr(torch.autograd, "set_multithreading_enabled", None)
                    if self.device.type == "cuda":
                        torch.cuda.set_device(self.device)
                    with (ctx(False) if ctx else contextlib.nullcontext()):
                        results[rank] = fn(rank, self)
                except BaseException as e:  # noqa: B902 - reported to the caller with its rank
                    errors[rank] = e
                finally:
                    finished(rank)
            except RankStopped as e:  # the one stop request of this thread, arriving during the bookkeeping above
                if errors[rank] is None:
                    errors[rank] = e
                finished(rank)

        with _routing(self):
            self._threads = [threading.Thread(target=main, args=(r,), name=f"cpgold-rank-{r}", daemon=True)
                             for r in range(self.world_size)]
            try:
                for t in self._threads:
                    t.start()
                self._supervise()
            except KeyboardInterrupt as e:
                left = self._stop("the main thread got KeyboardInterrupt")
                if left and hasattr(e, "add_note"):
                    e.add_note(f"cpgold.thread_ranks: {left}")
                raise
            left = self._stop()
        sync_error = None
        if self.device.type == "cuda" and not self.left_running:
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e:  # noqa: BLE001 - a rank's own error, if any, is the one to report
                sync_error = e
        real = [r for r in range(self.world_size) if errors[r] is not None and not isinstance(errors[r], RankStopped)]
        first = next((r for r in real if not isinstance(errors[r], ThreadRankError)), real[0] if real else None)
        tail = f"; {left}" if left else ""
        if first is not None:
            raise ThreadRankError(f"rank {first} of {self.world_size} failed: {type(errors[first]).__name__}: "
                                  f"{errors[first]}{tail}") from errors[first]
        if self._abort is not None or left:   # stopped by the main thread (a rank that never returned)
            raise ThreadRankError(f"{self._abort}{tail}")
        if sync_error is not None:
            raise ThreadRankError(f"every rank returned, then the device reported {type(sync_error).__name__}: "
                                  f"{sync_error}") from sync_error
        return results

    def _supervise(self):
        """The main thread's wait for the rank threads: returns when every rank has ended or the run must stop (an
        abort, or ranks that returned waiting more than `timeout` on a rank busy outside any thread-rank call). Waits
        in short slices, so that KeyboardInterrupt (a signal, or _thread.interrupt_main) is raised at once."""
        with self._cond:
            while any(t.is_alive() for t in self._threads):
                if self._abort is not None:
                    if self._abort_now or (self.timeout is not None and
                                           time.monotonic() - self._abort_at >= self.timeout):
                        break
                else:
                    stalled = self._stalled()
                    if stalled:
                        self._abort, self._abort_now = stalled, True
                        self._cond.notify_all()
                        break
                self._cond.wait(0.1)

    def _stalled(self):
        """The message for ranks that returned while others run outside any thread-rank call and no rank has made a
        call for `timeout` seconds, or None. Called with self._cond held."""
        if self.timeout is None or time.monotonic() - self._activity < self.timeout:
            return None
        returned = [r for r, d in self._doing.items() if d[3]]
        busy = [r for r, t in enumerate(self._threads)
                if t.is_alive() and not self._doing.get(r, (None, 0, False, False))[2]]
        if not returned or not busy:
            return None
        ranks = ", ".join(str(r) for r in returned)
        return (f"rank{'s' if len(returned) > 1 else ''} {ranks} returned and waited {self.timeout:g} s (timeout) "
                f"without a thread-rank call from any rank; " + "; ".join(
                    f"rank {r} never arrived: {self.describe(r)}" for r in busy))

    def _stop(self, reason=None):
        """Stops every rank thread still running: waiting ranks raise at the abort, a rank busy outside any
        thread-rank call gets RankStopped raised in its thread. Waits up to STOP_GRACE seconds for them; returns a
        sentence naming the threads still running after that ("" when none), also kept in `left_running`."""
        with self._cond:
            if reason is not None and self._abort is None:
                self._abort, self._abort_at = reason, time.monotonic()
            self._cond.notify_all()
        deadline = time.monotonic() + STOP_GRACE
        while True:
            with self._cond:
                alive = [(r, t) for r, t in enumerate(self._threads) if t.is_alive()]
                if self._abort is not None:
                    for r, t in alive:
                        waiting = self._doing.get(r, (None, 0, False, False))[2]
                        if not waiting and r not in self._stop_sent and t.ident is not None:
                            self._stop_sent.add(r)
                            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                                       ctypes.py_object(RankStopped))
            if not alive or time.monotonic() >= deadline:
                break
            alive[0][1].join(min(0.05, max(0.0, deadline - time.monotonic())))
        self.left_running = [t.name for _, t in alive]
        if not alive:
            return ""
        return (f"rank threads still running {STOP_GRACE:g} s after the run stopped (daemon threads, left behind; "
                f"inside C code, which no exception interrupts): " +
                "; ".join(f"{t.name} at {_where(t)}" for _, t in alive))


# -------------------------------------------------------------------- routing torch.distributed
_patched = {}
_routing_lock = threading.Lock()
_active = []   # ThreadRanks worlds whose run() is active


def _world_of(group):
    if isinstance(group, RankGroup):
        for w in _active:
            if group._comm is w._comms.get(group._comm.members):
                return w
        raise ThreadRankError(f"{group!r} belongs to a ThreadRanks world that is not running")
    return None


def _thread_world():
    for w in _active:
        if getattr(w._local, "rank", None) is not None:
            return w
    return None


def _make_routes():
    original = {name: getattr(dist, name) for name in
                ("is_initialized", "get_rank", "get_world_size", "send", "recv", "isend", "irecv", "P2POp",
                 "batch_isend_irecv",
                 "all_to_all_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce",
                 "broadcast", "barrier") if hasattr(dist, name)}

    def is_initialized():
        return _thread_world() is not None or original["is_initialized"]()

    def get_rank(group=None):
        w = _world_of(group)
        if w is not None:
            return group.rank()
        if group is None and _thread_world() is not None:
            return _thread_world().rank()
        return original["get_rank"](group) if group is not None else original["get_rank"]()

    def get_world_size(group=None):
        w = _world_of(group)
        if w is not None:
            return group.size()
        if group is None and _thread_world() is not None:
            return _thread_world().world_size
        return original["get_world_size"](group) if group is not None else original["get_world_size"]()

    def routed(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                # torch's signatures put group third for isend/irecv/reduce ops, fourth for all_to_all_single
                pos = {"send": 2, "recv": 2, "isend": 2, "irecv": 2, "all_to_all_single": 4,
                       "all_gather_into_tensor": 2, "all_gather": 2, "reduce_scatter_tensor": 3, "all_reduce": 2,
                       "broadcast": 2, "barrier": 0}[name]
                group = args[pos] if len(args) > pos else None
                if group is not None:
                    args = args[:pos] + args[pos + 1:]
                    kwargs["group"] = group
            w = _world_of(group)
            if w is None:
                if group is None and _thread_world() is not None:
                    # Inside a rank thread the default group is the thread world, as get_rank() and get_world_size()
                    # say: code written for init_process_group runs unchanged.
                    w = _thread_world()
                    kwargs["group"] = w.group()
                    return getattr(w, name)(*args, **kwargs)
                return original[name](*args, **kwargs)
            return getattr(w, name)(*args, **kwargs)
        call.__name__ = name
        return call

    def p2p_op(op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if _world_of(group) is not None:
            return P2POp(op, tensor, peer, group, tag, group_peer)
        if op is _patched.get("isend"):
            op = original["isend"]
        elif op is _patched.get("irecv"):
            op = original["irecv"]
        return original["P2POp"](op, tensor, peer, group, tag)

    def batch_isend_irecv(p2p_op_list):
        ours = [isinstance(op, P2POp) for op in p2p_op_list]
        if any(ours):
            if not all(ours):
                raise ThreadRankError("batch_isend_irecv mixes thread-rank and other process groups")
            return _world_of(p2p_op_list[0].group).batch_isend_irecv(p2p_op_list)
        return original["batch_isend_irecv"](p2p_op_list)

    def refused(name, fn):
        """A collective thread ranks do not offer: a clear error on a thread group (or with no group inside a rank
        thread) instead of torch's "Group ... is not registered"; other groups go to torch."""
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, RankGroup)), None)
            if isinstance(group, RankGroup) or (group is None and _thread_world() is not None):
                raise ThreadRankError(f"torch.distributed.{name} is not offered by thread ranks (offered: send, recv, "
                                      "isend, irecv, batch_isend_irecv, all_to_all_single, all_gather_into_tensor, "
                                      "all_gather, reduce_scatter_tensor, all_reduce, broadcast, barrier)")
            return fn(*args, **kwargs)
        call.__name__ = name
        return call

    routes = {"is_initialized": is_initialized, "get_rank": get_rank, "get_world_size": get_world_size,
              "P2POp": p2p_op, "batch_isend_irecv": batch_isend_irecv}
    for name in ("send", "recv", "isend", "irecv", "all_to_all_single", "all_gather_into_tensor", "all_gather",
                 "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier"):
        if name in original:
            routes[name] = routed(name)
    for name in _REFUSED:
        if hasattr(dist, name):
            original[name] = getattr(dist, name)
            routes[name] = refused(name, original[name])
    return original, routes


# torch.distributed collectives thread ranks do not route: refused with a clear error on a thread group.
_REFUSED = ("all_to_all", "gather", "scatter", "reduce", "reduce_scatter", "all_gather_object", "gather_object",
            "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list",
            "all_reduce_coalesced", "all_gather_coalesced", "monitored_barrier")


@contextlib.contextmanager
def _routing(world):
    with _routing_lock:
        if not _active:
            original, routes = _make_routes()
            _patched.clear()
            _patched.update(routes)
            _patched["_original"] = original
            for name, fn in routes.items():
                setattr(dist, name, fn)
        _active.append(world)
    try:
        yield
    finally:
        with _routing_lock:
            _active.remove(world)
            if not _active:
                for name, fn in _patched.pop("_original").items():
                    setattr(dist, name, fn)
                _patched.clear()
