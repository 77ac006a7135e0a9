"""torchrun ... -m cpgold.outsiders.ranks ADAPTER FIXTURES... --out DIR : a CP implementation run one process per rank
(one per GPU over NCCL, or CPU processes over gloo), every rank's outputs written to its own candidate file and
checked by rank 0 (docs/outsiders-nccl.md). The verdict, the fault policy and the time policy are the harness's
(harness.py), as for the in-process and isolated runs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m cpgold.outsiders.ranks te_cp fixtures/te --out results/w2 \
        --backend fused
    torchrun --nproc-per-node 2 -m cpgold.outsiders.ranks torch_allgather fx/ --out DIR --dist-backend gloo

Every process: refuses to start without NCCL_NVLS_ENABLE=0 in its environment under NCCL; initializes
torch.distributed (the process group's timeout is --timeout); sends its versions and device to rank 0, which records
every rank's in DIR/run.json before any fixture runs (and in summary.json; each line of results.jsonl names them by
their digest); for every fixture whose cp_size is the world size
(others are recorded as skipped, with the reason) creates the CP groups (every group, on every process, in the same
order), runs the adapter's rank (`run_rank`, rank_adapter.py) and writes DIR/<suite>/<fixture>.r<rank>.h5; then the
ranks exchange their statuses (a gloo group of their own). Rank 0 checks every rank's file (`cpgold check FIXTURE
r0.h5 r1.h5 ...`), gathers them to DIR/<suite>/<fixture>.gathered.h5 and checks that too, and writes DIR/results.jsonl
(a line per fixture, as it goes), DIR/summary.json and DIR/summary.md after every fixture.

A rank that raises writes its status; a watchdog thread in every process stops a rank that is still inside the
fixture --grace seconds after a peer failed (waiting on a peer that will never come), or --timeout seconds after the
fixture began. Every rank then stops naming the failing rank(s); rank 0 first records the fixture as an error (the
fixtures done so far stay recorded). When every rank raised (or refused) on a fixture, nobody waits on a peer: the
fixture is recorded as an error (or refused) and the run goes on. `--resume` starts again after a stopped run: the
fixtures results.jsonl already records are kept and skipped, the rest run; it is refused (exit 2, nothing run) when
a rank's versions differ from those DIR/run.json recorded, unless --resume-any-versions. Exit: 0 every fixture that
ran passed (skipped and refused ones aside), 1 one failed or errored, 2 bad usage or environment, 3 no fixture had
cp_size = the world size; when a rank fails the run stops: 1 on the rank that raised, 75 (CONTEXT_LOST) on a rank
whose CUDA context was lost (a device-side assert), 4 on the ranks stopped because of it.
"""
import json
import os
import sys
import threading
import time
import traceback

from .harness import FIXTURE_TIMEOUT, PEER_GRACE, add_selection_arguments, argument_parser, exit_code

PROG = "cpgold.outsiders.ranks"
EXIT_NOTHING_RAN = 3


def fail_usage(message):
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    return 2


def parse_args(argv):
    from .rank_adapter import RANK_ADAPTERS

    ap = argument_parser(f"torchrun --nproc-per-node W -m {PROG}", __doc__, RANK_ADAPTERS)
    ap.add_argument("--out", required=True, help="folder of the rank files, results.jsonl, summary.json, summary.md")
    ap.add_argument("--dist-backend", choices=("nccl", "gloo"), default="nccl",
                    help="torch.distributed backend: nccl (GPUs, one per process; the default) or gloo (CPU)")
    ap.add_argument("--backend", choices=("fused", "flash"), help="te_cp: the backend TE's variables select")
    ap.add_argument("--deterministic", action="store_true", help="deterministic backward (TE: "
                    "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)")
    add_selection_arguments(ap)
    ap.add_argument("--timeout", type=float, default=FIXTURE_TIMEOUT,
                    help="seconds one fixture (run, exchange and check) may take on a rank; also the process groups' "
                         f"timeout (default {FIXTURE_TIMEOUT:g})")
    ap.add_argument("--grace", type=float, default=PEER_GRACE,
                    help=f"seconds a rank may stay inside a fixture after a peer failed before it stops (default "
                         f"{PEER_GRACE:g})")
    ap.add_argument("--cpgold", help="cpgold binary to check with (default: the in-process engine, else CPGOLD_BIN)")
    ap.add_argument("--diagnosis-budget", type=float, default=30.0,
                    help="seconds the diagnosis of a failure may spend on its replay (default 30)")
    ap.add_argument("--title", help="title of the tables (default: adapter, world size and options)")
    ap.add_argument("--resume", action="store_true",
                    help="go on after a stopped run: the fixtures DIR/results.jsonl records are kept and not run again "
                         "(the fixture that stopped the run stays recorded as its error); every rank's versions must "
                         "be those DIR/run.json recorded")
    ap.add_argument("--resume-any-versions", action="store_true",
                    help="with --resume: go on even where the versions differ from those the stopped run started "
                         "with (or were not recorded); DIR/run.json keeps both")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ statuses: files, so a stuck rank can read them
