"""Cases, suites, `explain` and fixture generation in process (the code of `cpgold gen` and `cpgold explain`).

A case is a dict of the keys of docs/case-spec.md (or the same as a JSON string, or keyword arguments):
    cpgold.normalize_case({"seqlens_q": [5, 8], "cp_size": 2, "mask": "causal"})
returns it with every key and its default; a bad key or value is an InputError naming the key.
"""
import json
import os

from ._core_loader import core


def _case_text(case=None, **keys):
    """The case as JSON text for the core. Text goes to the core as given, so that its parser (the one of
    `cpgold gen --case`: a key twice, nesting past 32 levels, numbers past a double) judges it; with keyword arguments
    it is validated by the core first and the keys merged into its normalised form."""
    from .errors import InputError

    if case is None:
        case = {}
    if isinstance(case, (bytes, bytearray)):
        case = bytes(case).decode("utf-8", errors="replace")
    if isinstance(case, str):
        if not keys:
            return case
        case = json.loads(core().normalize_case(case))
    if not isinstance(case, dict):
        raise InputError(f"case: expected a dict or a JSON object, got {type(case).__name__}", "case")
    merged = dict(case, **keys)
    try:
        return json.dumps(merged, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InputError(f"case: not representable as JSON ({type(e).__name__}: {e})", "case") from None


def normalize_case(case=None, **keys):
    """The case as a dict with every key and its default (the form a fixture stores), validated."""
    return json.loads(core().normalize_case(_case_text(case, **keys)))


class SuiteCase:
    """One case of a suite: `name` (a fixture's file stem), `case` (a dict), `json` (as given), `cpu_only`, `trace`."""

    def __init__(self, d):
        self.name = d["name"]
        self.json = d["json"]
        self.case = json.loads(d["json"])
        self.cpu_only = bool(d["cpu_only"])
        self.trace = bool(d["trace"])
        self.note = d["note"]

    def __repr__(self):
        return f"SuiteCase({self.name!r})"


def suite_names():
    """quick, edge, te, full, golden, random."""
    return list(core().suite_names())


def suite(name):
    """The cases of a named suite (`cpgold gen --suite NAME`)."""
    return [SuiteCase(d) for d in core().suite_cases(name)]


def random_suite(count, seed):
    """`count` valid random cases drawn from `seed` alone (`cpgold gen --suite random --count N --seed S`)."""
    return [SuiteCase(d) for d in core().random_cases(int(count), int(seed))]


def explain(case=None, summary=False, **keys):
    """`cpgold explain --format json` as a dict (docs/explain-json.md): chunk map, per-step tables, work, warnings.
    Large layouts, or summary=True, give the summary form."""
    text, _ = core().explain(_case_text(case, **keys), summary)
    return json.loads(text)


def explain_text(case=None, summary=False, te=False, **keys):
    """`cpgold explain` as text; te=True is `explain --te` (TransformerEngine's cu_seqlens // W shortcut warnings
    listed instead of counted in one line)."""
    _, text = core().explain(_case_text(case, **keys), summary, bool(te))
    return text


def _input_array(name, value):
    """One given input as a C-ordered float32 or float64 numpy array, exactly (torch tensors on any device, bf16 and
    float16 widened to float32, which holds every value of theirs); any other dtype is left for the core to refuse
    with the tensor named."""
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "dtype") and not isinstance(value, np.ndarray):  # torch
        import torch

        t = value.detach().to("cpu")
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        value = t.numpy()
    a = np.asarray(value)
    if a.dtype == np.float16:
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def generate(case=None, path=None, trace=False, force=False, yes=False, inputs=None, allow_nonfinite=False, shard=None,
             engine="cpu", **keys):
    """A golden fixture of the case, made by the code of `cpgold gen`.
    path: write it there (never over an existing file unless force) and return a Fixture open on it;
    None: keep it in memory and return a Fixture on its bytes (the same bytes `gen` writes; nothing stays on disk).
    trace: also store the per-step partials. Before any work the memory estimate (with gen's margin) and, with a path,
    the disk estimate are checked against what the machine has, as `cpgold gen` does; yes=True goes ahead anyway
    (`gen --yes`). cpgold's signal handlers are installed only while the file is written, and Python's are back
    afterwards; Ctrl-C during the write removes the file and raises KeyboardInterrupt.
    inputs: {"q", "k", "v", "dout"} as numpy arrays or torch tensors in the global padded THD layout of the case
    ([rows, heads, dim], values of the case dtype): the golden, peer, per-rank and per-step data are computed from
    them instead of from the seed, exactly as `cpgold gen --inputs FILE` does (the same checks, the same fixture);
    the fixture records inputs_source "given". NaN or infinity in a valid row is refused unless allow_nonfinite
    (the fixture is then flagged). docs/capture.md.
    shard: (I, N) or "I/N": compute only KV-head group I of N and write it to path as a part file, as
    `cpgold gen --shard I/N` does (returns {"path", "bytes", "datasets", "shard", "kv_heads", "q_heads"}, no Fixture:
    a part is not a fixture); `merge` puts the N parts together into the fixture, bit for bit. docs/cli.md.
    engine: what computes the oracle and the peers, as `cpgold gen --engine`: "cpu" (the reference, the default),
    "gpu" (InputError naming `engine` where this extension has no GPU engine or no device: never a silent fallback),
    "auto" (gpu where it can run, else cpu); the fixture records it (`Fixture.engine`, docs/scale.md)."""
    from .errors import InputError
    from .fixture import Fixture

    text = _case_text(case, **keys)
    shard = _shard(shard)
    if shard is not None and path is None:
        raise InputError("shard: a part is written to a file: give a path (cpgold.merge puts the parts together)",
                         "shard")
    arrays = None
    if inputs is not None:
        if not hasattr(inputs, "keys"):
            raise InputError(f"inputs: expected a dict of q, k, v, dout, got {type(inputs).__name__}", "inputs")
        extra = sorted(set(inputs) - {"q", "k", "v", "dout"})
        if extra:
            raise InputError(f"inputs: unknown tensor(s) {extra}: give q, k, v and dout", "inputs")
        arrays = {name: _input_array(name, value) for name, value in inputs.items()}
    elif allow_nonfinite:
        raise InputError("allow_nonfinite: only with inputs= (seeded inputs are always finite in valid rows)",
                         "allow_nonfinite")
    if path is None:
        return Fixture(core().generate(text, None, bool(trace), False, bool(yes), arrays, bool(allow_nonfinite),
                                       None, str(engine)))
    written = core().generate(text, os.fspath(path), bool(trace), bool(force), bool(yes), arrays,
                              bool(allow_nonfinite), shard, str(engine))
    if shard is not None:
        return written
    return Fixture(path)


