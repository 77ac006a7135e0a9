"""cpgold.capture on the CPU: a small model's training step whose attention is a user's own CP ring attention
(capture_ring.py) on thread ranks, TransformerEngine / FlashAttention-3 / varlen_attn stand-ins (capture_fakes.py),
captured, joined, checked and shrunk (docs/capture.md)."""
import copy
import errno
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: capture records torch calls")
h5py = pytest.importorskip("h5py")

import cpgold  # noqa: E402
from cpgold._core_loader import available as core_available  # noqa: E402

if not core_available():
    pytest.skip("cpgold's C++ core (cpgold._core) is not built: join and check need it", allow_module_level=True)

import cpgold.capture as capture  # noqa: E402
from cpgold.thread_ranks import ThreadRanks  # noqa: E402

import capture_fakes  # noqa: E402
import capture_ring as ring  # noqa: E402
import capture_shrink_command  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHONPATH = os.pathsep.join(p for p in sys.path if p)

SPEC = dict(q="q", k="k", v="v", cu_seqlens_q="cu_seqlens_q", cu_seqlens_kv="cu_seqlens_kv",
            cu_seqlens_q_padded="cu_seqlens_q_padded", cu_seqlens_kv_padded="cu_seqlens_kv_padded", causal="causal",
            scale="scale", cp_group="group", returns=("o", "lse"))


def run_step(w, folder=None, bugs=None, run_steps=(0,), dtype=torch.float32, n_layers=3, **options):
    """The model's training step(s) on w thread ranks, captured into folder (None: no capture). Returns the
    per-rank results of the last step and the Capture."""
    batch = ring.batch_of(w)
    base = ring.Model(n_layers, bugs=bugs, dtype=dtype)
    replicas = [copy.deepcopy(base) for _ in range(w)]
    cap = capture.Capture(folder, **options) if folder is not None else None
    if cap is not None:
        attention = cap.attention(ring.ring_attention, **SPEC)
        for m in replicas:
            ring.set_attention(m, attention)

    def rank_main(rank, ranks):
        model = replicas[rank]
        if cap is not None:
            cap.attach(model)
        result = None
        for n in run_steps:
            with (cap.step(n) if cap is not None else _nothing()):
                result = ring.train_step(model, batch, rank, ranks.group())
        return result

    try:
        results = ThreadRanks(w, device="cpu", timeout=60).run(rank_main)
    finally:
        if cap is not None:
            cap.close()
    return results, cap


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def index(folder):
    return capture.joining.read_index(str(folder))


@pytest.mark.parametrize("w", [2, 3, 4])
def test_capture_names_the_planted_layer_and_its_bug(tmp_path, w):
    """Layer 1's attention swaps this rank's two chunks on rank 1 only: that call, and only it, fails, and the
    diagnosis names the swap (chunk_order, chunks 1 and 2W-2 of rank 1)."""
    folder = tmp_path / "cap"
    run_step(w, folder, bugs={1: "chunks_swapped@r1"})
    records = index(folder)
    assert sorted({r["call"] for r in records}) == ["step0.layers.0", "step0.layers.1", "step0.layers.2"]
    assert all(r["status"] == "captured" and r["cp_size"] == w and not r["missing"] for r in records)
    assert len(records) == 3 * w
    report = capture.check(folder)
    assert report.exit_code == 1 and report["first_failure"] == "step0.layers.1"
    status = {c["call"]: c["status"] for c in report["calls"]}
    assert status == {"step0.layers.0": "pass", "step0.layers.1": "fail", "step0.layers.2": "pass"}
    failing = next(c for c in report["calls"] if c["status"] == "fail")
    assert [d["kind"] for d in failing["diagnosis"]][0] == "chunk_order"
    assert f"rank 1 chunks 1 and {2 * w - 2} swapped" in failing["diagnosis"][0]["evidence"]
    rank1 = next(r for r in failing["ranks"] if r["rank"] == 1)
    assert not rank1["pass"] and {"o", "lse", "dq"} <= set(rank1["failed"])
    text = report.text
    assert "step 0  layers.1  rank 1  FAIL" in text and "step 0  layers.0  rank 0  pass" in text
    assert "first failing call: step 0 layers.1" in text and "diagnosis chunk_order" in text
    for c in report["calls"]:
        assert len(c["ranks"]) == w
        for r in c["ranks"]:
            assert r["p99"] is not None and r["worst"] is not None
            if c["status"] == "pass":
                assert 0 < r["p99"] <= r["worst"] <= 1


