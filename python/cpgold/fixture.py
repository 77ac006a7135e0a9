"""A cpgold golden fixture (fixtures/SCHEMA.md) read as numpy arrays or torch tensors.

Rows: `Tq`/`Tkv` global rows (padding between sequences and tail rows included), `Lq`/`Lkv` rank-local rows.
The global layout keeps sequence b at rows [cu_seqlens_padded[b], cu_seqlens_padded[b] + length[b]); a kernel
without per-sequence used lengths (FlashAttention-2's varlen API) reads the valid rows compacted (`compact`) and
writes back with `expand`.
"""
import hashlib
import json
import os

import h5py
import numpy as np

from . import _arrays
from ._core_loader import available as _core_available
from ._core_loader import core as _core
from .errors import InputError

SUPPORTED_SCHEMA_VERSIONS = (1, 2)
INPUT_NAMES = ("q", "k", "v", "dout")
OUTPUT_NAMES = ("o", "lse", "dq", "dk", "dv")
# Which side (q or kv rows) every tensor's first row axis lives on; LSE is [h, t] on the q side.
SIDE = {"q": "q", "dout": "q", "o": "q", "lse": "q", "dq": "q", "k": "kv", "v": "kv", "dk": "kv", "dv": "kv"}


def _case_property(key, convert=None):
    """A read-only property: the case's field `key`, as `convert` makes it where given."""
    if convert is None:
        return property(lambda self: self.case[key], doc=f"The case's {key}.")
    return property(lambda self: convert(self.case[key]), doc=f"The case's {key}.")


class FixtureError(InputError):
    """A fixture that this package cannot use (missing file or dataset, unknown schema version, anything
    `cpgold inspect --no-verify` refuses); `field` names the file, object or attribute."""


IN_MEMORY = "<fixture in memory>"


