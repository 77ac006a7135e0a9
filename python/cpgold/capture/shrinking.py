"""shrink: from a captured call whose attention fails, the smallest case cut out of the captured tensors on which the
user's attention still fails the same way (docs/capture.md, "shrink").

cpgold.shrink searches over seeded cases; a captured failure lives in its captured values, so here every cut keeps
them: a cut drops sequences, shortens sequences (keeping their first tokens, K/V with Q where they are laid out
alike), drops KV heads with their query heads (GQA groups stay whole) or query heads of every group alike, or runs on
fewer CP ranks (the captured rows re-laid for W' ranks: padded lengths rounded to 2W', pad and tail rows filled from
the captured pad rows, so NaN pads stay NaN). After each cut the golden is made from the cut inputs
(cpgold.generate(case, inputs=...)) and the user's attention reruns on that fixture, in one of two forms:

- fn(fixture), a Python function (as cpgold.shrink's fn: it returns global outputs or every rank's);
- COMMAND, a shell command run as `cpgold shrink` runs its COMMAND (apps/shrink_command.cpp, docs/shrink.md): the
  fixture is written to a file, {fixture}, {candidate} and {rank} are replaced once by absolute paths of safe
  characters only, COMMAND runs in a process group of its own under a run timeout (its escaped descendants reaped
  by a child subreaper, _REAPER below), and the candidate file it writes is checked.

A cut is kept only while the check still fails with every diagnosis kind of the original failure and names no cause
the original's does not (symptoms apart: pad_rows_not_zero, nonfinite_leak), as cpgold.shrink keeps a case; where
the answer's diagnosis is not the original's, a note says why. Cuts are tried
greedily, biggest first, until none is kept, the budget is spent or max_runs is reached; the answer is then rerun
`confirm` times, as `cpgold shrink` confirms its answer. The smallest case is saved as case.json and inputs.h5, which
`cpgold gen --case "$(cat case.json)" --inputs inputs.h5 -o X.h5` turns into its fixture.
"""
import json
import math
import numbers
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ..errors import CheckInputError, InputError
from ..shrink import _name_note, _same_way
from . import _folder
from .joining import load_joined


def _rows(case, side):
    lens = [int(x) for x in case[f"seqlens_{side}"]]
    padded = [int(x) for x in case[f"padded_{side}"]]
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    return lens, padded, offsets, int(case[f"total_tokens_{side}"])


def _round(n, m):
    return (n + m - 1) // m * m


def _pad_pool(x, lens, offsets, total):
    """The captured pad and tail rows of a tensor, in order (what new pad rows are filled from)."""
    idx = []
    for b, n in enumerate(lens):
        idx.extend(range(offsets[b] + n, offsets[b + 1]))
    idx.extend(range(offsets[-1], total))
    return x[np.asarray(idx, dtype=np.int64)] if idx else None