def test_capture_leaves_outputs_and_gradients_bit_identical(tmp_path):
    """The same step without capture, with it (all calls) and with a selection (heads, layers): the same loss, model
    outputs and parameter gradients, bit for bit, on every rank; also with CaptureWarning turned into an error."""
    plain, _ = run_step(3, None, bugs={1: "chunks_swapped@r1"})
    for i, options in enumerate([{}, {"heads": 1, "layers": ["layers.1"]}]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", capture.CaptureWarning)
            captured, cap = run_step(3, tmp_path / f"cap{i}", bugs={1: "chunks_swapped@r1"}, **options)
        assert cap.calls == (9 if not options else 3)
        for a, b in zip(plain, captured):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_bf16_attention_is_captured_and_checked(tmp_path):
    """bf16 q, k, v (stored as float32, exactly): the case is bf16 and every call passes."""
    folder = tmp_path / "cap"
    run_step(2, folder, dtype=torch.bfloat16, n_layers=2)
    with h5py.File(folder / "calls" / "step0.layers.0" / "rank0.h5", "r") as f:
        assert f["q"].dtype == np.float32 and f["q"].attrs["dtype"] == "bf16"
        q = torch.from_numpy(f["q"][()])
        assert torch.equal(q.bfloat16().float(), q)
    report = capture.check(folder)
    assert report.exit_code == 0, report.text
    with open(folder / "joined" / "step0.layers.0" / "case.json") as f:
        assert json.load(f)["dtype"] == "bf16"


def test_joined_fixture_equals_generate_of_the_gathered_inputs(tmp_path):
    """What check uses as the golden of a call is cpgold.generate(case, inputs=...) of the case of the batch and the
    rank shards gathered through the model's own partition (computed here, not by the capture)."""
    w = 2
    folder = tmp_path / "cap"
    run_step(w, folder)
    report = capture.check(folder, keep_golden=True)
    assert report.exit_code == 0, report.text
    batch = ring.batch_of(w)
    cu, cu_padded = batch["cu"].numpy(), batch["cu_padded"].numpy()
    model = ring.Model(3)
    block = model.layers[0]
    case = {"seqlens_q": np.diff(cu).tolist(), "padded_q": np.diff(cu_padded).tolist(),
            "total_tokens_q": batch["total"], "heads_q": block.hq, "heads_kv": block.hkv, "dim_qk": block.d,
            "dtype": "fp32", "mask": "causal", "cp_size": w, "comm": "p2p", "softmax_scale": block.d ** -0.5}
    call = folder / "calls" / "step0.layers.1"
    gathered = {}
    for name in ("q", "k", "v", "dout"):
        shards = []
        for r in range(w):
            with h5py.File(call / f"rank{r}.h5", "r") as f:
                shards.append(f[name][()])
        g = np.zeros((batch["total"],) + shards[0].shape[1:], dtype=np.float32)
        for r in range(w):
            g[ring.rank_rows(cu_padded, batch["total"], w, r)] = shards[r]
        gathered[name] = g
    expected = cpgold.generate(case, inputs=gathered)
    joined = folder / "joined" / "step0.layers.1"
    with open(joined / "golden.h5", "rb") as f:
        assert f.read() == expected.source
    assert expected.inputs_source == "given"
    with open(joined / "case.json") as f:
        assert json.load(f) == cpgold.normalize_case(case, pad_fill=expected.case["pad_fill"])
    for r in range(w):
        candidate = cpgold.read_candidate(joined / "candidate.h5", rank=r)
        with h5py.File(call / f"rank{r}.h5", "r") as f:
            for name in ("o", "dq", "dk", "dv", "lse"):
                assert np.array_equal(candidate[name], f[name][()])


def test_a_folder_with_foreign_files_is_refused_and_nothing_is_overwritten(tmp_path):
    folder = tmp_path / "cap"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(capture.CaptureFolderError, match=r"not written by a capture \(notes\.txt\)"):
        capture.Capture(folder)
    assert (folder / "notes.txt").read_text() == "mine" and sorted(os.listdir(folder)) == ["notes.txt"]
    with pytest.raises(capture.CaptureFolderError, match="not a capture folder"):
        capture.check(folder)
    # a capture folder with one foreign file among its own
    good = tmp_path / "good"
    run_step(2, good, n_layers=1)
    (good / "calls" / "step0.layers.0" / "extra.h5").write_bytes(b"x")
    with pytest.raises(capture.CaptureFolderError, match=r"calls/step0\.layers\.0/extra\.h5"):
        capture.join(good)
    proc = subprocess.run([sys.executable, "-m", "cpgold.capture", "check", str(good)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert proc.returncode == 2 and "extra.h5" in proc.stderr
    os.unlink(good / "calls" / "step0.layers.0" / "extra.h5")
    # an earlier capture's folder: a new capture does not add to it
    with pytest.raises(capture.CaptureFolderError, match="earlier capture"):
        capture.Capture(good)
    # joining twice keeps the first join's files as they are
    assert capture.join(good).exit_code == 0
    candidate = good / "joined" / "step0.layers.0" / "candidate.h5"
    before = (candidate.read_bytes(), os.stat(candidate).st_mtime_ns)
    again = capture.join(good)
    assert [e["status"] for e in again] == ["exists"]
    assert (candidate.read_bytes(), os.stat(candidate).st_mtime_ns) == before


def _te_model(cp):
    class Block(torch.nn.Module):
        def __init__(self, fmt):
            super().__init__()
            self.qkv = torch.nn.Linear(24, 8 * 16, bias=False)
            self.core_attention = capture_fakes.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=fmt)
            self.proj = torch.nn.Linear(4 * 16, 24, bias=False)
            self.fmt = fmt

        def forward(self, x, batch):
            q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)
            t = x.shape[0]
            q, k, v = q.reshape(t, 4, 16), k.reshape(t, 2, 16), v.reshape(t, 2, 16)
            if self.fmt == "bshd":
                o = self.core_attention(q[None], k[None], v[None]).reshape(t, -1)
            else:
                o = self.core_attention(q, k, v, cu_seqlens_q=batch["cu"], cu_seqlens_kv=batch["cu"],
                                        cu_seqlens_q_padded=batch["cu_padded"], cu_seqlens_kv_padded=batch["cu_padded"])
            return x + self.proj(o)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.layers = torch.nn.ModuleList([Block("thd"), Block("bshd" if not cp else "thd")])

        def forward(self, x, batch):
            for layer in self.layers:
                x = layer(x, batch)
            return x
    return Net()


def _te_step(w, folder, on_cp):
    batch = ring.batch_of(w)
    base = _te_model(cp=on_cp)
    replicas = [copy.deepcopy(base) for _ in range(w)]
    cap = capture.Capture(folder) if folder is not None else None

    def rank_main(rank, ranks):
        model = replicas[rank]
        if w > 1:
            for m in model.modules():
                if isinstance(m, capture_fakes.DotProductAttention):
                    m.set_context_parallel_group(ranks.group(), list(range(w)), None, "p2p")
        found = cap.attach(model) if cap is not None else None
        with (cap.step(0) if cap is not None else _nothing()):
            result = ring.train_step(model, batch, rank, ranks.group())
        return result, found

    try:
        return ThreadRanks(w, device="cpu", timeout=60).run(rank_main), cap
    finally:
        if cap is not None:
            cap.close()


def test_te_dot_product_attention_under_cp_is_captured_by_attach(tmp_path):
    """DotProductAttention modules found by attach, named by their module path; CP size, rank and group read from
    set_context_parallel_group's attributes; O [t, h * dv] recorded as [t, h, dv]; no LSE (TE's API gives none)."""
    folder = tmp_path / "cap"
    plain, _ = _te_step(2, None, on_cp=True)
    results, cap = _te_step(2, folder, on_cp=True)
    assert [found for _, found in results] == [2, 2]
    for (a, _), (b, _) in zip(plain, results):
        assert torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    calls = {r["call"] for r in index(folder)}
    assert calls == {"step0.layers.0.core_attention", "step0.layers.1.core_attention"}
    report = capture.check(folder)
    assert report.exit_code == 0, report.text
    with open(folder / "joined" / "step0.layers.0.core_attention" / "join.json") as f:
        record = json.load(f)
    assert record["tensors"] == ["o", "dq", "dk", "dv"] and record["source"] == "te"
    assert record["case"]["cp_size"] == 2 and record["case"]["mask"] == "causal"


def test_te_packed_qkv_layer_is_captured(tmp_path):
    """TransformerEngine 2.20's declared packed input (qkv_layer [t, 3, h, d], as its MultiheadAttention passes it
    when there are as many KV heads as query heads): q, k, v are its parts, dQ, dK, dV the parts of its gradient."""
    torch.manual_seed(4)
    dpa = capture_fakes.DotProductAttention(2, 16)
    batch = ring.batch_of(1)
    packed = torch.randn(batch["total"], 3, 2, 16, requires_grad=True)

    def step(cap):
        packed.grad = None
        with (cap.step(0) if cap is not None else _nothing()):
            o = dpa(qkv_layer=packed, cu_seqlens_q=batch["cu"], cu_seqlens_kv=batch["cu"],
                    cu_seqlens_q_padded=batch["cu_padded"], cu_seqlens_kv_padded=batch["cu_padded"])
            (o * o).sum().backward()
        return o.detach(), packed.grad.clone()

    plain = step(None)
    cap = capture.Capture(tmp_path / "cap")
    assert cap.attach(dpa, name="attention") == 1
    captured = step(cap)
    cap.close()
    assert torch.equal(plain[0], captured[0]) and torch.equal(plain[1], captured[1])
    with h5py.File(tmp_path / "cap" / "calls" / "step0.attention" / "rank0.h5", "r") as f:
        assert np.array_equal(f["dk"][()], captured[1][:, 1].numpy())
        assert np.array_equal(f["q"][()], packed[:, 0].detach().numpy())
    report = capture.check(tmp_path / "cap")
    assert report.exit_code == 0, report.text


def test_unsupported_layout_is_recorded_and_the_step_goes_on(tmp_path):
    """A BSHD call (TE's qkv_format "bshd"): a CaptureWarning and an "unsupported" record naming the layout; the step's
    outputs and gradients are those without capture; the THD call beside it is captured and passes."""
    folder = tmp_path / "cap"
    plain, _ = _te_step(1, None, on_cp=False)
    with pytest.warns(capture.CaptureWarning, match="qkv_format 'bshd'"):
        results, cap = _te_step(1, folder, on_cp=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning turned into an error does not reach the step either
        strict, _ = _te_step(1, tmp_path / "strict", on_cp=False)
    assert torch.equal(strict[0][0][1], plain[0][0][1])
    (a, _), (b, _) = plain[0], results[0]
    assert torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    records = {r["call"]: r for r in index(folder)}
    bad = records["step0.layers.1.core_attention"]
    assert bad["status"] == "unsupported" and "BSHD and SBHD are not" in bad["reason"]
    assert records["step0.layers.0.core_attention"]["status"] == "captured"
    report = capture.check(folder)
    assert report.exit_code == 0, report.text
    assert "step 0  layers.1.core_attention  rank 0  NOT CAPTURED (unsupported)" in report.text
    # an FP8 tensor (TransformerEngine's Float8Tensor class, here a plain subclass of that name)
    class Float8Tensor(torch.Tensor):
        pass

    dpa = capture_fakes.DotProductAttention(2, 16)
    cap = capture.Capture(tmp_path / "fp8")
    cap.attach(dpa, name="fp8_attention")
    batch = ring.batch_of(1)
    x = torch.randn(batch["total"], 2, 16)
    fp8 = torch.Tensor._make_subclass(Float8Tensor, x)
    with pytest.warns(capture.CaptureWarning, match="FP8 attention is not captured"):
        out = dpa(fp8, x, x, cu_seqlens_q=batch["cu"], cu_seqlens_kv=batch["cu"],
                  cu_seqlens_q_padded=batch["cu_padded"], cu_seqlens_kv_padded=batch["cu_padded"])
    cap.close()
    assert torch.equal(out, dpa(x, x, x, cu_seqlens_q=batch["cu"], cu_seqlens_kv=batch["cu"],
                                cu_seqlens_q_padded=batch["cu_padded"], cu_seqlens_kv_padded=batch["cu_padded"]))
    assert [r["status"] for r in index(tmp_path / "fp8")] == ["unsupported"]
    # the user's own function given BSHD tensors
    cap = capture.Capture(tmp_path / "user")
    fn = cap.attention(ring.ring_attention, **SPEC)
    q = torch.randn(1, 8, 4, 16)
    with pytest.warns(capture.CaptureWarning, match=r"shape \(1, 8, 4, 16\)"):
        with pytest.raises(Exception) as raised:
            fn(q, q, q, torch.tensor([0, 8]), torch.tensor([0, 8]), torch.tensor([0, 8]), torch.tensor([0, 8]), None)
    with pytest.raises(type(raised.value)):   # the function's own error, as without the capture
        ring.ring_attention(q, q, q, torch.tensor([0, 8]), torch.tensor([0, 8]), torch.tensor([0, 8]),
                            torch.tensor([0, 8]), None)
    cap.close()
    assert index(tmp_path / "user")[0]["status"] == "unsupported"


def test_a_write_that_fails_is_recorded_and_the_step_goes_on(tmp_path, monkeypatch):
    """The disk is full: every call's write fails with ENOSPC; the step is unchanged, the index says why, and check
    finds nothing to check (exit 2)."""
    plain, _ = run_step(2, None, n_layers=2)
    original = h5py.File

    def full(name, mode="r", *args, **kwargs):
        if ".partial-" in str(name) and mode in ("x", "w", "w-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(name, mode, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", full)
    with pytest.warns(capture.CaptureWarning, match="No space left on device"):
        captured, cap = run_step(2, tmp_path / "cap", n_layers=2)
    monkeypatch.setattr(h5py, "File", original)
    for a, b in zip(plain, captured):
        assert torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    records = index(tmp_path / "cap")
    assert len(records) == 4 and all(r["status"] == "write_failed" for r in records)
    assert not any(n.endswith(".h5") or "partial" in n for _, _, files in os.walk(tmp_path / "cap") for n in files)
    report = capture.check(tmp_path / "cap")
    assert report.exit_code == 2 and "4 not captured" in report.text


def test_flash_attention_3_and_varlen_attn_functions(tmp_path, monkeypatch):
    """FlashAttention-3's flash_attn_varlen_func (seqused: padded offsets, pad rows unwritten, LSE asked for) and
    PyTorch's varlen_attn (packed odd lengths: re-laid for the case; a sequence without keys: LSE +inf there) called
    inside modules: named by the module path, checked with their conventions."""
    fa3 = capture_fakes.install_flash(monkeypatch)
    varlen = capture_fakes.install_varlen(monkeypatch)
    cap = capture.Capture(tmp_path / "cap")
    assert cap.patch_flash() == ["flash_attn_interface.flash_attn_varlen_func"]
    assert cap.patch_varlen() == ["torch.nn.attention.varlen.varlen_attn"]

    class Flash(torch.nn.Module):
        def forward(self, q, k, v):
            out, _ = fa3.flash_attn_varlen_func(q, k, v, torch.tensor([0, 8, 20], dtype=torch.int32),
                                                torch.tensor([0, 8, 20], dtype=torch.int32), 12, 12,
                                                seqused_q=torch.tensor([5, 9]), seqused_k=torch.tensor([5, 9]),
                                                causal=True, return_attn_probs=True)
            return out

    class Varlen(torch.nn.Module):
        def forward(self, q, k, v):
            out, _ = varlen.varlen_attn(q[:9], k[:10], v[:10], torch.tensor([0, 4, 9]), torch.tensor([0, 10, 10]),
                                        5, 10, return_aux=varlen.AuxRequest(lse=True), scale=0.3)
            return out

    model = torch.nn.ModuleDict({"flash": Flash(), "varlen": Varlen()})
    cap.attach(model)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    with cap.step(0):
        a = model["flash"](q, k, v)
        b = model["varlen"](q, k, v)
        ((a * a).sum() + (b * b).sum()).backward()
    cap.close()
    assert fa3.flash_attn_varlen_func is capture_fakes.flash_attn_varlen_func   # undone by close
    report = capture.check(tmp_path / "cap")
    assert report.exit_code == 0, report.text
    joined = tmp_path / "cap" / "joined"
    with open(joined / "step0.flash" / "join.json") as f:
        flash = json.load(f)
    assert flash["source"] == "fa3" and flash["pad_rows"] == "unwritten" and "lse" in flash["tensors"]
    assert flash["case"]["padded_q"] == [8, 12] and not flash["relayout"]
    with open(joined / "step0.varlen" / "join.json") as f:
        packed = json.load(f)
    assert packed["source"] == "varlen" and packed["empty_row_lse"] == "pos-inf" and packed["relayout"]
    assert packed["case"]["seqlens_q"] == [4, 5] and packed["case"]["seqlens_kv"] == [10, 0]
    assert packed["case"]["softmax_scale"] == 0.3


def test_selection_of_steps_layers_heads_and_a_size_cap(tmp_path):
    folder = tmp_path / "cap"
    run_step(2, folder, run_steps=(0, 1), steps=[1], layers=["layers.1", "layers.2"], heads=[1])
    records = index(folder)
    assert sorted({r["call"] for r in records}) == ["step1.layers.1", "step1.layers.2"]
    with h5py.File(folder / "calls" / "step1.layers.1" / "rank0.h5", "r") as f:
        meta = json.loads(f.attrs["meta_json"])
        assert (meta["heads_q"], meta["heads_kv"], meta["kv_heads"]) == (2, 1, [1])
        assert f["q"].shape[1] == 2 and f["dk"].shape[1] == 1
    assert capture.check(folder).exit_code == 0
    capped = tmp_path / "capped"
    with pytest.warns(capture.CaptureWarning, match="max_bytes 200000") as seen:
        run_step(2, capped, max_bytes=200000)
    assert seen[0].filename == __file__ or "capture_ring" in seen[0].filename   # the user's line
    statuses = [r["status"] for r in index(capped)]
    assert statuses.count("captured") == 2 and statuses.count("skipped") == 4
    assert all("max_bytes 200000" in r["reason"] for r in index(capped) if r["status"] == "skipped")


def test_bad_options_are_named():
    for kwargs, field in [({"layers": [""]}, "layers"), ({"steps": [-1]}, "steps"), ({"heads": 0}, "heads"),
                          ({"max_bytes": 0}, "max_bytes"), ({"progress": "sometimes"}, "progress")]:
        with pytest.raises(cpgold.InputError) as e:
            capture.Capture("/nonexistent/never-made", **kwargs)
        assert e.value.field == field
    assert not os.path.exists("/nonexistent/never-made")


def _rerun(bug):
    """The user's attention rerun on a fixture's shards, every rank, forward and backward (shrink's fn): the rerun
    that capture_shrink_command.py runs as a COMMAND."""
    return lambda fx: capture_shrink_command.rerun(fx, bug)


def test_shrink_a_captured_failure(tmp_path):
    """From the failing call of a W = 3 capture: fewer sequences, tokens and heads, the same diagnosis; the saved case
    and inputs give the same fixture through `cpgold gen --inputs` as through cpgold.generate."""
    folder = tmp_path / "cap"
    run_step(3, folder, bugs={1: "chunks_swapped@r1"}, n_layers=2)
    capture.join(folder)
    call_dir = folder / "joined" / "step0.layers.1"
    result = capture.shrink(call_dir, _rerun("chunks_swapped@r1"), max_runs=60)
    original, smallest = json.loads(result["original"]), json.loads(result["smallest"])
    assert result["kinds"] == ["chunk_order"] and result["steps"]
    assert smallest["cp_size"] == 2   # the bug is on rank 1: one rank would lose it
    assert sum(smallest["seqlens_q"]) < sum(original["seqlens_q"])
    assert smallest["heads_q"] * smallest["dim_qk"] <= original["heads_q"] * original["dim_qk"]
    assert "chunk_order" in [d["kind"] for d in result["report"]["diagnosis"]]
    assert sorted(os.listdir(call_dir / "shrunk")) == ["case.json", "inputs.h5", "shrink.json"]
    with open(result["case_path"]) as f:
        case = json.load(f)
    with h5py.File(result["inputs_path"], "r") as f:
        inputs = {n: f[n][()] for n in ("q", "k", "v", "dout")}
    fixture = cpgold.generate(case, inputs=inputs)
    again = cpgold.check_outputs(fixture, _rerun("chunks_swapped@r1")(fixture))
    assert not again.passed and again["diagnosis"][0]["kind"] == "chunk_order"
    binary = os.environ.get("CPGOLD_BIN")
    if binary and os.path.isfile(binary):
        out = tmp_path / "gen.h5"
        subprocess.run([binary, "gen", "--case", json.dumps(case), "--inputs", result["inputs_path"], "-o", str(out)],
                       check=True, capture_output=True)
        assert out.read_bytes() == fixture.source
    with pytest.raises(cpgold.InputError, match="no failure to shrink"):
        capture.shrink(call_dir, _rerun(None), out=tmp_path / "none")


def test_command_line_join_and_check(tmp_path):
    folder = tmp_path / "cap"
    run_step(2, folder, bugs={1: "chunks_swapped@r1"}, n_layers=2)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    join = subprocess.run([sys.executable, "-m", "cpgold.capture", "join", str(folder)], capture_output=True,
                          text=True, env=env)
    assert join.returncode == 0, join.stderr
    assert "step0.layers.1: joined 2 rank(s)" in join.stdout
    proc = subprocess.run([sys.executable, "-m", "cpgold.capture", "check", str(folder)], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == capture.check(folder).text
    assert "first failing call: step 0 layers.1" in proc.stdout and "chunk_order" in proc.stdout
    fine = tmp_path / "fine"
    run_step(2, fine, n_layers=1)
    proc = subprocess.run([sys.executable, "-m", "cpgold.capture", "check", str(fine), "--format", "json"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["exit_code"] == 0


def test_check_pad_rows_convention_for_every_call(tmp_path):
    """check(pad_rows=...) and `check --pad-rows` hold every call to one pad-row convention (TransformerEngine's
    FlashAttention path leaves pad rows unwritten, which a TE capture cannot tell): the failing layer still fails,
    the reproduce lines carry the option, and a bad value is refused naming pad_rows."""
    folder = tmp_path / "cap"
    run_step(2, folder, bugs={1: "chunks_swapped@r1"}, n_layers=2)
    report = capture.check(folder, pad_rows="unwritten")
    assert report.exit_code == 1
    failing = [c for c in report["calls"] if c["status"] == "fail"]
    assert [c["layer"] for c in failing] == ["layers.1"]
    assert all("--pad-rows unwritten" in c["reproduce"] for c in report["calls"])
    assert all("--pad-rows" not in c["reproduce"] for c in capture.check(folder)["calls"])
    with pytest.raises(cpgold.InputError, match="pad_rows"):
        capture.check(folder, pad_rows="sometimes")
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    proc = subprocess.run([sys.executable, "-m", "cpgold.capture", "check", str(folder), "--pad-rows", "unwritten"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and proc.stdout == report.text