class Statuses:
    """DIR/.ranks/<n>.r<rank>.json: every rank's status of fixture n (ok, refused, error, context_lost, stopped), and
    DIR/.ranks/stopped, written by rank 0 once it has recorded a stopped run."""

    def __init__(self, out, world):
        self.folder = os.path.join(out, ".ranks")
        self.world = world

    def path(self, n, rank):
        return os.path.join(self.folder, f"{n}.r{rank}.json")

    def write(self, n, rank, status, **info):
        tmp = self.path(n, rank) + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "status": status, **info}, f, default=str)
        os.replace(tmp, self.path(n, rank))

    def read(self, n, rank):
        try:
            with open(self.path(n, rank)) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def all(self, n):
        return {r: s for r in range(self.world) if (s := self.read(n, r)) is not None}

    @property
    def stop_marker(self):
        return os.path.join(self.folder, "stopped")


class Watchdog(threading.Thread):
    """Stops this rank when a peer failed and this rank is still inside the fixture `grace` seconds later, or when the
    fixture has run `timeout` seconds. `stop(reason)` does the stopping (it never returns)."""

    def __init__(self, statuses, rank, grace, timeout, stop):
        super().__init__(daemon=True, name="cpgold-watchdog")
        self.statuses, self.rank, self.grace, self.timeout, self.stop = statuses, rank, grace, timeout, stop
        self.lock = threading.Lock()
        self.current = None      # (n, label, start)
        self.seen = None         # when a peer failure of the current fixture was first seen

    def begin(self, n, label):
        with self.lock:
            self.current, self.seen = (n, label, time.time()), None

    def end(self):
        with self.lock:
            self.current = None

    def run(self):
        while True:
            time.sleep(0.1)
            with self.lock:
                current = self.current
            if current is None:
                continue
            n, label, start = current
            found = self.statuses.all(n)
            peers = {r: s for r, s in found.items() if r != self.rank and s["status"] != "ok"}
            if len(found) == self.statuses.world and all(s["status"] in ("error", "refused") for s in found.values()):
                peers = {}   # every rank raised or refused: they meet in the exchange, nobody waits on a peer
            now = time.time()
            if peers and self.seen is None:
                self.seen = now
            with self.lock:
                if self.current is None or self.current[0] != n:
                    continue
            if peers and now - self.seen >= self.grace:
                named = "; ".join(f"rank {r} {s['status']}: {s.get('reason', '')}".rstrip(": ")
                                  for r, s in sorted(peers.items()))
                self.stop(n, label, f"{named} (rank {self.rank} was still inside {label} {self.grace:g} s later)")
            elif now - start >= self.timeout:
                self.stop(n, label, f"{label} did not finish within {self.timeout:g} s on rank {self.rank}")


# ------------------------------------------------------------------ the CP groups
class Groups:
    """The CP process groups, made once per rank-list layout and kept: every process creates every group in the same
    order (dist.new_group is collective, even for the processes outside the group)."""

    def __init__(self, dist, world, timeout):
        self.dist, self.world, self.timeout = dist, world, timeout
        self.made = {}

    def _new(self, ranks):
        return self.dist.new_group(ranks=list(ranks), timeout=self.timeout)

    def lists_for(self, fx):
        """Every group's rank list, in creation order: the CP group, or for a2a+p2p every a2a group (consecutive ranks)
        then every p2p group (ranks a2a_size apart)."""
        from .rank_adapter import cp_group_ranks

        w = self.world
        if fx.comm != "a2a+p2p":
            return [list(range(w))]
        a = int(fx.case.get("a2a_size") or 0)
        cp_group_ranks(fx.comm, w, 0, a)   # refuses an a2a_size that does not divide W
        return [list(range(s, s + a)) for s in range(0, w, a)] + [list(range(i, w, a)) for i in range(a)]

    def of(self, fx, rank):
        """(groups, their rank lists) of `rank` in TransformerEngine's order (rank_adapter.cp_group_ranks)."""
        from .rank_adapter import cp_group_ranks

        for ranks in self.lists_for(fx):
            key = tuple(ranks)
            if key not in self.made:
                self.made[key] = self._new(ranks)
        mine = cp_group_ranks(fx.comm, self.world, rank, fx.case.get("a2a_size"))
        return [self.made[tuple(r)] for r in mine], mine


