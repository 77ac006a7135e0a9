"""A resident adapter: one process keeps an implementation loaded (torch, TransformerEngine, FlashAttention's
compiled kernels) and writes candidate files on request, so that a search that runs it hundreds of times (`cpgold
shrink`) does not pay its start every time (docs/shrink.md, "A resident COMMAND").

    python3 -m cpgold.outsiders.serve start SOCKET te_cp --backend fused --set timeout=30 &   # until stopped
    cpgold shrink FIXTURE --run "python3 -m cpgold.outsiders.serve run SOCKET {fixture} {candidate}"
    python3 -m cpgold.outsiders.serve stop SOCKET

`run` behaves as `python3 -m cpgold.outsiders ADAPTER FIXTURE --write-candidate CANDIDATE`: exit 0 written, 3
refused or not expressible, 1 on an error (also when no server answers at SOCKET). The server runs the adapter in a
child process. After a run that ended in an error the child is replaced by a fresh one (an error can leave the CUDA
context or a rank thread unusable), as is a child that died or ran past `--timeout`; that run answers "error".
Requests are served one at a time, in the order they arrive. ADAPTER is a name of cpgold.outsiders.ADAPTERS or
`module:Class` (an Adapter subclass importable by the server).
"""
import argparse
import importlib
import json
import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Client, Listener

EXIT_WRITTEN, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_REFUSED = 0, 1, 2, 3


def make_adapter(spec, options):
    """An adapter from a name of ADAPTERS or from `module:Class`."""
    module, sep, cls = spec.partition(":")
    if sep:
        return getattr(importlib.import_module(module), cls)(**options)
    from . import make
    return make(spec, **options)


def _child(conn, spec, options):
    """The adapter's process: ("ready", versions) or ("failed", message) first, then one entry per request. Exits
    after an entry with status "error" (the supervisor starts another for the next request)."""
    from .runner import run_and_write
    try:
        adapter = make_adapter(spec, options)
        versions = adapter.versions()
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which stops with it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", {k: str(v) for k, v in versions.items()}))
    while True:
        try:
            fixture, candidate = conn.recv()
        except EOFError:
            return
        entry = run_and_write(adapter, fixture, os.path.basename(os.path.dirname(fixture)), candidate)
        conn.send(json.loads(json.dumps(entry, default=str)))
        if entry.get("status") == "error":
            conn.close()
            os._exit(0)


class Supervisor:
    """Holds the adapter's child process; start() waits until it has loaded the implementation."""

    def __init__(self, spec, options, timeout=None, log=sys.stderr):
        self.spec, self.options, self.timeout, self.log = spec, options, timeout, log
        self.process = self.conn = None
        self.starts = 0

    def start(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(theirs, self.spec, self.options), daemon=True)
        t0 = time.time()
        self.process.start()
        theirs.close()
        self.starts += 1
        try:
            what, detail = self.conn.recv()
        except EOFError:
            what, detail = "failed", f"the adapter's process ended while starting (exit code {self.process.exitcode})"
        if what != "ready":
            self.stop()
            raise RuntimeError(f"adapter {self.spec}: {detail}")
        print(f"serve: adapter {self.spec} loaded in {time.time() - t0:.1f} s (process {self.process.pid}, start "
              f"{self.starts}): " + ", ".join(f"{k} {v}" for k, v in detail.items()), file=self.log, flush=True)

    def stop(self):
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.join()
        self.process = None

    def run(self, fixture, candidate):
        """One request: the summary entry of run_and_write, or an error entry when the child died or timed out."""
        if self.process is None or not self.process.is_alive():
            self.start()
        self.conn.send((fixture, candidate))
        if not self.conn.poll(self.timeout):
            self.stop()
            return {"status": "error", "reason": f"the adapter ran past --timeout {self.timeout:g} s; its process was "
                                                 "stopped (the next request starts another)"}
        try:
            entry = self.conn.recv()
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            self.stop()
            return {"status": "error", "reason": f"the adapter's process died in this run (exit code {code}); the "
                                                 "next request starts another"}
        if entry.get("status") == "error":
            self.process.join(30)
            self.stop()
        return entry


