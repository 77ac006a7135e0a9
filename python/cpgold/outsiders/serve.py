"""A resident adapter: one process keeps an implementation loaded (torch, TransformerEngine, FlashAttention's
compiled kernels) and writes candidate files on request, so that a search that runs it hundreds of times (`cpgold
shrink`) does not pay its start every time (docs/shrink.md, "A resident COMMAND").

    sock=$(mktemp -d)/te.sock      # a folder only you can write
    python3 -m cpgold.outsiders.serve start $sock te_cp --backend fused --set timeout=30 &   # until stopped
    cpgold shrink FIXTURE --run "python3 -m cpgold.outsiders.serve run $sock {fixture} {candidate}"
    python3 -m cpgold.outsiders.serve stop $sock

`run` behaves as `python3 -m cpgold.outsiders ADAPTER FIXTURE --write-candidate CANDIDATE`: exit 0 written, 3
refused or not expressible, 2 an unusable fixture or an existing candidate, 1 on an error (also when no server
answers at SOCKET). The server runs the adapter in a child process. After a run that ended in an error the child is
replaced by a fresh one (an error can leave the CUDA context or a rank thread unusable), as is a child that died or
ran past `--timeout` (default 240 s); that run answers "error". Every answer to a run carries the versions of the
process that ran it (environment.process_versions, with their digest), which `run` prints on one line, as
`--write-candidate` does. Requests are served one at a time, in the order they
arrive. ADAPTER is a name of cpgold.outsiders.ADAPTERS or `module:Class` (an Adapter subclass importable by the
server).

Trust: SOCKET's folder must be one only you can write (yours, not group or other writable, not a symbolic link), the
socket must be yours, and on Linux the process at the other end must run as you (SO_PEERCRED), on both sides; other
paths are refused naming why. Messages are data only: a 4-byte big-endian length, then a JSON object (at most 64 KiB
for a request); nothing a peer sends is executed. The adapter's process dies with the server (PR_SET_PDEATHSIG).
"""
import argparse
import ctypes
import importlib
import json
import multiprocessing
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time

EXIT_WRITTEN, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_REFUSED = 0, 1, 2, 3
DEFAULT_TIMEOUT = 240.0  # seconds one run may take: below shrink's default --run-timeout (300 s)
READ_TIMEOUT = 10.0      # seconds a client may take to send its request (and to take its answer)
LOAD_TIMEOUT = 900.0     # seconds the adapter may take to load
MAX_REQUEST, MAX_ANSWER = 1 << 16, 1 << 24  # bytes of one message
SUN_PATH_MAX = 107       # bytes of a Unix socket's path (AF_UNIX)


class Refusal(Exception):
    """SOCKET or ADAPTER cannot be used; the message names the path or name and why. Nothing was touched."""


def send(sock, message):
    data = json.dumps(message, default=str).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def receive(sock, limit, deadline=None):
    """One message as a dict. ValueError names what is malformed; EOFError when the peer closed first;
    socket.timeout past deadline (time.monotonic())."""
    size = struct.unpack(">I", _exactly(sock, 4, deadline))[0]
    if size > limit:
        raise ValueError(f"a message of {size} bytes announced (at most {limit})")
    try:
        message = json.loads(_exactly(sock, size, deadline).decode())
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
        raise ValueError(f"not a JSON message ({e})") from None
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    return message


def _exactly(sock, n, deadline):
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def peer_uid(sock):
    """The uid of the process at the other end (Linux SO_PEERCRED); this user's own where the system lacks it."""
    if not hasattr(socket, "SO_PEERCRED"):
        return os.geteuid()
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _kind(mode):
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a regular file" if stat.S_ISREG(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def check_path(address):
    """Refusal unless address fits a Unix socket and its folder is one only this user can change (a folder, not a
    symbolic link, owned by the effective user, not writable by group or others): elsewhere another user could place
    a listener of theirs at SOCKET first, or replace the socket. Returns the os.lstat of what is at address (a socket
    of this user), or None when nothing is."""
    size = len(os.fsencode(address))
    if size > SUN_PATH_MAX:
        raise Refusal(f"SOCKET: {address} is {size} bytes long; a Unix socket's path takes at most {SUN_PATH_MAX}")
    folder, euid = os.path.dirname(os.path.abspath(address)), os.geteuid()
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise Refusal(f"SOCKET: folder {folder}: {e.strerror}") from None
    why = (f"is {_kind(st.st_mode)}" if not stat.S_ISDIR(st.st_mode) else
           f"belongs to uid {st.st_uid}, not to you (uid {euid})" if st.st_uid != euid else
           f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o022 else None)
    if why:
        raise Refusal(f"SOCKET: folder {folder} {why}; use a folder only you can write (e.g. one made by mktemp -d)")
    try:
        st = os.lstat(address)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise Refusal(f"SOCKET: {address} is {_kind(st.st_mode)}, not a socket; nothing was changed")
    if st.st_uid != euid:
        raise Refusal(f"SOCKET: {address} belongs to uid {st.st_uid}, not to you (uid {euid})")
    return st