# ------------------------------------------------------------------ rank 0: checks and tables
def worst_per_tensor(ratio_rows):
    worst = {}
    for tensor, _rank, mx, mean in ratio_rows:
        worst[tensor] = max(worst.get(tensor, 0.0), mx, mean)
    return worst


def check_fixture(entry, fx, files, gathered_path, tensors, adapter, args):
    """Checks the ranks' files and their gathered outputs (harness.judge); fills the entry's verdict."""
    from ..candidate import read_candidate, write_global
    from ..check import failures, ratios
    from ..cp_driver import _gather
    from .harness import judge, lse_convention

    outs = [read_candidate(p) for p in files]
    gathered = _gather(fx, outs)
    convention = lse_convention(fx, gathered["lse"]) if "lse" in gathered else "neg-inf"
    write_global(gathered_path, gathered, scope="cp_gathered", fixture=fx, lse_layout="ht", force=True)
    verdict = judge(fx.path, {"ranks": files, "gathered": [gathered_path]}, tensors, convention, adapter.pad_rows,
                    args.cpgold, args.diagnosis_budget)
    per_rank, whole = verdict.reports["ranks"], verdict.reports["gathered"]
    rows = [list(r) for r in ratios(per_rank)] + [list(r) for r in ratios(whole)]
    failed_ranks = sorted({r["rank"] for r in per_rank["results"] if not r.get("pass") and r.get("rank", -1) >= 0})
    rank_worst = {}
    for tensor, rank, mx, mean in ratios(per_rank):
        rank_worst.setdefault(str(rank), {})[tensor] = max(mx, mean)
    entry.update(tensors=list(tensors), empty_row_lse=convention, pad_rows=adapter.pad_rows,
                 ranks_pass=bool(per_rank["pass"]), gathered_pass=bool(whole["pass"]), failed_ranks=failed_ranks,
                 ratios=rows, worst=worst_per_tensor(rows), rank_worst=rank_worst,
                 failures=[f"ranks: {x}" for x in failures(per_rank)] + [f"gathered: {x}" for x in failures(whole)],
                 diagnosis=list(dict.fromkeys([d.get("kind") for d in per_rank.get("diagnosis", [])] +
                                              [d.get("kind") for d in whole.get("diagnosis", [])])))
    if verdict.valid_rows_pass is not None:
        entry["valid_rows_pass"] = verdict.valid_rows_pass
    entry["status"] = verdict.status