def _fill(pool, n, like):
    if n == 0:
        return np.zeros((0,) + like.shape[1:], dtype=like.dtype)
    if pool is None or len(pool) == 0:
        return np.zeros((n,) + like.shape[1:], dtype=like.dtype)
    reps = -(-n // len(pool))
    return np.concatenate([pool] * reps)[:n]


def cut(case, inputs, keep=None, lengths=None, cp_size=None, kv_heads=None, group=None):
    """A new (case, inputs) cut out of (case, inputs): keep (sequences kept, in order), lengths ({side: [new length per
    kept sequence]}), cp_size (W'), kv_heads (KV heads kept), group (query heads kept per KV head: the first ones).
    The case is not validated here."""
    w_old = int(case["cp_size"])
    w = int(cp_size or w_old)
    b_all = len(case["seqlens_q"])
    keep = list(range(b_all)) if keep is None else list(keep)
    hkv, hq = int(case["heads_kv"]), int(case["heads_q"])
    g_old = hq // hkv
    kv_heads = list(range(hkv)) if kv_heads is None else list(kv_heads)
    g = g_old if group is None else int(group)
    q_heads = [h * g_old + j for h in kv_heads for j in range(g)]
    new_case = {k: v for k, v in case.items() if k not in ("padded_q", "padded_kv", "total_tokens_q",
                                                           "total_tokens_kv", "seqlens_q", "seqlens_kv")}
    new_inputs = {}
    for side, names in (("q", ("q", "dout")), ("kv", ("k", "v"))):
        lens, padded, offsets, total = _rows(case, side)
        new_lens = [lens[b] for b in keep] if lengths is None or side not in lengths else list(lengths[side])
        extra = [max(padded[b] - _round(lens[b], 2 * w_old), 0) for b in keep]
        new_padded = [_round(n, 2 * w) + _round(e, 2 * w) if e else _round(n, 2 * w)
                      for n, e in zip(new_lens, extra)]
        tail = total - int(offsets[-1])
        if tail and case.get("comm", "p2p") == "p2p":
            new_tail = max(tail // w, 1) * w
        else:
            new_tail = 0
        new_case[f"seqlens_{side}"] = new_lens
        new_case[f"padded_{side}"] = new_padded
        new_case[f"total_tokens_{side}"] = int(sum(new_padded) + new_tail)
        for name in names:
            x = inputs[name]
            heads = q_heads if side == "q" else kv_heads
            x = x[:, heads]
            pool = _pad_pool(x, lens, offsets, total)
            parts = []
            for b, n, p in zip(keep, new_lens, new_padded):
                parts.append(x[offsets[b]:offsets[b] + n])
                parts.append(_fill(pool, p - n, x))
            parts.append(_fill(pool, new_tail, x))
            new_inputs[name] = np.ascontiguousarray(np.concatenate(parts))
    new_case.update(cp_size=w, heads_kv=len(kv_heads), heads_q=len(q_heads))
    if w == 1 or new_case.get("comm") in ("p2p", "all_gather"):
        new_case.pop("a2a_size", None)
    if w == 1:
        new_case["comm"] = "p2p"
    return new_case, new_inputs


def _candidates(case):
    """Cuts of a case, biggest first: [(description, keyword arguments of cut)]."""
    out = []
    b = len(case["seqlens_q"])
    w = int(case["cp_size"])
    same = case["seqlens_q"] == case["seqlens_kv"]
    if b > 1:
        out.append((f"keep sequences 0..{b // 2 - 1} of {b}", dict(keep=list(range(b // 2)))) if b > 2 else None)
        for i in range(b):
            out.append((f"drop sequence {i}", dict(keep=[j for j in range(b) if j != i])))
    for w2 in sorted({1, 2, w // 2, w - 1}):
        if 1 <= w2 < w:
            out.append((f"cp_size {w} -> {w2}", dict(cp_size=w2)))
    lq, lkv = list(case["seqlens_q"]), list(case["seqlens_kv"])
    for i in range(b):
        for side_lens, sides in (((lq, lkv), ("q", "kv")),) if same else (((lq,), ("q",)), ((lkv,), ("kv",))):
            n = side_lens[0][i]
            for m in sorted({n // 2, n - max(1, n // 4), n - 1}):
                if 0 < m < n:
                    lengths = {}
                    for s, ls in zip(sides, side_lens):
                        new = list(ls)
                        new[i] = m
                        lengths[s] = new
                    out.append((f"sequence {i}: {'/'.join(sides)} length {n} -> {m}", dict(lengths=lengths)))
    hkv, hq = int(case["heads_kv"]), int(case["heads_q"])
    g = hq // hkv
    if hkv > 1:
        out.append((f"KV heads {hkv} -> {hkv // 2} (with their query heads)", dict(kv_heads=list(range(hkv // 2)))))
        for h in range(hkv):
            out.append((f"drop KV head {h} (with its {g} query heads)",
                        dict(kv_heads=[x for x in range(hkv) if x != h])))
    for g2 in sorted({1, g // 2, g - 1}):
        if 1 <= g2 < g:
            out.append((f"query heads per KV head {g} -> {g2}", dict(group=g2)))
    return [c for c in out if c is not None]


# ---------------------------------------------------------------------------------------------- COMMAND's runs

LOG_KEEP = 64 * 1024  # what is kept of a run's output: its first and its last this many bytes
DEFAULT_RUN_TIMEOUT = 300.0
_TERM_GRACE = 2.0  # seconds between SIGTERM and SIGKILL, as `cpgold shrink`
_PLACEHOLDER = re.compile(r"\{fixture\}|\{candidate\}|\{rank\}")
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")


def safe_path(path):
    """An absolute path of letters, digits and . _ / - only: nothing in it a shell expands or splits, however COMMAND
    quotes its placeholders."""
    return bool(_SAFE_PATH.match(path))


def with_placeholders(command, fixture, candidate, rank):
    """COMMAND with {fixture}, {candidate} and {rank} replaced in one pass: the values are never searched for
    placeholders themselves."""
    values = {"{fixture}": fixture, "{candidate}": candidate, "{rank}": str(rank)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(0)], command)


class _CappedLog:
    """The output of a run's processes: at most LOG_KEEP bytes from its start and LOG_KEEP from its end."""

    def __init__(self):
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data):
        self.total += len(data)
        room = LOG_KEEP - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * LOG_KEEP:
                del self.tail[:-LOG_KEEP]

    def text(self):
        tail = bytes(self.tail[-LOG_KEEP:])
        dropped = self.total - len(self.head) - len(tail)
        middle = (f"\n[cpgold.capture shrink: {dropped} bytes of output left out here; the first and last "
                  f"{LOG_KEEP // 1024} KiB are kept]\n").encode() if dropped else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", "replace")

    def end(self, chars=1200):
        text = self.text()
        return text[-chars:]


# Runs `/bin/sh -c COMMAND` (argv[1:]) as its child and, when it has ended, kills and reaps every process that came
# to it: as a child subreaper (Linux PR_SET_CHILD_SUBREAPER), a process COMMAND started in a session or group of its
# own (setsid, a double fork) becomes its child when its parent ends. SIGTERM (the run timeout, the budget, a signal
# to the search) is passed to its children, SIGKILL 2 s later. It exits as COMMAND did (a signal: the same signal).
# Run with `python -I -S -c`, so that nothing of the environment changes it; COMMAND gets the environment unchanged.
_REAPER = r"""
import ctypes, os, signal, sys, time

def children():
    me, found = os.getpid(), []
    try:
        names = os.listdir('/proc')
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open('/proc/' + name + '/stat', 'rb') as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b')') + 1:].split()
        if len(rest) > 1 and int(rest[1]) == me:
            found.append(int(name))
    return found

def kill_all(sig):
    for pid in children():
        try:
            os.kill(pid, sig)
        except OSError:
            pass

try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
except Exception:
    pass
watched = {signal.SIGCHLD, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, watched)
main = os.fork()
if main == 0:
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.execv(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
status, ending = None, None
while status is None:
    try:
        pid, st = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == main:
        status = st
    elif pid == 0:
        if ending is not None and time.monotonic() > ending:
            kill_all(signal.SIGKILL)
        info = signal.sigtimedwait(watched, 0.05)
        if info is not None and info.si_signo == signal.SIGTERM and ending is None:
            kill_all(signal.SIGTERM)
            ending = time.monotonic() + 2.0
for _ in range(100):
    left = children()
    if not left:
        break
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in left:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
if status is None:
    os._exit(127)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
"""


def _program(command):
    """argv that runs COMMAND: through the reaper where this Python can run it, else /bin/sh alone (its process group
    is then all that is killed)."""
    shell = ["/bin/sh", "-c", command]
    if sys.platform.startswith("linux") and sys.executable and os.path.isfile(sys.executable):
        return [sys.executable, "-I", "-S", "-c", _REAPER] + shell
    return shell


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_commands(commands, log, timeout, deadline, signals):
    """Runs the COMMAND lines at once, each in a process group of its own, stdin from /dev/null, stdout and stderr into
    `log`; waits until all have ended, `timeout` seconds have passed (0: no limit; "timeout"), `deadline` (a
    time.monotonic() value, the budget; "deadline") or a signal came to the search ("signal"). The groups still
    running then get SIGTERM and, 3 s later, SIGKILL; afterwards every group gets SIGKILL (whatever a run left in it).
    Returns (how it ended, [return codes, None where /bin/sh could not start])."""
    read_end, write_end = os.pipe()
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    procs = []
    try:
        for command in commands:
            try:
                procs.append(subprocess.Popen(_program(command), stdin=subprocess.DEVNULL, stdout=write_end,
                                              stderr=write_end, close_fds=True, **group))
            except (OSError, ValueError) as e:
                procs.append(None)
                log.add(f"cannot start /bin/sh: {e}\n".encode())
    finally:
        os.close(write_end)
    os.set_blocking(read_end, False)
    open_pipe = True

    def drain():
        nonlocal open_pipe
        for _ in range(256):  # at most 16 MiB at a time: the limits are looked at in between
            try:
                data = os.read(read_end, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                open_pipe = False
                return
            log.add(data)

    began = time.monotonic()
    ended, killed_at = "exited", None
    running = [p for p in procs if p is not None]
    try:
        while running:
            if open_pipe:
                select.select([read_end], [], [], 0.01)
            else:
                time.sleep(0.01)
            drain()
            running = [p for p in running if p.poll() is None]
            if not running:
                break
            now = time.monotonic()
            if killed_at is None:
                if signals.signal:
                    ended = "signal"
                elif deadline is not None and now >= deadline:
                    ended = "deadline"
                elif timeout and now - began > timeout:
                    ended = "timeout"
                if ended != "exited":
                    killed_at = now
                    for p in running:
                        _signal_group(p, signal.SIGTERM)
            elif now - killed_at > _TERM_GRACE + 1:
                for p in running:
                    _signal_group(p, signal.SIGKILL)
    except BaseException:
        for p in running:  # a KeyboardInterrupt of a handler not ours: nothing is left running
            _signal_group(p, signal.SIGKILL)
            p.wait()
        raise
    finally:
        if open_pipe:
            drain()
        os.close(read_end)
        for p in procs:
            if p is not None:
                _signal_group(p, signal.SIGKILL)  # anything a run left behind in its group
    return ended, [None if p is None else p.returncode for p in procs]


def _exit_text(code, who):
    if code is None:
        return f"cannot start /bin/sh for {who}"
    if code < 0:
        return f"{who} was killed by signal {-code}"
    if code > 128 and code - 128 < 65:  # the reaper passes a signal on; a shell reports 128 + N as well
        return f"{who} exited with status {code} (signal {code - 128})"
    if code:
        return f"{who} exited with status {code}"
    return ""


class _Signals:
    """SIGINT and SIGTERM set `signal` while the COMMAND search runs (in the main thread: elsewhere Python gives no
    handler); the handlers before are restored at the end."""

    def __init__(self):
        self.signal, self._old = 0, {}

    def _on(self, signum, frame):
        self.signal = self.signal or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._old[s] = signal.signal(s, self._on)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._old = {}
        return False

    def name(self):
        return {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}.get(self.signal, f"signal {self.signal}")


class _Workspace:
    """The runs' folder: `real`, a new private folder (tempfile.mkdtemp: mode 0700) in TMPDIR, and `handed`, the same
    folder as COMMAND is given it: `real` itself when its path is safe, else a symbolic link to it in a folder of /tmp
    this search creates. cleanup() removes both (the link, not what it points to) and nothing else."""

    def __init__(self):
        self.link_dir = None
        try:
            self.real = os.path.abspath(tempfile.mkdtemp(prefix="cpgold-capture-shrink-"))
        except OSError as e:
            raise InputError(f"TMPDIR: cannot create a temporary folder in {tempfile.gettempdir()!r} ({e})",
                             "TMPDIR") from None
        self.handed = self.real
        if not safe_path(self.real):
            try:
                self.link_dir = tempfile.mkdtemp(prefix="cpgold-capture-shrink-", dir="/tmp")
                self.handed = os.path.join(self.link_dir, "runs")
                os.symlink(self.real, self.handed)
            except OSError as e:
                self.cleanup()
                raise InputError(f"TMPDIR: the folder {self.real!r} has characters a shell treats specially, and no "
                                 f"folder for a safe link to it could be made in /tmp ({e})", "TMPDIR") from None

    def cleanup(self):
        if self.link_dir is not None:
            shutil.rmtree(self.link_dir, ignore_errors=True)  # rmtree removes a link inside, never its target
            self.link_dir = None
        if self.real is not None:
            shutil.rmtree(self.real, ignore_errors=True)
            self.real = None


class _Interrupted(Exception):
    """A signal came before the original's run ended: nothing was found."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = signum


# ---------------------------------------------------------------------------------------------- the search


def _size_text(case):
    c = case
    return (f"{int(c['total_tokens_q'])} q rows, {sum(int(n) for n in c['seqlens_q'])} tokens in "
            f"{len(c['seqlens_q'])} sequence(s), heads {c['heads_q']}/{c['heads_kv']}, cp_size {c['cp_size']}")


def _check_options_text(record):
    options = []
    tensors = record.get("tensors")
    if tensors and list(tensors) != ["o", "lse", "dq", "dk", "dv"]:
        options.append(f"--tensors {','.join(tensors)}")
    if (record.get("pad_rows") or "zero") != "zero":
        options.append(f"--pad-rows {record['pad_rows']}")
    if (record.get("empty_row_lse") or "neg-inf") != "neg-inf":
        options.append(f"--empty-row-lse {record['empty_row_lse']}")
    return "".join(" " + o for o in options)


def _seconds(name, value, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(f"{name}: expected seconds >= 0{' (None: no bound)' if allow_none else ''}, got {value!r}",
                         name)
    return float(value)


def shrink(call_dir, fn=None, *, command=None, budget=None, max_runs=None, run_timeout=None, confirm=2, out=None,
           scope=None, lse_layout=None, progress=None, diagnosis=True):
    """The smallest case cut out of a joined call's captured tensors on which the user's attention still fails with
    the original failure's diagnosis kinds (see the module docstring).

    call_dir: a joined call folder (FOLDER/joined/<call>). Give exactly one of:
      fn(fixture) -> outputs, as for cpgold.shrink: a dict of o, lse, dq, dk, dv in the global layout (checked with
        `scope`, default "global"; `lse_layout` as for check_outputs), or a list of every rank's dicts in the
        rank-local layout; an exception or None counts as "no candidate".
      command: a shell command line (run by /bin/sh) with {fixture} (the fixture file of the cut case, made by
        cpgold.generate(case, inputs=the cut tensors, path=...)) and {candidate} (the candidate file it must write,
        fixtures/SCHEMA.md "Candidate files": global or per rank); with {rank} it runs once per rank, all ranks at
        once, each writing its rank's file. Each placeholder is replaced once, by an absolute path of letters, digits
        and ._/- only (the runs go to a new private temporary folder). COMMAND runs in a process group of its own,
        stdin from /dev/null; a non-zero exit, a signal, no file written or one the check cannot use is "no
        candidate"; past run_timeout (seconds, default 300, 0: no limit) its group gets SIGTERM, 2 s later SIGKILL.
        After every run whatever it left running is killed: its group, and processes that left it (setsid) through
        a child subreaper. Its output is kept up to its first and last 64 KiB (quoted when the original's run gives
        no candidate). SIGINT or SIGTERM during the search (main thread) ends the running COMMAND, removes the runs'
        folder and saves the smallest case so far, then reaches the caller (KeyboardInterrupt; SIGTERM's handler).
    budget (seconds) and max_runs (the original's run included) bound the search (None or 0: no bound); a COMMAND
    still running when the budget ends is stopped and its run not counted. confirm: the answer is run again this many
    times (default 2; 0: none) and kept only when every rerun fails the same way; otherwise the case before it, back to
    the original (confirmed, flaky, not_reproduced as `cpgold shrink`; confirmation runs are not counted in runs or
    max_runs nor bounded by budget). out: the folder for case.json, inputs.h5 and shrink.json (default call_dir/shrunk; a new or
    empty folder). progress: called with a dict after every run. diagnosis: as cpgold.check (False: any failure is
    kept).

    Returns a dict: original and smallest (case JSON text), kinds, steps (the cuts kept), runs, passed,
    failed_otherwise, no_candidate, seconds, stopped ("minimal", "budget", "max_runs", "error", "interrupted"),
    stop_detail, confirm, confirmed, flaky, not_reproduced, confirmations, confirmation_runs, confirmation_stopped,
    notes, report (the check report of the smallest case), case_path, inputs_path, reproduce (shell lines), summary,
    exit_code (that of `python3 -m cpgold.capture shrink`: 0 a smaller failing case, 1 none, 4 the failure does not
    reproduce, 128 + N a signal). InputError when the original does not fail (nothing to shrink) or gives no
    candidate, or on a bad argument."""
    return _shrink(call_dir, fn, command=command, budget=budget, max_runs=max_runs, run_timeout=run_timeout,
                   confirm=confirm, out=out, scope=scope, lse_layout=lse_layout, progress=progress,
                   diagnosis=diagnosis, deliver_signal=True)


def _shrink(call_dir, fn, *, command, budget, max_runs, run_timeout, confirm, out, scope, lse_layout, progress,
            diagnosis, deliver_signal):
    if (fn is None) == (command is None):
        raise InputError("fn, command: give exactly one of them (a Python function, or a shell command line)",
                         "command" if command is not None else "fn")
    if fn is not None and not callable(fn):
        raise InputError(f"fn: expected a callable, got {type(fn).__name__}", "fn")
    if command is not None:
        if not isinstance(command, str):
            raise InputError(f"command: expected a shell command line (str), got {type(command).__name__}", "command")
        for name, why in (("{fixture}", "the fixture whose inputs it reads"), ("{candidate}", "where it writes its "
                                                                                              "outputs")):
            if name not in command:
                raise InputError(f"command: COMMAND must contain {name} ({why}), got {command!r}", "command")
        if "\0" in command:
            raise InputError("command: COMMAND holds a NUL character", "command")
        for name, value in (("scope", scope), ("lse_layout", lse_layout)):
            if value is not None:
                raise InputError(f"{name}: only with fn (a candidate file says its own scope and LSE layout)", name)
        run_timeout = DEFAULT_RUN_TIMEOUT if run_timeout is None else _seconds("run_timeout", run_timeout, False)
    elif run_timeout is not None:
        raise InputError("run_timeout: only with command (a Python function cannot be stopped)", "run_timeout")
    budget = _seconds("budget", budget) or None  # 0: no bound, as for cpgold.shrink and `cpgold shrink`
    if max_runs is not None and (isinstance(max_runs, bool) or not isinstance(max_runs, numbers.Integral)
                                 or max_runs < 0):
        raise InputError(f"max_runs: expected an integer >= 0 (None or 0: no bound), got {max_runs!r}", "max_runs")
    max_runs = int(max_runs) or None if max_runs is not None else None
    if isinstance(confirm, bool) or not isinstance(confirm, numbers.Integral) or confirm < 0:
        raise InputError(f"confirm: expected an integer >= 0 (0: no confirmation), got {confirm!r}", "confirm")
    if progress is not None and not callable(progress):
        raise InputError(f"progress: expected a callable or None, got {type(progress).__name__}", "progress")

    record, case, inputs = load_joined(call_dir)
    out = os.fspath(out) if out is not None else os.path.join(os.fspath(call_dir), "shrunk")
    if os.path.lexists(out) and (not os.path.isdir(out) or os.path.islink(out) or os.listdir(out)):
        raise InputError(f"out: {out!r} exists and is not an empty folder: shrink never writes over files", "out")
    if command is None:
        search = _Search(record, case, inputs, _FnRunner(fn, record, scope or "global", lse_layout, diagnosis),
                         budget, max_runs, confirm, progress)
        result = search.run()
        return _finish(search, result, out, record, None)
    interrupted = None
    with _Signals() as signals:
        work = _Workspace()
        try:
            runner = _CommandRunner(command, record, diagnosis, run_timeout, work, signals)
            search = _Search(record, case, inputs, runner, budget, max_runs, confirm, progress)
            result = search.run()
        except _Interrupted as e:
            if not deliver_signal:
                raise
            interrupted = e
        finally:
            work.cleanup()
        if interrupted is None:
            result = _finish(search, result, out, record, command)
    if interrupted is not None:
        _deliver(interrupted.signum, None)
        raise KeyboardInterrupt(f"cpgold.capture.shrink: {interrupted}")
    if signals.signal and deliver_signal:
        _deliver(signals.signal, out)
    return result


def _deliver(signum, out):
    """A signal that came during the search reaches the caller once the search has cleaned up and saved its answer."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt("cpgold.capture.shrink: interrupted by SIGINT" +
                                (f"; the smallest case found so far is in {out}" if out else "; nothing was found"))
    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


class _FnRunner:
    """Runs fn on the fixture made in memory and checks its outputs with check_outputs."""

    def __init__(self, fn, record, scope, lse_layout, diagnosis):
        self.fn, self.scope = fn, scope
        self.options = dict(tensors=record.get("tensors"), empty_row_lse=record.get("empty_row_lse"),
                            pad_rows=record.get("pad_rows"), lse_layout=lse_layout, diagnosis=diagnosis)
        self.no_candidate_field = "fn"

    def __call__(self, case, inputs, number, deadline):
        from ..cases import generate
        from ..check import check_outputs

        try:
            fixture = generate(case, inputs=inputs, allow_nonfinite=True)
        except InputError as e:
            return _verdict("invalid", detail=f"the cut inputs make no fixture: {e}")
        try:
            try:
                outputs = self.fn(fixture)
            except Exception as e:  # noqa: BLE001 - the implementation under test failed: no candidate
                return _verdict("no_candidate", detail=f"fn raised {type(e).__name__}: {e}")
            if outputs is None:
                return _verdict("no_candidate", detail="fn returned None")
            try:
                report = check_outputs(fixture, outputs, scope=self.scope, **self.options)
            except (InputError, CheckInputError) as e:
                return _verdict("no_candidate", detail=f"the outputs are unusable: {e}")
            return _checked(report)
        finally:
            fixture.close()


class _CommandRunner:
    """Writes the cut case's fixture into run-N/ of the runs' folder, runs COMMAND on it and checks the candidate file
    it wrote (`cpgold check`'s engine); run-N/ is removed afterwards."""

    def __init__(self, command, record, diagnosis, run_timeout, work, signals):
        self.command, self.work, self.signals, self.run_timeout = command, work, signals, run_timeout
        self.per_rank = "{rank}" in command
        self.options = dict(tensors=record.get("tensors"), empty_row_lse=record.get("empty_row_lse"),
                            pad_rows=record.get("pad_rows"), diagnosis=diagnosis)
        self.folders = 0
        self.original_log = None
        self.no_candidate_field = "command"

    def __call__(self, case, inputs, number, deadline):
        from ..cases import generate
        from ..check import check as check_files

        if self.signals.signal:
            return _verdict("stop", stop="interrupted", detail=f"{self.signals.name()} came")
        self.folders += 1
        name = f"run-{self.folders}"
        real, handed = os.path.join(self.work.real, name), f"{self.work.handed}/{name}"
        try:
            os.mkdir(real, 0o700)
        except OSError as e:
            return _verdict("stop", stop="error", detail=f"cannot create the folder of run {number}, {real} ({e})")
        try:
            fixture = os.path.join(real, "fixture.h5")
            try:
                generate(case, inputs=inputs, path=fixture, allow_nonfinite=True).close()
            except KeyboardInterrupt:
                self.signals.signal = self.signals.signal or signal.SIGINT
                return _verdict("stop", stop="interrupted", detail=f"{self.signals.name()} came while run "
                                                                   f"{number}'s fixture was written")
            except InputError as e:
                if os.path.exists(fixture):
                    raise
                return _verdict("invalid", detail=f"the cut inputs make no fixture: {e}")
            except OSError as e:
                return _verdict("stop", stop="error", detail=f"cannot write the fixture of run {number} ({e})")
            if self.signals.signal:
                return _verdict("stop", stop="interrupted", detail=f"{self.signals.name()} came while run "
                                                                   f"{number}'s fixture was written")
            files = [f"candidate.rank{r}.h5" for r in range(int(case["cp_size"]))] if self.per_rank \
                else ["candidate.h5"]
            candidates = [os.path.join(real, f) for f in files]
            commands = [with_placeholders(self.command, f"{handed}/fixture.h5", f"{handed}/{f}", r)
                        for r, f in enumerate(files)]
            log = _CappedLog()
            ended, codes = _run_commands(commands, log, self.run_timeout, deadline, self.signals)
            if self.original_log is None:
                self.original_log = log.end()
            if ended == "signal":
                return _verdict("stop", stop="interrupted",
                                detail=f"{self.signals.name()} came while COMMAND ran for run {number}")
            if ended == "deadline":
                return _verdict("stop", stop="budget", detail=f"the budget ran out while COMMAND ran for run {number}")
            if ended == "timeout":
                return _verdict("no_candidate", detail=f"COMMAND ran past the run timeout of {self.run_timeout:g} s "
                                                       "and was killed")
            for r, code in enumerate(codes):
                failed = _exit_text(code, f"COMMAND of rank {r}" if self.per_rank else "COMMAND")
                if failed:
                    return _verdict("no_candidate", detail=failed)
            for path in candidates:
                if not os.path.lexists(path):
                    return _verdict("no_candidate", detail=f"COMMAND exited 0 but wrote no candidate "
                                                           f"{os.path.basename(path)}")
            try:
                report = check_files(fixture, *candidates, **self.options)
            except (InputError, CheckInputError) as e:
                return _verdict("no_candidate", detail=f"the candidate is unusable: {e}")
            return _checked(report)
        finally:
            shutil.rmtree(real, ignore_errors=True)

    def reproduce(self, record, cp_size):
        """The shell lines that rerun COMMAND on the saved case and check it."""
        check = "cpgold check case.h5"
        if self.per_rank:
            ranks = " ".join(str(r) for r in range(cp_size))
            run = (f"for rank in {ranks}; do "
                   f"{with_placeholders(self.command, 'case.h5', 'candidate.rank$rank.h5', '$rank')} & done; wait")
            check += "".join(f" candidate.rank{r}.h5" for r in range(cp_size))
        else:
            run = with_placeholders(self.command, "case.h5", "candidate.h5", 0)
            check += " candidate.h5"
        return [run, check + _check_options_text(record)]


def _verdict(status, report=None, kinds=(), detail="", stop=None):
    return {"status": status, "report": report, "kinds": list(kinds), "detail": detail, "stop": stop}


def _checked(report):
    if report.passed:
        return _verdict("passes", report, detail="check passed")
    kinds = [d["kind"] for d in report.get("diagnosis", [])]
    return _verdict("fails", report, kinds, "check failed: " + (", ".join(kinds) or "no diagnosis"))


class _Search:
    """The greedy search over cuts and the confirmation of its answer (check/shrink.hpp's confirm_smallest, the rule
    `cpgold shrink` and cpgold.shrink follow)."""

    def __init__(self, record, case, inputs, runner, budget, max_runs, confirm, progress):
        self.record, self.case, self.inputs, self.runner = record, case, inputs, runner
        self.budget, self.max_runs, self.confirm, self.progress = budget, max_runs, confirm, progress
        self.start = time.monotonic()
        self.counts = {"runs": 0, "passed": 0, "failed_otherwise": 0, "no_candidate": 0, "confirmation_runs": 0}

    def elapsed(self):
        return time.monotonic() - self.start

    def _run(self, case, inputs, bounded):
        deadline = self.start + self.budget if bounded and self.budget is not None else None
        return self.runner(case, inputs, self.counts["runs"] + self.counts["confirmation_runs"] + 1, deadline)

    def _report(self, change, verdict, kept, smallest):
        if self.progress is not None:
            self.progress({"run": self.counts["runs"] + self.counts["confirmation_runs"], "seconds": self.elapsed(),
                           "change": change, "verdict": verdict["status"], "kinds": verdict["kinds"],
                           "kept": kept, "detail": verdict["detail"], "smallest_rows_q":
                               int(smallest["total_tokens_q"])})

    def same_way(self, verdict):
        # cpgold.shrink's rule (check/shrink.cpp, shrink_same_way): every kind of the original's diagnosis, and no
        # cause it does not name (symptoms apart), so that the smallest case carries the original's name
        return _same_way(sorted(self.kinds), self.original_verdict["kinds"], verdict["kinds"], verdict["status"])

    def run(self):
        from ..cases import normalize_case

        first = self._run(self.case, self.inputs, bounded=False)
        if first["stop"] == "interrupted":
            raise _Interrupted(self.runner.signals.signal, f"{first['detail']} before the original's run ended; "
                                                           "nothing was found")
        if first["stop"]:
            raise InputError(f"command: the original's run could not be made: {first['detail']}", "command")
        self.counts["runs"] += 1
        if first["status"] != "fails":
            if first["status"] == "passes":
                raise InputError(f"{self.runner.no_candidate_field}: on the captured case the outputs pass their "
                                 "check: there is no failure to shrink", self.runner.no_candidate_field)
            log = getattr(self.runner, "original_log", None)
            raise InputError(f"{self.runner.no_candidate_field}: no candidate for the captured case: "
                             f"{first['detail']}; there is no failure to shrink" +
                             (f"; its output ends with:\n{log}" if log else ""), self.runner.no_candidate_field)
        self.original_verdict = first
        self.kinds = set(first["kinds"])
        best = (self.case, self.inputs, first)
        kept = []  # (label, case, inputs, verdict) of every step kept, in order: what the confirmation walks back
        stopped, stop_detail = "minimal", ""
        changed = True
        while changed and stopped == "minimal":
            changed = False
            for label, cut_args in _candidates(best[0]):
                if self.budget is not None and self.elapsed() >= self.budget:
                    stopped, stop_detail = "budget", f"the budget of {self.budget:g} s was spent"
                    break
                if self.max_runs is not None and self.counts["runs"] >= self.max_runs:
                    stopped, stop_detail = "max_runs", f"the {self.max_runs} runs of max_runs were made"
                    break
                try:
                    c, x = cut(best[0], best[1], **cut_args)
                    c = normalize_case(c)
                except (ValueError, IndexError, InputError) as e:
                    self._report(label, _verdict("invalid", detail=str(e)), False, best[0])
                    continue
                v = self._run(c, x, bounded=True)
                if v["stop"]:
                    stopped, stop_detail = v["stop"], v["detail"]
                    break
                if v["status"] == "invalid":
                    self._report(label, v, False, best[0])
                    continue
                self.counts["runs"] += 1
                ok = self.same_way(v)
                if v["status"] == "passes":
                    self.counts["passed"] += 1
                elif v["status"] == "fails" and not ok:
                    self.counts["failed_otherwise"] += 1
                elif v["status"] == "no_candidate":
                    self.counts["no_candidate"] += 1
                if ok:
                    best = (c, x, v)
                    kept.append((label, c, x, v))
                self._report(label, v, ok, best[0])
                if ok:
                    changed = True
                    break
        result = {"stopped": stopped, "stop_detail": stop_detail, "confirm": int(self.confirm), "confirmed": False,
                  "flaky": False, "not_reproduced": False, "confirmations": [], "confirmation_stopped": "",
                  "notes": [], "search_smallest": json.dumps(best[0])}
        if stopped != "interrupted":
            best, kept = self._confirm(result, best, kept)
        if stopped != "minimal" and (kept or result["not_reproduced"]):
            result["notes"].insert(0, f"the search stopped early ({stopped}: {stop_detail}): this is the smallest "
                                      "failing case found so far")
        result.update(best=best, kept=kept)
        return result

    def _confirm(self, result, best, kept):
        if self.confirm == 0:
            return best, kept
        chain = [(None, self.case, self.inputs, self.original_verdict)] + kept
        for i in range(len(chain) - 1, -1, -1):
            label, case, inputs, verdict = chain[i]
            which = "the original" if i == 0 else "the search's smallest" if i == len(chain) - 1 else f"step {i}"
            entry = {"case_json": json.dumps(case), "rows_q": int(case["total_tokens_q"]), "original": i == 0,
                     "which": which, "reruns": 0, "failed_same_way": 0}
            last = verdict
            for k in range(1, self.confirm + 1):
                v = self._run(case, inputs, bounded=False)
                if v["stop"]:
                    result["confirmation_stopped"] = v["stop"]
                    result["stop_detail"] = result["stop_detail"] or v["detail"]
                    result["notes"].append(f"the confirmation runs stopped early ({v['stop']}: {v['detail']}): the "
                                           "answer is not confirmed")
                    if v["stop"] == "interrupted":
                        result["stopped"] = "interrupted"
                    if entry["reruns"]:
                        result["confirmations"].append(entry)
                    return best, kept
                self.counts["confirmation_runs"] += 1
                entry["reruns"] += 1
                same = self.same_way(v)
                entry["failed_same_way"] += same
                if same:
                    last = v
                self._report(f"confirmation {k} of {self.confirm} of {which}", v, same, case)
            result["confirmations"].append(entry)
            if entry["failed_same_way"] == entry["reruns"]:
                result["confirmed"] = True
                return (case, inputs, last), kept[:i]
            result["flaky"] = True
        result["not_reproduced"] = True
        return (self.case, self.inputs, self.original_verdict), []


def _finish(search, result, out, record, command):
    """Saves the answer (case.json, inputs.h5, shrink.json in out) and completes the result."""
    best_case, best_inputs, best_verdict = result.pop("best")
    kept = result.pop("kept")
    os.makedirs(out, exist_ok=True)
    _folder.write_case(out, best_case, best_inputs)
    case_path, inputs_path = os.path.join(out, "case.json"), os.path.join(out, "inputs.h5")
    signals = getattr(search.runner, "signals", None)
    signum = signals.signal if signals is not None else 0
    interrupted = result["stopped"] == "interrupted"
    code = 128 + (signum or signal.SIGINT) if interrupted else 4 if result["not_reproduced"] else 0 if kept else 1
    reproduce = [f"cpgold gen --case \"$(cat {shlex.quote(case_path)})\" --inputs {shlex.quote(inputs_path)} "
                 "-o case.h5"]
    if command is not None:
        reproduce += search.runner.reproduce(record, int(best_case["cp_size"]))
    report = best_verdict["report"]
    if best_verdict["status"] == "fails":
        note = _name_note(sorted(search.kinds), search.original_verdict["kinds"], best_verdict["kinds"])
        if note:
            result["notes"].append(note)
    out_dict = {"original": json.dumps(search.case), "smallest": json.dumps(best_case), "kinds": sorted(search.kinds),
                "steps": [k[0] for k in kept], "command": command, **search.counts,
                "seconds": search.elapsed(), **result, "case_path": case_path, "inputs_path": inputs_path,
                "reproduce": reproduce,
                "original_size": _size_text(search.case), "smallest_size": _size_text(best_case),
                "original_diagnosis": list(search.original_verdict["kinds"]),
                "summary": [f"diagnosis: {d['kind']}: {d['evidence']}" for d in (report or {}).get("diagnosis", [])],
                "exit_code": code}
    _folder.write_new_json(os.path.join(out, "shrink.json"), out_dict)
    out_dict["report"] = report
    return out_dict