class Fixture:
    """One golden fixture, open for reading: a path, or the bytes of one (cpgold.generate(case) without a path).
    Use as a context manager or call close()."""

    def __init__(self, path):
        if isinstance(path, (bytes, bytearray, memoryview)):
            self.source = bytes(path)  # what the check engine opens
            self.path = IN_MEMORY
            opened = None  # an HDF5 file image (below), never a Python file object
        else:
            self.path = os.fspath(path) if not isinstance(path, str) else path
            self.source = self.path
            opened = self.path
        self._file = None
        # The reader of `cpgold inspect --no-verify` first (cpgold's C++ core): a pipe, a link to one, datasets
        # declared but never written, attributes of the wrong type or shape, case_json nested too deep or naming a key
        # twice are refused naming the object, in bounded time and memory, before h5py opens anything.
        if _core_available():
            try:
                _core().open_fixture(self.source, False)
            except InputError as e:
                raise FixtureError(str(e), e.field) from None
        elif not isinstance(self.source, bytes):
            _require_regular_file(self.path)
        try:
            if opened is None:
                # HDF5's own in-memory image: a Python file object (io.BytesIO) would have the HDF5 library call back
                # into Python when it closes the file, and a Fixture still open when the interpreter ends is closed by
                # the library's exit handler after Python is gone (a crash at exit, after the program's work is done)
                self._file = h5py.File(h5py.h5f.open_file_image(self.source), "r")
            else:
                self._file = h5py.File(opened, "r")
        except OSError as e:
            raise FixtureError(f"fixture {self.path!r}: cannot open as HDF5 ({e})", self.path) from None
        try:
            self._read_case()
        except FixtureError:
            self.close()
            raise
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            self.close()
            raise FixtureError(f"fixture {self.path!r}: not a readable cpgold fixture ({type(e).__name__}: {e})",
                               self.path) from None

    def _read_case(self):
        if "case" not in self._file:
            raise FixtureError(f"fixture {self.path!r}: no /case group (not a cpgold fixture)", "/case")
        attrs = self._file["case"].attrs
        version = attrs["schema_version"]
        if np.ndim(version) != 0 or not np.issubdtype(np.asarray(version).dtype, np.integer):
            raise FixtureError(f"fixture {self.path!r}: /case attribute schema_version: expected a scalar integer, "
                               f"found {np.asarray(version).dtype} {list(np.shape(version))}", "schema_version")
        self.schema_version = int(version)
        if self.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
            raise FixtureError(f"fixture {self.path!r}: schema_version {self.schema_version} is not one of "
                               f"{SUPPORTED_SCHEMA_VERSIONS}", "schema_version")
        self.case_json = _text(attrs["case_json"])
        try:
            self.case = json.loads(self.case_json)
        except (ValueError, RecursionError) as e:
            raise FixtureError(f"fixture {self.path!r}: /case attribute case_json: not a case ({type(e).__name__})",
                               "case_json") from None
        self.generator = _text(attrs["generator"])
        self._inputs_sha256 = _text(attrs["inputs_sha256"]) if "inputs_sha256" in attrs else None
        # "seed" or "given" (fixtures/SCHEMA.md, "Given inputs"); fixtures written before the attribute are seeded.
        self.inputs_source = _text(attrs["inputs_source"]) if "inputs_source" in attrs else "seed"
        self.inputs_nonfinite_valid = int(attrs["inputs_nonfinite_valid"]) if "inputs_nonfinite_valid" in attrs else 0
        # What computed the oracle and the peers: "cpu" (the reference, also fixtures written before the attribute) or
        # "gpu" (`cpgold gen --engine gpu`, with the device and library versions in engine_versions; docs/scale.md).
        self.engine = _text(attrs["engine"]) if "engine" in attrs else "cpu"
        self.engine_versions = _text(attrs["engine_versions"]) if "engine_versions" in attrs else None
        self._layout = {name: np.asarray(self._file["layout"][name][()]) for name in self._file["layout"]}

    # -- the case ------------------------------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __repr__(self):
        return f"Fixture({self.path!r}, dtype={self.dtype}, cp_size={self.cp_size}, comm={self.comm})"

    def validate(self, verify=True):
        """Reads the file with cpgold's C++ reader, as `cpgold inspect` does: schema version, every dataset's presence,
        type and shape against the case, the stored layout, and with verify every checksum and the inputs digest.
        Returns {schema_version, generator, case_json, traced, datasets, inputs_sha256}; InputError naming the
        dataset otherwise. Needs the extension."""
        from ._core_loader import core

        return core().open_fixture(self.source, bool(verify))

    @property
    def inputs_sha256(self):
        """SHA-256 naming the fixture's inputs (fixtures/SCHEMA.md, "Inputs digest"): the /case attribute, or for a
        fixture written before it existed the same digest computed from /inputs. Writers copy it into candidates."""
        if self._inputs_sha256 is None:
            digest = hashlib.sha256()
            for name in INPUT_NAMES:
                digest.update(raw_bytes(self._file["inputs"][name]))
            self._inputs_sha256 = digest.hexdigest()
        return self._inputs_sha256

    @property
    def dtype(self):
        """'bf16', 'fp16' or 'fp32': the dtype of the inputs and of the peer."""
        return self.case["dtype"]

    cp_size = _case_property("cp_size", int)
    comm = _case_property("comm")
    heads_q = _case_property("heads_q", int)
    heads_kv = _case_property("heads_kv", int)
    dim_qk = _case_property("dim_qk", int)
    dim_v = _case_property("dim_v", int)
    softmax_scale = _case_property("softmax_scale", float)

    @property
    def causal(self):
        return self.case["mask"] == "causal"

    @property
    def window(self):
        """(left, right), -1 = unbounded, FlashAttention's convention; causal forces right = 0."""
        wl, wr = (int(w) for w in self.case["window"])
        return (wl, 0 if self.causal else wr)

    @property
    def num_sequences(self):
        return len(self.case["seqlens_q"])

    def total_rows(self, side):
        """Tq or Tkv: rows of the global layout, padding and tail rows included."""
        return int(self.case["total_tokens_q" if _side(side) == "q" else "total_tokens_kv"])

    def seqlens(self, side):
        """[B] int32: actual length of every sequence."""
        return np.diff(self.cu_seqlens(side)).astype(np.int32)

    def max_seqlen(self, side):
        s = self.seqlens(side)
        return int(s.max()) if s.size else 0

    # -- layout --------------------------------------------------------------------------------------------------

    def cu_seqlens(self, side, padded=False):
        """[B+1] int32: global cumulative actual lengths (padded=False) or the padded offsets (padded=True)."""
        return self._layout[f"cu_seqlens_{_side(side)}" + ("_padded" if padded else "")].astype(np.int32)

    def rank_cu_seqlens(self, rank, side, padded=False):
        """[B+1] int32 of one rank: its cumulative actual row counts (both chunks of every sequence), or with
        padded=True the rank-local padded offsets cu_seqlens_padded / W (the same on every rank)."""
        self._check_rank(rank)
        s = _side(side)
        if padded:
            return self._layout[f"cu_seqlens_{s}_padded_local"].astype(np.int32)
        return self._layout[f"rank_cu_seqlens_{s}"][rank].astype(np.int32)

    def partitioned_indices(self, rank, side):
        """[Lq] or [Lkv] int64: the global row of every rank-local row."""
        self._check_rank(rank)
        return self._layout[f"partitioned_indices_{_side(side)}"][rank].astype(np.int64)

    def valid_rows(self, side):
        """[T] bool: rows that hold a token (not padding between sequences, not tail rows)."""
        s = _side(side)
        cu, off = self.cu_seqlens(s), self.cu_seqlens(s, padded=True)
        valid = np.zeros(self.total_rows(s), dtype=bool)
        for b in range(len(cu) - 1):
            valid[off[b]:off[b] + (cu[b + 1] - cu[b])] = True
        return valid

    def rank_valid_rows(self, rank, side):
        """[L] bool: the rank-local rows that hold a token."""
        return self.valid_rows(side)[self.partitioned_indices(rank, side)]

    def valid_index(self, side):
        """[total valid] int64: global rows of the valid tokens in order (the compacted layout's row map)."""
        return np.flatnonzero(self.valid_rows(side)).astype(np.int64)

    # -- tensors -------------------------------------------------------------------------------------------------

    def inputs(self, framework="numpy", device=None):
        """q [Tq,hq,dqk], k [Tkv,hkv,dqk], v [Tkv,hkv,dv], dout [Tq,hq,dv] in the global layout.
        numpy: fp16 as float16, bf16 and fp32 as float32 (bf16 values are exact in float32);
        torch: tensors of the case dtype (torch.bfloat16 for bf16) on `device`. Pad rows hold the case's pad_fill
        (random, zero, NaN or +-inf): a kernel must not read them."""
        return {name: self._input(f"inputs/{name}", framework, device) for name in INPUT_NAMES}

    def rank_inputs(self, rank, framework="numpy", device=None):
        """The rank-local shards q [Lq,..], k, v [Lkv,..], dout [Lq,..] as stored under /ranks/<r>/."""
        self._check_rank(rank)
        return {name: self._input(f"ranks/{rank}/{name}", framework, device) for name in INPUT_NAMES}

    def golden(self, name, rank=None):
        """float32 oracle output (o, lse [h,t], dq, dk, dv), global or of one rank."""
        if name not in OUTPUT_NAMES:
            raise ValueError(f"golden: tensor {name!r} is not one of {OUTPUT_NAMES}")
        if rank is not None:
            self._check_rank(rank)
        path = f"golden/{name}" if rank is None else f"ranks/{rank}/{name}"
        return np.asarray(self._file[path][()], dtype=np.float32)

    def budget(self, name):
        """The budget attributes of /golden/<name> as a dict (rtol, atol, cp_max_budget, ...)."""
        return {k: _text(v) for k, v in self._file[f"golden/{name}"].attrs.items()}

    def _input(self, path, framework, device):
        x = np.asarray(self._file[path][()])
        if framework == "numpy":
            return x
        if framework == "torch":
            return _arrays.to_torch(x, self.dtype, device)
        raise ValueError(f"framework: expected 'numpy' or 'torch', got {framework!r}")

    # -- layout changes ------------------------------------------------------------------------------------------

    def compact(self, x, side, axis=0):
        """Valid rows only, sequence after sequence (cu_seqlens(side) is the compacted layout's offsets).
        x: numpy array or torch tensor with the global rows on `axis` (0 for q/k/v/o, 1 for LSE [h, t])."""
        return _arrays.take_rows(x, self.valid_index(side), axis)

    def expand(self, x, side, axis=0, fill=0.0):
        """Inverse of compact: a global-layout array with `fill` on pad and tail rows."""
        return _arrays.put_rows(x, self.valid_index(side), self.total_rows(side), axis, fill)

    def shard(self, x, rank, side, axis=0):
        """The rank-local rows of a global-layout array: x[partitioned_indices(rank, side)] along `axis`."""
        return _arrays.take_rows(x, self.partitioned_indices(rank, side), axis)

    def shard_outputs(self, outputs):
        """Per-rank dicts of global outputs (o, lse [h,t] or [t,h,1], dq, dk, dv), each sharded by the partition."""
        ranks = []
        for r in range(self.cp_size):
            shard = {}
            for name, x in outputs.items():
                lse_ht = name == "lse" and _arrays.ndim(x) == 2
                shard[name] = self.shard(x, r, SIDE[name], axis=1 if lse_ht else 0)
            ranks.append(shard)
        return ranks

    def _check_rank(self, rank):
        if not 0 <= int(rank) < self.cp_size:
            raise ValueError(f"rank: {rank} is outside [0, {self.cp_size}) (cp_size {self.cp_size})")


def _require_regular_file(path):
    """Without the C++ core: at least never block on a pipe (open(2) of a FIFO waits for a writer)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise FixtureError(f"{path}: cannot open ({e.strerror})", path) from None
    if not stat.S_ISREG(mode):
        kind = "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise FixtureError(f"{path}: is {kind}, expected an HDF5 file (a regular file)", path)


def _side(side):
    if side not in ("q", "kv"):
        raise ValueError(f"side: expected 'q' or 'kv', got {side!r}")
    return side


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def raw_bytes(dataset):
    """A dataset's element bytes as the file stores them (bf16 has no numpy type: read as 16-bit words)."""
    t = dataset.id.get_type()
    if t.get_class() == h5py.h5t.FLOAT and t.get_size() == 2 and t.get_ebias() == 127:
        out = np.empty(dataset.shape, dtype="<u2")
        if out.size:
            dataset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=t)
        return out.tobytes()
    return np.ascontiguousarray(dataset[()]).tobytes()