def fixture_table(entries):
    out = ["| suite | fixture | comm | W | verdict | o | lse | dq | dk | dv | failed ranks | diagnosis | s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        worst = e.get("worst", {})
        cells = [f"{worst[t]:.3g}" if t in worst else "-" for t in ("o", "lse", "dq", "dk", "dv")]
        verdict = e["status"]
        if verdict == "fail" and not e.get("ranks_pass", True) and e.get("gathered_pass"):
            verdict += " (ranks only)"
        if e.get("valid_rows_pass") and verdict.startswith("fail"):
            verdict += ", valid rows pass"
        ranks = ",".join(str(r) for r in e.get("failed_ranks", [])) or "-"
        diag = ", ".join(e.get("diagnosis", [])) or "-"
        if e["status"] in ("skipped", "unsupported", "error", "empty") and e.get("reason"):
            diag = e["reason"].splitlines()[0][:120].replace("|", "/")
        out.append(f"| {e['suite']} | {e['fixture']} | {e.get('comm')} | {e.get('cp_size')} | {verdict} | "
                   + " | ".join(cells) + f" | {ranks} | {diag} | {e.get('seconds', '-')} |")
    return "\n".join(out)


def write_summary(out, entries, header, stopped=None):
    from .harness import STATUSES, counts, markdown

    counted = counts(entries, STATUSES + ("skipped",))
    summary = dict(header, counts=counted, stopped=stopped, fixtures=entries)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    ran = [e for e in entries if e["status"] != "skipped"]
    text = [f"## {header['title']}", "", f"{header['world_size']} processes, torch.distributed backend "
            f"{header['dist_backend']}; counts: " + ", ".join(f"{k} {v}" for k, v in counted.items() if v), ""]
    if stopped:
        text += [f"**The run was stopped:** {stopped}", ""]
    text += [fixture_table(entries), ""]
    if ran:
        text += [markdown(ran, "By suite, comm, mask and pad fill"), ""]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    return counted


def progress_line(i, total, e):
    line = f"[{i}/{total}] {e['suite']}/{e['fixture']} {e.get('comm')} W={e.get('cp_size')} {e['status']}"
    if e.get("worst"):
        line += " worst " + " ".join(f"{t} {v:.3g}" for t, v in e["worst"].items())
    if e.get("failed_ranks"):
        line += f" failed ranks {','.join(str(r) for r in e['failed_ranks'])}"
    if e["status"] in ("skipped", "unsupported", "error") and e.get("reason"):
        line += ": " + e["reason"].splitlines()[0][:200]
    if "seconds" in e:
        line += f" ({e['seconds']} s"
        line += f", check {e['check_seconds']} s)" if "check_seconds" in e else ")"
    return line


def recorded(out):
    """The entries DIR/results.jsonl holds, by (suite, fixture) (the last line of a fixture wins); {} without one.
    A line cut short by a crash is left out (that fixture runs again)."""
    found = {}
    try:
        with open(os.path.join(out, "results.jsonl")) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and "suite" in e and "fixture" in e and "status" in e:
                    found[(e["suite"], e["fixture"])] = e
    except FileNotFoundError:
        pass
    return found


def died_in(out, done):
    """The fixture DIR/current names when results.jsonl has no entry for it: the processes ended while running it
    without a status (killed or aborted, e.g. by torch's NCCL watchdog after a device-side assert): its error entry."""
    try:
        with open(os.path.join(out, "current")) as f:
            cur = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cur, dict) or (cur.get("suite"), cur.get("fixture")) in done:
        return None
    from .harness import crash_entry

    return crash_entry(cur.get("suite"), cur.get("fixture"),
                       "the processes ended while running this fixture and left no status (killed or aborted, e.g. "
                       "by torch's NCCL watchdog after a device-side assert); --resume went on after it")