def connect(address):
    """A connection to a server of this user at address. Refusal for a path or peer that is not this user's own,
    ConnectionError when nothing listens."""
    if check_path(address) is None:
        raise ConnectionError(f"SOCKET: no server answers at {address} (no socket there); start one with "
                              f"`python3 -m cpgold.outsiders.serve start {address} ADAPTER ...`")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        uid = peer_uid(sock)
    except OSError as e:
        sock.close()
        raise ConnectionError(f"SOCKET: no server answers at {address} ({e.strerror or e}); start one with "
                              f"`python3 -m cpgold.outsiders.serve start {address} ADAPTER ...`") from None
    if uid != os.geteuid():
        sock.close()
        raise Refusal(f"SOCKET: the process listening at {address} runs as uid {uid}, not as you (uid "
                      f"{os.geteuid()}); nothing was sent")
    return sock


def request(address, message):
    """The server's answer to message (a dict); data only."""
    with connect(address) as sock:
        try:
            send(sock, message)
            return receive(sock, MAX_ANSWER)
        except EOFError:
            raise ConnectionError(f"SOCKET: the server at {address} closed the connection without an answer") from None
        except ValueError as e:
            raise ConnectionError(f"SOCKET: the server at {address} answered with something unusable: {e}") from None
        except OSError as e:
            raise ConnectionError(f"SOCKET: the server at {address}: {e.strerror or e}") from None


def check_spec(spec):
    """Refusal unless spec names an adapter: a key of ADAPTERS, or module:Class with dotted names."""
    from . import ADAPTERS
    module, sep, cls = spec.partition(":")
    if sep and cls.isidentifier() and all(p.isidentifier() for p in module.split(".")):
        return
    if not sep and spec in ADAPTERS:
        return
    raise Refusal(f"ADAPTER: {spec!r} is not one of {', '.join(ADAPTERS)}, nor module:Class")


def make_adapter(spec, options):
    """An adapter from a name of ADAPTERS or from `module:Class`."""
    module, sep, cls = spec.partition(":")
    if sep:
        return getattr(importlib.import_module(module), cls)(**options)
    from . import make
    return make(spec, **options)


def _die_with(parent):
    """The adapter's process ends with the server's: the kernel sends it SIGKILL when the server's thread that
    started it ends (Linux PR_SET_PDEATHSIG), or it polls for its parent elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        def poll():
            while os.getppid() == parent:
                time.sleep(1)
            os._exit(1)
        threading.Thread(target=poll, daemon=True).start()
    if os.getppid() != parent:  # the server ended before the call above
        os._exit(1)


def _run_one(adapter, fixture, candidate):
    """(entry, broken): the summary entry of run_and_write, or an entry naming why nothing was written; broken when
    the adapter's own run ended in an error (its process is then replaced)."""
    from ..fixture import FixtureError
    from .runner import run_and_write
    if os.path.lexists(candidate):
        return {"status": "unusable", "reason": f"candidate exists: {candidate}; nothing was written"}, False
    try:
        entry = run_and_write(adapter, fixture, os.path.basename(os.path.dirname(fixture)), candidate)
    except FixtureError as e:
        return {"status": "unusable", "reason": str(e) if fixture in str(e) else f"fixture {fixture}: {e}"}, False
    except Exception as e:  # noqa: BLE001 - writing the candidate failed; the adapter's state is not in question
        return {"status": "error", "reason": f"{fixture} -> {candidate}: {type(e).__name__}: {e}"[:2000]}, False
    return entry, entry.get("status") == "error"


def _child(conn, spec, options, parent):
    """The adapter's process: ("ready", versions) or ("failed", message) first, then (entry, broken) per request.
    Exits after a broken run (the supervisor starts another)."""
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the server, which ends this process
    from .environment import process_versions
    try:
        adapter = make_adapter(spec, options)
        versions = process_versions(adapter)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which stops with it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", versions))
    while True:
        try:
            fixture, candidate = conn.recv()
        except EOFError:
            return
        entry, broken = _run_one(adapter, fixture, candidate)
        conn.send((json.loads(json.dumps(entry, default=str)), broken))
        if broken:
            conn.close()
            os._exit(0)