def _shard(shard):
    """(I, N) from (I, N) or "I/N"; None stays None. InputError naming `shard` otherwise."""
    from .errors import InputError

    if shard is None:
        return None
    parts = shard.split("/") if isinstance(shard, str) else shard
    try:
        index, count = parts
        if isinstance(index, str):
            index, count = int(index.strip()), int(count.strip())
        elif isinstance(index, bool) or isinstance(count, bool) or int(index) != index or int(count) != count:
            raise TypeError
        index, count = int(index), int(count)
    except (TypeError, ValueError):
        raise InputError(f"shard: {shard!r} is not (I, N) or \"I/N\" (e.g. (2, 8) for the second of eight parts)",
                         "shard") from None
    if count < 1 or not 1 <= index <= count:
        raise InputError(f"shard: {shard!r}: give 1 <= I <= N (shards count from 1)", "shard")
    return index, count


def merge(parts, path, force=False, yes=False):
    """The fixture of the parts written by generate(..., shard=(I, N)) or `cpgold gen --shard I/N` (all N parts of one
    case, in any order), written to path as `cpgold merge PARTS -o path` writes it: bit for bit the fixture generate()
    writes without a shard. The parts are checked to belong together first (InputError naming the part and the field);
    nothing is replaced without force. Returns a Fixture open on path."""
    from .errors import InputError
    from .fixture import Fixture

    if isinstance(parts, (str, bytes, os.PathLike)):
        raise InputError("parts: give a list of part files, not one path", "parts")
    core().merge([os.fspath(p) for p in parts], os.fspath(path), bool(force), bool(yes))
    return Fixture(path)