# ------------------------------------------------------------------ one process
class Harness:
    def __init__(self, args, adapter, dist, torch, rank, world, local_rank, device, items):
        from datetime import timedelta

        from .harness import backstop

        self.args, self.adapter, self.dist, self.torch = args, adapter, dist, torch
        self.rank, self.world, self.local_rank, self.device, self.items = rank, world, local_rank, device, items
        # The watchdog (--timeout per fixture) acts first; the process groups' own timeout is the backstop.
        self.pg_timeout = timedelta(seconds=backstop(args.timeout, args.grace))
        self.statuses = Statuses(args.out, world)
        self.entries = []
        self.header = {}
        self.stopping = threading.Lock()
        self.ctl = None
        self.groups = None
        self.done, self.died = {}, None
        self.tag = None            # the digest of every rank's versions (versions())
        self.previous_tag = None   # on --resume: the digest DIR/run.json recorded last (of the stopped processes)
        self.watchdog = Watchdog(self.statuses, rank, args.grace, args.timeout, self.stop)

    def say(self, text, err=False):
        print(f"[rank {self.rank}] {text}" if self.rank else text, file=sys.stderr if err else sys.stdout, flush=True)

    def record(self, entry):
        """Rank 0: the entry appended to results.jsonl and the summary rewritten, so a crash loses nothing before."""
        entry["versions_digest"] = self.tag
        self.entries.append(entry)
        with open(os.path.join(self.args.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")
        return write_summary(self.args.out, self.entries, self.header)

    def stop(self, n, label, reason, own="stopped", trace=None):
        """Ends this process after a failure of fixture n: the status written, rank 0 records the fixture and the
        summary, the others wait for that, then every rank exits naming the failing rank(s). Never returns."""
        if not self.stopping.acquire(blocking=False):
            while True:
                time.sleep(3600)
        self.statuses.write(n, self.rank, own, reason=reason, trace=trace)
        wait = 2 * self.args.grace + 5
        if self.rank == 0:
            deadline = time.time() + wait
            while len(self.statuses.all(n)) < self.world and time.time() < deadline:
                time.sleep(0.1)
            found = self.statuses.all(n)
            bad = {r: s for r, s in sorted(found.items()) if s["status"] in ("error", "context_lost", "refused")}
            silent = [r for r in range(self.world) if r not in found]
            why = "; ".join(f"rank {r} {s['status']}: {s.get('reason', '')}" for r, s in bad.items())
            if silent:
                why += ("; " if why else "") + f"no status from rank(s) {', '.join(map(str, silent))}"
            if not why:
                why = reason
            suite, path = self.items[n]
            entry = self.describe(suite, path)
            entry.update(status="error", reason=f"run stopped: {why}"[:4000], failing_ranks=sorted(bad),
                         rank_status={str(r): s["status"] for r, s in found.items()},
                         traces={str(r): s.get("trace") for r, s in bad.items() if s.get("trace")},
                         versions_digest=self.tag)
            self.entries.append(entry)
            with open(os.path.join(self.args.out, "results.jsonl"), "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")
            write_summary(self.args.out, self.entries, self.header, stopped=f"{label}: {why}")
            self.say(progress_line(n + 1, len(self.items), entry))
            with open(self.statuses.stop_marker, "w") as f:
                f.write(why + "\n")
            self.say(f"{PROG}: stopped at {label}: {why}; the fixtures done so far are in "
                     f"{os.path.join(self.args.out, 'summary.md')}", err=True)
        else:
            deadline = time.time() + wait + 5
            while not os.path.exists(self.statuses.stop_marker) and time.time() < deadline:
                time.sleep(0.1)
            self.say(f"{PROG}: rank {self.rank} stops at {label}: {reason}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code(own))

    def all_raised(self, n, text, trace):
        """After this rank raised: whether every rank raised or refused on fixture n (then nobody waits on a peer and
        the run goes on), waiting up to grace/2 for the peers' statuses."""
        self.statuses.write(n, self.rank, "error", reason=text[:2000], trace=trace)
        deadline = time.time() + self.args.grace / 2
        while time.time() < deadline:
            found = self.statuses.all(n)
            if len(found) == self.world or any(s["status"] in ("ok", "stopped", "context_lost")
                                               for s in found.values()):
                break
            time.sleep(0.05)
        found = self.statuses.all(n)
        return len(found) == self.world and all(s["status"] in ("error", "refused") for s in found.values())

    def describe(self, suite, path):
        from ..fixture import Fixture
        from .harness import describe_entry

        entry = {"fixture": os.path.basename(path), "suite": suite}
        try:
            with Fixture(path) as fx:
                describe_entry(entry, fx)
        except Exception as e:  # noqa: BLE001 - the entry says why
            entry["reason"] = f"{type(e).__name__}: {e}"
        return entry

    def setup(self):
        dist = self.dist
        dist.init_process_group(self.args.dist_backend, timeout=self.pg_timeout)
        got = dist.get_world_size()
        if got != self.world or dist.get_rank() != self.rank:
            raise RuntimeError(f"torch.distributed says rank {dist.get_rank()} of {got}, the environment rank "
                               f"{self.rank} of {self.world}")
        self.ctl = dist.new_group(backend="gloo", timeout=self.pg_timeout)   # statuses, apart from the CP groups
        self.groups = Groups(dist, self.world, self.pg_timeout)
        if self.rank == 0:
            os.makedirs(self.statuses.folder, exist_ok=True)
            for name in os.listdir(self.statuses.folder):
                os.remove(os.path.join(self.statuses.folder, name))
            if not self.args.resume:
                open(os.path.join(self.args.out, "results.jsonl"), "w").close()
        # what a resumed run skips, read by every rank before any fixture starts (rank 0 rewrites DIR/current then)
        self.done = recorded(self.args.out) if self.args.resume else {}
        self.died = died_in(self.args.out, self.done) if self.args.resume else None
        dist.barrier(group=self.ctl)
        self.watchdog.start()

    def run_fixture(self, n, suite, path):
        from ..candidate import write_rank
        from ..fixture import Fixture
        from .adapter import Refused
        from .rank_adapter import GroupInfo, RankResult
        from .harness import context_lost

        label = f"{suite}/{os.path.basename(path)}"
        entry = self.describe(suite, path) if self.rank == 0 else None
        with Fixture(path) as fx:
            if fx.cp_size != self.world:
                if entry is not None:
                    entry.update(status="skipped", reason=f"cp_size {fx.cp_size} is not the world size {self.world}")
                return entry
            reason = self.adapter.unsupported(fx)
            if reason:
                if entry is not None:
                    entry.update(status="unsupported", reason=reason)
                return entry
            stem = os.path.basename(path)[:-3] if path.endswith(".h5") else os.path.basename(path)
            folder = os.path.join(self.args.out, suite)
            os.makedirs(folder, exist_ok=True)
            files = [os.path.join(folder, f"{stem}.r{r}.h5") for r in range(self.world)]
            if os.path.lexists(files[self.rank]):
                os.remove(files[self.rank])
            self.watchdog.begin(n, label)
            if self.rank == 0:   # a process killed outright (an abort, not an exception) leaves this behind
                with open(os.path.join(self.args.out, "current"), "w") as f:
                    json.dump({"suite": suite, "fixture": os.path.basename(path)}, f)
            t0 = time.time()
            mine = {"status": "ok"}
            try:
                groups, lists = self.groups.of(fx, self.rank)
                info = GroupInfo(self.rank, self.world, self.local_rank, self.device, fx.comm,
                                 list(range(self.world)), groups, lists)
                result = self.adapter.run_rank(fx, self.rank, info)
                if not isinstance(result, RankResult):
                    result = RankResult(dict(result))
                outputs = {k: v for k, v in result.outputs.items() if k in (self.adapter.tensors or result.outputs)}
                write_rank(files[self.rank], self.rank, outputs, fixture=fx, lse_layout="ht", force=True)
                mine.update(backend=result.backend, log=result.log, notes=result.notes)
            except Refused as e:
                mine = {"status": "refused", "reason": str(e)[:2000]}
            except Exception as e:  # noqa: BLE001 - every rank stops, naming this one
                text = f"{type(e).__name__}: {e}"
                trace = traceback.format_exc()[-4000:]
                if self.stopping.locked():      # the watchdog is stopping this rank: a peer failed first
                    self.stop(n, label, text)
                self.say(f"{PROG}: rank {self.rank} raised on {label}: {text}\n{trace}", err=True)
                if context_lost(text + trace):
                    self.stop(n, label, text[:2000], own="context_lost", trace=trace)
                if not self.all_raised(n, text, trace):
                    self.stop(n, label, text[:2000], own="error", trace=trace)
                mine = {"status": "error", "reason": text[:2000]}
            mine["seconds"] = round(time.time() - t0, 2)
            self.statuses.write(n, self.rank, mine["status"], reason=mine.get("reason", ""))
            every = [None] * self.world
            self.dist.all_gather_object(every, mine, group=self.ctl)
            kinds = {s["status"] for s in every}
            if kinds != {"ok"}:
                if kinds <= {"refused", "error"}:   # every rank refused or raised: recorded, the run goes on
                    if entry is not None:
                        reasons = "; ".join(f"rank {r}: {s['reason']}" for r, s in enumerate(every)
                                            if s["reason"] != every[0]["reason"] or r == 0)
                        entry.update(status="unsupported" if kinds == {"refused"} else "error",
                                     reason=(reasons if kinds == {"refused"} else f"every rank raised: {reasons}")[:4000],
                                     rank_status=[s["status"] for s in every], seconds=mine["seconds"])
                    self.dist.barrier(group=self.ctl)
                    self.watchdog.end()
                    return entry
                mixed = "; ".join(f"rank {r} {s['status']}: {s.get('reason', '')}" for r, s in enumerate(every)
                                  if s["status"] != "ok")
                self.stop(n, label, f"the ranks disagree: {mixed}")
            if entry is not None:
                entry.update(seconds=max(s["seconds"] for s in every),
                             backend=", ".join(sorted({s.get("backend") or "" for s in every})),
                             log=every[0].get("log"), notes=every[0].get("notes"),
                             rank_seconds=[s["seconds"] for s in every], files=files)
                t1 = time.time()
                try:
                    check_fixture(entry, fx, files, os.path.join(folder, f"{stem}.gathered.h5"),
                                  self.adapter.tensors or ("o", "lse", "dq", "dk", "dv"), self.adapter, self.args)
                except Exception as e:  # noqa: BLE001 - a check that cannot run is this fixture's error
                    entry.update(status="error", reason=f"check: {type(e).__name__}: {e}"[:2000],
                                 trace=traceback.format_exc()[-4000:])
                entry["check_seconds"] = round(time.time() - t1, 2)
            self.dist.barrier(group=self.ctl)
            self.watchdog.end()
        return entry

    def versions(self):
        """Every rank's versions (environment.process_versions with the rank, its local rank and the device its
        tensors live on), gathered on every rank; rank 0 checks them against DIR/run.json on --resume and records
        them there before any fixture runs. Returns 0, or 2 on every rank when a resume is refused."""
        from .environment import describe, differences, digest, process_versions

        mine = {"rank": self.rank, "local_rank": self.local_rank, "tensors_on": str(self.device),
                **process_versions(self.adapter)}
        every = [None] * self.world
        self.dist.all_gather_object(every, mine, group=self.ctl)
        self.tag = digest(every)
        verdict = [0]
        if self.rank == 0:
            run_file = os.path.join(self.args.out, "run.json")
            identity = {k: self.header[k] for k in ("adapter", "options", "world_size", "dist_backend")}
            run = dict(identity, fixture_arguments=self.args.fixtures, rank_versions=every, versions_digest=self.tag,
                       resumes=[])
            if self.args.resume and os.path.exists(os.path.join(self.args.out, "results.jsonl")):
                try:
                    with open(run_file) as f:
                        before = json.load(f)
                    if not isinstance(before, dict) or not isinstance(before.get("rank_versions"), list):
                        raise ValueError("it has no rank_versions list")
                    differ = differences(before["rank_versions"], every)
                except (OSError, ValueError) as e:
                    # the stopped run's versions are unknown: recorded as such, this run's as a resume's
                    before = dict(identity, fixture_arguments=self.args.fixtures, rank_versions=None,
                                  versions_digest=None, resumes=[])
                    differ = [f"{run_file} does not say which versions the stopped run had ({e})"]
                if differ and not self.args.resume_any_versions:
                    self.say(f"{PROG}: --resume: the versions are not those the stopped run started with: "
                             f"{'; '.join(differ)}; nothing was run (--resume-any-versions goes on, recording both)",
                             err=True)
                    verdict[0] = 2
                else:
                    if differ:
                        self.say(f"{PROG}: --resume-any-versions: going on with other versions than the stopped "
                                 f"run's: {'; '.join(differ)}", err=True)
                    resumes = before.get("resumes") if isinstance(before.get("resumes"), list) else []
                    last = resumes[-1] if resumes and isinstance(resumes[-1], dict) else before
                    self.previous_tag = last.get("versions_digest")
                    run = dict(before, resumes=resumes + [
                        {"resumed_with": len(self.done), "rank_versions": every, "versions_digest": self.tag,
                         "differences": differ}])
            if not verdict[0]:
                tmp = f"{run_file}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(run, f, indent=1, default=str)
                os.replace(tmp, run_file)
                start = run.get("rank_versions")
                self.header.update(versions=start[0] if start else None, rank_versions=start,
                                   versions_digest=run.get("versions_digest"), resumes=run["resumes"])
                self.say(f"{self.adapter.name} W={self.world} ({self.args.dist_backend}): {describe(every[0])} "
                         f"({self.tag})")
                for v in every[1:]:
                    self.say(f"  rank {v['rank']}: device {v.get('device')} (tensors on {v.get('tensors_on')}), "
                             f"driver {v.get('driver')}, nccl {v.get('nccl')}")
        self.dist.broadcast_object_list(verdict, src=0, group=self.ctl)
        return verdict[0]

    def main(self):
        self.setup()
        opts = self.adapter.options()
        self.header = {"adapter": self.adapter.name, "options": opts, "world_size": self.world,
                       "dist_backend": self.args.dist_backend, "pad_rows": self.adapter.pad_rows,
                       "title": self.args.title or f"{self.adapter.name} W={self.world} {json.dumps(opts)}",
                       "fixture_arguments": self.args.fixtures}
        if self.versions():
            self.watchdog.end()
            self.dist.destroy_process_group()
            return 2
        t0 = time.time()
        total = len(self.items)
        done, died = self.done, self.died
        if died is not None:    # every rank skips it; rank 0 records it
            done[(died["suite"], died["fixture"])] = died
            path = next((p for s, p in self.items if (s, os.path.basename(p)) == (died["suite"], died["fixture"])),
                        None)
            if self.rank == 0 and path is not None:
                died.update({k: v for k, v in self.describe(died["suite"], path).items() if k not in died})
            if self.rank == 0:
                if self.previous_tag:   # the processes that died in it ran with the versions recorded last
                    died["versions_digest"] = self.previous_tag
                with open(os.path.join(self.args.out, "results.jsonl"), "a") as f:
                    f.write(json.dumps(died) + "\n")
        if self.rank == 0 and self.args.resume:
            self.entries = [e for e in done.values()]
            self.say(f"{PROG}: resuming: {len(done)} fixture(s) already recorded in "
                     f"{os.path.join(self.args.out, 'results.jsonl')} are not run again")
        for n, (suite, path) in enumerate(self.items):
            if (suite, os.path.basename(path)) in done:
                continue
            entry = self.run_fixture(n, suite, path)
            if entry is not None:
                self.record(entry)
                self.say(progress_line(n + 1, total, entry))
                for line in entry.get("failures", [])[:8]:
                    self.say(f"    {line}")
        code = [0]
        if self.rank == 0:
            if os.path.exists(os.path.join(self.args.out, "current")):
                os.remove(os.path.join(self.args.out, "current"))
            counted = write_summary(self.args.out, self.entries, dict(self.header, seconds=round(time.time() - t0, 1)))
            ran = total - counted["skipped"]
            self.say(f"== {self.adapter.name} W={self.world}: {json.dumps(counted)} ({time.time() - t0:.1f} s); "
                     f"{os.path.join(self.args.out, 'summary.md')}")
            code[0] = 1 if counted["fail"] + counted["error"] + counted["empty"] else \
                EXIT_NOTHING_RAN if ran == 0 else 0
            if ran == 0:
                self.say(f"{PROG}: no fixture has cp_size {self.world} (the world size): nothing ran", err=True)
        self.dist.broadcast_object_list(code, src=0, group=self.ctl)
        self.watchdog.end()
        self.dist.destroy_process_group()
        return code[0]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.resume_any_versions and not args.resume:
        return fail_usage("--resume-any-versions: only with --resume")
    if args.dist_backend == "nccl" and os.environ.get("NCCL_NVLS_ENABLE") != "0":
        found = os.environ.get("NCCL_NVLS_ENABLE")
        return fail_usage("NCCL_NVLS_ENABLE=0 must be in the environment of every process with --dist-backend nccl "
                          f"(found {'unset' if found is None else repr(found)}): NVLink SHARP (NVLS) stays off on "
                          "these machines; run `NCCL_NVLS_ENABLE=0 torchrun ...`")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        return fail_usage(f"{', '.join(missing)} not set: start it with torchrun (torchrun --nproc-per-node W -m "
                          f"{PROG} ...), one process per rank")
    rank, world, local_rank = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    from .__main__ import parse_sets
    from .rank_adapter import make_rank_adapter, rank_adapter_class
    from .harness import fixture_list

    options = parse_sets(args.set)
    if args.deterministic:
        options["deterministic"] = True
    if args.backend:
        if args.adapter != "te_cp":
            return fail_usage(f"--backend: the adapter {args.adapter} has no backend choice (te_cp only)")
        options["backend"] = args.backend
    try:
        items = fixture_list(args.fixtures, args.only)
    except FileNotFoundError as e:
        return fail_usage(str(e))
    if not items:
        return fail_usage("fixtures: no .h5 file found")
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return fail_usage(f"needs torch with torch.distributed: {e}")
    if not dist.is_available():
        return fail_usage("this torch has no torch.distributed")
    if args.dist_backend == "nccl":
        if not torch.cuda.is_available():
            return fail_usage("--dist-backend nccl needs CUDA GPUs (torch.cuda.is_available() is False); "
                              "--dist-backend gloo runs on CPUs")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # the process group's timeout applies
        os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "1")
    else:
        device = torch.device("cpu")
    if getattr(rank_adapter_class(args.adapter), "requires_cuda", False) and device.type != "cuda":
        return fail_usage(f"{args.adapter} runs on GPUs: use --dist-backend nccl")
    try:
        adapter = make_rank_adapter(args.adapter, **options)
    except (ValueError, TypeError) as e:
        return fail_usage(str(e))
    except ImportError as e:
        return fail_usage(f"{args.adapter}: {e}")
    os.makedirs(args.out, exist_ok=True)
    return Harness(args, adapter, dist, torch, rank, world, local_rank, device, items).main()


if __name__ == "__main__":
    sys.exit(main())