class Supervisor:
    """Holds the adapter's child process; start() waits until it has loaded the implementation."""

    def __init__(self, spec, options, timeout=DEFAULT_TIMEOUT, log=sys.stderr):
        self.spec, self.options, self.timeout, self.log = spec, options, timeout, log
        self.process = self.conn = None
        self.starts = 0
        self.versions = None   # what the adapter's process runs on (environment.process_versions), sent when ready

    def start(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(theirs, self.spec, self.options, os.getpid()), daemon=True)
        t0 = time.time()
        self.process.start()
        theirs.close()
        self.starts += 1
        what, detail = "failed", f"not loaded within {LOAD_TIMEOUT:g} s"
        try:
            if self.conn.poll(LOAD_TIMEOUT):
                what, detail = self.conn.recv()
        except EOFError:
            what, detail = "failed", f"the adapter's process ended while starting (exit code {self.process.exitcode})"
        if what != "ready":
            self.stop()
            raise RuntimeError(f"adapter {self.spec}: {detail}")
        from .environment import describe, digest
        self.versions = {"versions": detail, "versions_digest": digest(detail)}
        print(f"serve: adapter {self.spec} loaded in {time.time() - t0:.1f} s (process {self.process.pid}, start "
              f"{self.starts}): {describe(detail)} ({self.versions['versions_digest']})", file=self.log, flush=True)

    def stop(self):
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.join()
        self.process = None

    def run(self, fixture, candidate):
        """One request: the summary entry of run_and_write, or an error entry when the child died or timed out; with
        the versions of the process that ran it (versions, versions_digest)."""
        if self.process is None or not self.process.is_alive():
            self.start()
        ran_on = dict(self.versions)
        self.conn.send((fixture, candidate))
        if not self.conn.poll(self.timeout):
            self.stop()
            return {"status": "error", "reason": f"the adapter ran past --timeout {self.timeout:g} s; its process was "
                                                 "killed and another is started", **ran_on}
        try:
            entry, broken = self.conn.recv()
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            self.stop()
            return {"status": "error", "reason": f"the adapter's process died in this run (exit code {code}); "
                                                 "another is started", **ran_on}
        if broken:
            self.process.join(30)
            self.stop()
        return {**entry, **ran_on}


def _request(conn, read_timeout):
    """The request of one connection, checked; ValueError (or EOFError, OSError) names what is wrong with it."""
    uid = peer_uid(conn)
    if uid != os.geteuid():
        raise ValueError(f"a client of uid {uid}; this server serves uid {os.geteuid()} only")
    try:
        message = receive(conn, MAX_REQUEST, time.monotonic() + read_timeout)
    except socket.timeout:
        raise ValueError(f"no request within {read_timeout:g} s") from None
    if message.get("op") not in ("run", "stop"):
        raise ValueError(f"op: expected \"run\" or \"stop\", got {message.get('op')!r}")
    for key in ("fixture", "candidate") if message["op"] == "run" else ():
        if not isinstance(message.get(key), str) or not os.path.isabs(message[key]):
            raise ValueError(f"{key}: expected an absolute path, got {message.get(key)!r}")
    return message