def serve(address, spec, options, timeout=None, log=sys.stderr):
    """Listens at address (a Unix socket path) until a stop request. Loads the adapter before listening, so that a
    broken installation stops here with its message."""
    if os.path.lexists(address):
        try:
            Client(address, family="AF_UNIX").close()
        except OSError:
            os.remove(address)  # a socket left by a server that ended
        else:
            raise RuntimeError(f"SOCKET: a server is already listening at {address}")
    supervisor = Supervisor(spec, options, timeout, log)
    supervisor.start()
    served = 0
    old = os.umask(0o077)
    try:
        listener = Listener(address, family="AF_UNIX")
    finally:
        os.umask(old)
    print(f"serve: listening at {address}", file=log, flush=True)
    try:
        while True:
            conn = listener.accept()
            try:
                request = conn.recv()
                if request.get("op") == "stop":
                    conn.send({"status": "stopped", "served": served})
                    return served
                t0 = time.time()
                try:
                    entry = supervisor.run(request["fixture"], request["candidate"])
                except RuntimeError as e:  # the adapter could not be loaded again
                    entry = {"status": "error", "reason": str(e)}
                served += 1
                print(f"serve: {served}: {os.path.basename(request['fixture'])}: {entry.get('status', 'written')} "
                      f"({time.time() - t0:.1f} s)", file=log, flush=True)
                conn.send(entry)
            except (EOFError, OSError) as e:  # the client went away (e.g. shrink's --run-timeout): serve the next
                print(f"serve: a client went away: {type(e).__name__}: {e}", file=log, flush=True)
            finally:
                conn.close()
    finally:
        listener.close()
        supervisor.stop()
        if os.path.lexists(address):
            os.remove(address)


def request(address, message):
    try:
        conn = Client(address, family="AF_UNIX")
    except OSError as e:
        raise ConnectionError(f"SOCKET: no server answers at {address} ({type(e).__name__}: {e}); start one with "
                              f"`python3 -m cpgold.outsiders.serve start {address} ADAPTER ...`") from None
    try:
        conn.send(message)
        return conn.recv()
    except EOFError:
        raise ConnectionError(f"SOCKET: the server at {address} closed the connection without an answer") from None
    finally:
        conn.close()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m cpgold.outsiders.serve", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="load an adapter and serve requests at SOCKET until stopped")
    s.add_argument("socket")
    s.add_argument("adapter", help="a name of cpgold.outsiders.ADAPTERS, or module:Class")
    s.add_argument("--deterministic", action="store_true")
    s.add_argument("--backend", choices=("fused", "flash"), help="TE adapters: the backend TE's variables select")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another adapter option")
    s.add_argument("--timeout", type=float, help="seconds one run may take before its process is stopped (give less "
                                                 "than shrink's --run-timeout)")
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
        if args.timeout is not None and not args.timeout > 0:
            ap.error(f"--timeout: expected seconds > 0, got {args.timeout}")
        try:
            served = serve(args.socket, args.adapter, options, args.timeout)
        except (RuntimeError, ValueError, ImportError) as e:
            print(f"serve: {e}", file=sys.stderr)
            return EXIT_ERROR
        print(f"serve: stopped after {served} runs", file=sys.stderr)
        return 0
    try:
        if args.verb == "stop":
            answer = request(args.socket, {"op": "stop"})
            print(f"serve: the server at {args.socket} stopped after {answer.get('served', '?')} runs")
            return 0
        fixture, candidate = os.path.abspath(args.fixture), os.path.abspath(args.candidate)
        if not os.path.isfile(fixture):
            print(f"serve run: FIXTURE: no file {fixture}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if os.path.lexists(candidate):
            print(f"serve run: CANDIDATE: {candidate} exists; nothing was written", file=sys.stderr)
            return EXIT_BAD_INPUT
        entry = request(args.socket, {"op": "run", "fixture": fixture, "candidate": candidate})
    except ConnectionError as e:
        print(f"serve {args.verb}: {e}", file=sys.stderr)
        return EXIT_ERROR
    status = entry.get("status")
    if status:
        print(f"serve run: {status}: {entry.get('reason', '')}", file=sys.stderr)
        return EXIT_REFUSED if status == "unsupported" else EXIT_ERROR
    print(f"serve run: wrote {candidate} ({entry.get('backend', '')}; check it with pad rows {entry['pad_rows']}, "
          f"tensors {','.join(entry['tensors'])})")
    return EXIT_WRITTEN


if __name__ == "__main__":
    sys.exit(main())