def serve(address, spec, options, timeout=DEFAULT_TIMEOUT, read_timeout=READ_TIMEOUT, log=sys.stderr):
    """Listens at address (a Unix socket path) until a stop request. ADAPTER and SOCKET are checked first (Refusal,
    nothing touched), then the adapter loads (RuntimeError: a broken installation stops here with its message), and
    only then is a stale socket of this user (nothing listening) replaced. Returns the number of runs served."""
    address = os.path.abspath(address)
    check_spec(spec)
    for name, value in (("--timeout", timeout), ("--read-timeout", read_timeout)):
        if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise Refusal(f"{name}: expected seconds > 0, got {value}")
    if check_path(address) is not None and _listening(address):
        raise Refusal(f"SOCKET: a server is already listening at {address}")
    supervisor = Supervisor(spec, options, timeout, log)
    listener = ours = None
    served = 0
    try:
        supervisor.start()
        if check_path(address) is not None and not _listening(address):
            os.remove(address)  # a socket of this user's that nothing listens at: left by a server that ended
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(address)
        except OSError as e:
            raise Refusal(f"SOCKET: {address}: {e.strerror}") from None
        finally:
            os.umask(old)
        listener.listen(16)
        ours = os.lstat(address)
        print(f"serve: listening at {address} (a run may take {timeout:g} s, a request {read_timeout:g} s)",
              file=log, flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    message = _request(conn, read_timeout)
                except (ValueError, EOFError, OSError) as e:
                    print(f"serve: a request refused: {type(e).__name__}: {e}", file=log, flush=True)
                    _answer(conn, {"status": "unusable", "reason": f"request: {e}"}, log, read_timeout)
                    continue
                if message["op"] == "stop":
                    _answer(conn, {"status": "stopped", "served": served}, log, read_timeout)
                    return served
                t0 = time.time()
                try:
                    entry = supervisor.run(message["fixture"], message["candidate"])
                except RuntimeError as e:  # the adapter could not be loaded again
                    entry = {"status": "error", "reason": str(e)}
                served += 1
                print(f"serve: {served}: {os.path.basename(message['fixture'])}: {entry.get('status', 'written')} "
                      f"({time.time() - t0:.1f} s)", file=log, flush=True)
                _answer(conn, entry, log, read_timeout)
            if supervisor.process is None:  # replaced after a broken run, while the client reads its answer
                try:
                    supervisor.start()
                except RuntimeError as e:
                    print(f"serve: {e} (the next request tries again)", file=log, flush=True)
    finally:
        if listener is not None:
            listener.close()
        supervisor.stop()
        try:
            if ours is not None and os.path.samestat(os.lstat(address), ours):
                os.remove(address)
        except FileNotFoundError:
            pass


def _answer(conn, entry, log, timeout):
    try:
        conn.settimeout(timeout)
        send(conn, entry)
    except OSError as e:  # the client went away (e.g. shrink's --run-timeout): serve the next
        print(f"serve: a client went away: {type(e).__name__}: {e}", file=log, flush=True)


def _listening(address):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(address)
        except ConnectionRefusedError:
            return False
        except OSError as e:
            raise Refusal(f"SOCKET: {address}: {e.strerror}") from None
        return True


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds serve(): the adapter's process is killed, the socket removed


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m cpgold.outsiders.serve", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="load an adapter and serve requests at SOCKET until stopped")
    s.add_argument("socket", help="a path in a folder only you can write")
    s.add_argument("adapter", help="a name of cpgold.outsiders.ADAPTERS, or module:Class")
    s.add_argument("--deterministic", action="store_true")
    s.add_argument("--backend", choices=("fused", "flash"), help="TE adapters: the backend TE's variables select")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another adapter option")
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds one run may take before its process is killed and replaced (default %(default)g; "
                        "give less than shrink's --run-timeout)")
    s.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                   help="seconds a client may take to send its request (default %(default)g)")
    r = sub.add_parser("run", help="write the candidate of FIXTURE to CANDIDATE (as --write-candidate)")
    r.add_argument("socket")
    r.add_argument("fixture")
    r.add_argument("candidate")
    t = sub.add_parser("stop", help="stop the server at SOCKET")
    t.add_argument("socket")
    args = ap.parse_args(argv)
    if args.verb == "start":
        from .__main__ import parse_sets
        options = parse_sets(args.set)
        if args.deterministic:
            options["deterministic"] = True
        if args.backend:
            options["backend"] = args.backend
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
        try:
            served = serve(args.socket, args.adapter, options, args.timeout, args.read_timeout)
        except (Refusal, RuntimeError) as e:
            print(f"serve start: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT if isinstance(e, Refusal) else EXIT_ERROR
        except SystemExit as e:
            print(f"serve: stopped by signal {e.code - 128 if isinstance(e.code, int) else e.code}; the adapter's "
                  "process was killed", file=sys.stderr)
            raise
        print(f"serve: stopped after {served} runs", file=sys.stderr)
        return 0
    address = os.path.abspath(args.socket)
    try:
        if args.verb == "stop":
            answer = request(address, {"op": "stop"})
            if answer.get("status") != "stopped":
                print(f"serve stop: {answer.get('status')}: {answer.get('reason', '')}", file=sys.stderr)
                return EXIT_ERROR
            print(f"serve: the server at {address} stopped after {answer.get('served', '?')} runs")
            return 0
        fixture, candidate = os.path.abspath(args.fixture), os.path.abspath(args.candidate)
        if not os.path.isfile(fixture):
            print(f"serve run: FIXTURE: no file {fixture}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if os.path.lexists(candidate):
            print(f"serve run: CANDIDATE: {candidate} exists; nothing was written", file=sys.stderr)
            return EXIT_BAD_INPUT
        entry = request(address, {"op": "run", "fixture": fixture, "candidate": candidate})
    except (Refusal, ConnectionError) as e:
        print(f"serve {args.verb}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(e, Refusal) else EXIT_ERROR
    if isinstance(entry.get("versions"), dict):   # in COMMAND's output, so what keeps it (shrink's logs) has them
        print(f"serve run: versions {json.dumps(entry['versions'], sort_keys=True)}", flush=True)
    status = entry.get("status")
    if status:
        print(f"serve run: {status}: {entry.get('reason', '')}", file=sys.stderr)
        return {"unsupported": EXIT_REFUSED, "unusable": EXIT_BAD_INPUT}.get(status, EXIT_ERROR)
    print(f"serve run: wrote {candidate} ({entry.get('backend', '')}; check it with pad rows {entry['pad_rows']}, "
          f"tensors {','.join(entry['tensors'])})")
    return EXIT_WRITTEN


if __name__ == "__main__":
    sys.exit(main())
