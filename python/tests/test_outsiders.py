"""The outsider adapters' CPU-side logic with fakes (docs/outsiders.md): how a fixture becomes FlashAttention-3/4's
and TransformerEngine's arguments, the layout mapping of their outputs, refusals kept as refusals, and the whole
run -> candidate -> check path with a fake FlashAttention-3 that leaves pad rows unwritten. The real libraries run
on a GPU machine (lab/gpu/outsiders.sh)."""
import json
import sys
import types

import numpy as np
import pytest

import cpgold
from conftest import golden_path
from cpgold.outsiders import ADAPTERS, Refused, adapter, flash, harness, make, rank_adapter, runner, te
from cpgold.outsiders.environment import digest


class Case:
    """A fixture's case attributes, without a file."""

    def __init__(self, causal=False, window=(-1, -1), seqlens_q=(3, 5), seqlens_kv=None):
        self.causal, self.window = causal, window
        self._q, self._kv = list(seqlens_q), list(seqlens_kv or seqlens_q)
        self.heads_q, self.heads_kv, self.dim_qk, self.dim_v, self.softmax_scale = 4, 2, 64, 64, 0.125

    def seqlens(self, side):
        return np.asarray(self._q if side == "q" else self._kv, dtype=np.int32)


@pytest.mark.parametrize("causal,window,fa3,fa4", [
    (False, (-1, -1), (-1, -1), (None, None)),
    (True, (-1, 0), (-1, 0), (None, 0)),
    (True, (7, 0), (7, 0), (7, 0)),
    (False, (5, 3), (5, 3), (5, 3)),
    (False, (-1, 4), (-1, 4), (None, 4)),
    (False, (6, -1), (6, -1), (6, None)),
])
def test_window_arguments_of_fa3_and_fa4(causal, window, fa3, fa4):
    fx = Case(causal, window)
    assert flash.fa3_window(fx) == fa3
    assert flash.fa4_window(fx) == fa4


def test_seqused_arguments_are_padded_offsets_and_true_lengths():
    with cpgold.Fixture(golden_path("p2p_w2_window_tail_fp16")) as fx:
        a = flash.seqused_arguments(fx)
        assert np.array_equal(a["cu_seqlens_q"], fx.cu_seqlens("q", padded=True))
        assert np.array_equal(a["cu_seqlens_k"], fx.cu_seqlens("kv", padded=True))
        assert np.array_equal(a["seqused_q"], fx.seqlens("q"))
        assert np.array_equal(a["seqused_k"], fx.seqlens("kv"))
        assert not np.array_equal(a["cu_seqlens_q"], fx.cu_seqlens("q"))  # the fixture pads between sequences
        assert a["max_seqlen_q"] == int(np.diff(fx.cu_seqlens("q", padded=True)).max())
        assert a["causal"] == fx.causal and a["softmax_scale"] == pytest.approx(fx.softmax_scale)


class EmptyK:
    """A fixture's layout without a file: 16 queries on one sequence whose K range is empty (no rows at all)."""
    softmax_scale, causal = 0.125, False

    def cu_seqlens(self, side, padded=False):
        return np.asarray([0, 16] if side == "q" else [0, 0], dtype=np.int32)

    def seqlens(self, side):
        return np.asarray([16] if side == "q" else [0], dtype=np.int32)


def test_max_seqlen_k_is_the_true_one_and_zero_without_keys():
    a = flash.seqused_arguments(EmptyK())
    assert a["max_seqlen_k"] == 0 and a["max_seqlen_q"] == 16
    assert a["cu_seqlens_k"].tolist() == [0, 0] and a["seqused_k"].tolist() == [0]
    with cpgold.Fixture(golden_path("p2p_w2_window_tail_fp16")) as fx:
        assert flash.seqused_arguments(fx)["max_seqlen_k"] == int(np.diff(fx.cu_seqlens("kv", padded=True)).max())


def test_te_arguments_and_groups():
    assert te.mask_type(Case(causal=True)) == "padding_causal"
    assert te.mask_type(Case(causal=True, seqlens_kv=(4, 5))) == "padding_causal_bottom_right"
    assert te.mask_type(Case()) == "padding"
    assert te.window_size(Case(causal=True, window=(-1, 0))) is None
    assert te.window_size(Case(causal=True, window=(9, 0))) == (9, 0)
    assert te.window_size(Case(window=(2, 3))) == (2, 3)
    kw = te.te_arguments(Case(window=(2, 3)))
    assert kw["qkv_format"] == "thd" and kw["num_gqa_groups"] == 2 and kw["window_size"] == (2, 3)
    assert rank_adapter.cp_group_ranks("p2p", 4, 2) == [[0, 1, 2, 3]]
    assert rank_adapter.cp_group_ranks("a2a+p2p", 4, 3, a2a_size=2) == [[2, 3], [1, 3]]
    assert rank_adapter.cp_group_ranks("a2a+p2p", 8, 5, a2a_size=4) == [[4, 5, 6, 7], [1, 5]]
    with pytest.raises(Refused, match="a2a_size 3 does not divide cp_size 4"):
        rank_adapter.cp_group_ranks("a2a+p2p", 4, 0, a2a_size=3)


def raised_in(filename, exception):
    """`exception` raised by code whose file is `filename` (the innermost frame of its traceback)."""
    try:
        exec(compile("raise exception", filename, "exec"), {"exception": exception})
    except BaseException as e:  # noqa: B036 - the point is to catch it
        return e
    raise AssertionError("nothing raised")


def test_a_refusal_is_the_library_s_own_check_and_anything_else_an_error():
    lib = "/usr/lib/python3/site-packages"
    te_assert = raised_in(f"{lib}/transformer_engine/pytorch/attention/dot_product_attention/utils.py",
                          AssertionError("Context parallelism does not support sliding window"))
    fa_assert = raised_in(f"{lib}/flash_attn/cute/interface.py", AssertionError("GQA backward requires head_dim"))
    dsl_assert = raised_in(f"{lib}/nvidia_cutlass_dsl/dsl_packages/cutlass/base_dsl/ast_preprocessor.py",
                           AssertionError("Please start a session before accessing session data"))
    torch_value = raised_in(f"{lib}/torch/nn/functional.py", ValueError("shape mismatch"))
    assert adapter.refusal_source(te_assert) == "TE" and adapter.refusal_source(fa_assert) == "FlashAttention"
    assert adapter.refusal_source(dsl_assert) is None and adapter.refusal_source(torch_value) is None
    refusal = adapter.as_refusal(te_assert, "DotProductAttention(...): ")
    assert isinstance(refusal, Refused)
    assert str(refusal).startswith("DotProductAttention(...): TE refuses: AssertionError: Context parallelism")
    assert "FlashAttention refuses: AssertionError: GQA backward" in str(adapter.as_refusal(fa_assert))
    assert adapter.as_refusal(dsl_assert) is None and adapter.as_refusal(torch_value) is None


def test_run_dpa_keeps_errors_outside_the_libraries_as_errors(torch_cpu):
    """A DotProductAttention call that fails in the CuTe DSL's compiler (or torch) raises that error, not Refused;
    one that fails TE's own check raises Refused naming TE."""
    torch = torch_cpu

    def dpa_raising(exception, filename):
        def call(*args, **kwargs):
            raise raised_in(filename, exception)
        return call

    fx = types.SimpleNamespace(heads_q=1, dim_v=2)
    x = torch.zeros(2, 1, 2)
    m = types.SimpleNamespace()
    with pytest.raises(AssertionError, match="start a session"):
        te.run_dpa(m, dpa_raising(AssertionError("Please start a session"), "/x/cutlass/base_dsl/dsl.py"), fx, x, x, x,
                   x, {})
    with pytest.raises(Refused, match="TE refuses: ValueError: No dot product attention backend"):
        te.run_dpa(m, dpa_raising(ValueError("No dot product attention backend"),
                                  "/x/transformer_engine/pytorch/dpa.py"), fx, x, x, x, x, {})

    class BackwardRaising(torch.autograd.Function):   # a forward that works and a backward that raises
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, grad):
            raise raised_in(BackwardRaising.filename, BackwardRaising.exception)

    def dpa_backward_raising(q, k, v, **cu):
        return BackwardRaising.apply(q)

    BackwardRaising.filename = "/x/flash_attn/cute/interface.py"
    BackwardRaising.exception = AssertionError("GQA backward requires head_dim == head_dim_v")
    with pytest.raises(Refused, match="backward: FlashAttention refuses: AssertionError: GQA backward requires"):
        te.run_dpa(m, dpa_backward_raising, fx, x, x, x, x, {})
    BackwardRaising.filename = "/x/torch/autograd/graph.py"
    BackwardRaising.exception = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        te.run_dpa(m, dpa_backward_raising, fx, x, x, x, x, {})


def test_cute_compiles_from_thread_ranks_take_turns(monkeypatch):
    """Under thread ranks FlashAttention-4's CuTe DSL compiles one at a time (its preprocessor holds one session per
    process); without the DSL nothing is patched."""
    import importlib.machinery
    import threading
    import time

    state = {"inside": 0, "most": 0}

    class CompileCallable:   # the DSL's compile entry point, with the DSL's one-session-at-a-time state
        def _compile(self, func, *args, **kwargs):
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
            time.sleep(0.02)
            state["inside"] -= 1
            return func

    package = types.ModuleType("cutlass")
    package.__spec__ = importlib.machinery.ModuleSpec("cutlass", None, is_package=True)
    package.__path__ = []
    base = types.ModuleType("cutlass.base_dsl")
    compiler = types.ModuleType("cutlass.base_dsl.compiler")
    compiler.CompileCallable = CompileCallable
    for name, module in (("cutlass", package), ("cutlass.base_dsl", base), ("cutlass.base_dsl.compiler", compiler)):
        monkeypatch.setitem(sys.modules, name, module)

    def compile_from_threads():
        threads = [threading.Thread(target=lambda: CompileCallable()._compile("kernel")) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    compile_from_threads()
    assert state["most"] > 1, "the fake must show overlapping compiles before the patch"
    state["most"] = 0
    assert flash.serialize_cute_compiles() and flash.serialize_cute_compiles()   # a second call patches nothing more
    compile_from_threads()
    assert state["most"] == 1
    assert CompileCallable()._compile("kernel") == "kernel"
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert flash.serialize_cute_compiles() is False


def test_te_environment_selects_the_backend_and_modes():
    fused = te.te_environment("fused")
    assert fused["NVTE_FUSED_ATTN"] == "1" and fused["NVTE_FLASH_ATTN"] == "0" and fused["NCCL_NVLS_ENABLE"] == "0"
    flash_env = te.te_environment("flash", deterministic=True, thread_ranks=True)
    assert flash_env["NVTE_FLASH_ATTN"] == "1" and flash_env["NVTE_FUSED_ATTN"] == "0"
    assert flash_env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and flash_env["NVTE_TORCH_COMPILE"] == "0"
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in fused
    with pytest.raises(ValueError, match="backend: expected one of fused, flash"):
        te.te_environment("cudnn")


def test_unknown_adapter_and_option_are_named():
    with pytest.raises(ValueError, match="adapter: 'fa5' is not one of"):
        make("fa5")
    assert set(ADAPTERS) >= {"varlen", "fa3", "fa4", "cudnn", "te", "te_cp"}


def test_mask_class():
    assert harness.mask_class({"mask": "causal", "window": [-1, 0]}) == "causal"
    assert harness.mask_class({"mask": "causal", "window": [16, 0]}) == "causal+window"
    assert harness.mask_class({"mask": "none", "window": [-1, -1]}) == "none"
    assert harness.mask_class({"mask": "none", "window": [3, 2]}) == "window"


# ------------------------------------------------------------------ a fake FlashAttention-3 on the CPU
def fake_fa3_module(torch, calls, mode="honest"):
    """flash_attn_interface with one function: varlen attention over (padded offset, seqused) ranges in float32,
    pad rows of the output left as NaN (unwritten). mode "reads_pads": uses the padded lengths as the true ones
    (the bug seqused exists to prevent); "refuses": raises as the library does for an unsupported head dim."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                               deterministic=False, return_attn_probs=False, **rest):
        calls.append({"cu_seqlens_q": cu_seqlens_q.tolist(), "seqused_q": seqused_q.tolist(),
                      "window_size": window_size, "causal": causal, "deterministic": deterministic})
        if mode == "refuses":
            raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
        if mode == "reads_pads":
            seqused_q, seqused_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        hq, hk = q.shape[1], k.shape[1]
        out = torch.full(q.shape[:2] + v.shape[2:], float("nan"), dtype=torch.float32)
        lse = torch.full((hq, q.shape[0]), float("nan"), dtype=torch.float32)
        rows_out, rows_lse = [], []
        for b in range(len(seqused_q)):
            oq, ok = int(cu_seqlens_q[b]), int(cu_seqlens_k[b])
            lq, lk = int(seqused_q[b]), int(seqused_k[b])
            qb = q[oq:oq + lq].float()
            kb = k[ok:ok + lk].float().repeat_interleave(hq // hk, dim=1)
            vb = v[ok:ok + lk].float().repeat_interleave(hq // hk, dim=1)
            s = torch.einsum("ihd,jhd->hij", qb, kb) * softmax_scale
            i = torch.arange(lq)[:, None] + (lk - lq)   # bottom-right aligned
            j = torch.arange(lk)[None, :]
            left, right = window_size
            allowed = torch.ones(lq, lk, dtype=torch.bool)
            if causal or right >= 0:
                allowed &= j <= i + (0 if causal else right)
            if left >= 0:
                allowed &= j >= i - left
            s = s.masked_fill(~allowed, float("-inf"))
            m = torch.logsumexp(s, dim=-1)                                   # [h, lq]
            p = torch.exp(s - m[..., None]).nan_to_num(0.0)
            rows_out.append((oq, lq, torch.einsum("hij,jhd->ihd", p, vb)))
            rows_lse.append((oq, lq, m))
        for oq, lq, x in rows_out:
            out = torch.cat([out[:oq], x, out[oq + lq:]])
        for oq, lq, m in rows_lse:
            lse = torch.cat([lse[:, :oq], m.detach(), lse[:, oq + lq:]], dim=1)
        return out.to(q.dtype), lse

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.fixture
def torch_cpu():
    return pytest.importorskip("torch")


def run_fake(monkeypatch, torch, name, mode, tmp_path, cpgold_bin, deterministic=False):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3_module(torch, calls, mode))
    adapter = make("fa3", device="cpu", deterministic=deterministic)
    return runner.run_fixture(adapter, golden_path(name), "golden", str(tmp_path), cpgold_bin), calls


@pytest.mark.parametrize("name", ["p2p_w2_window_tail_fp16", "a2a_w2_full_gqa_fp16_nan_pads",
                                  "allgather_w2_window_bf16"])
def test_fake_fa3_passes_with_pads_unwritten(name, monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    entry, calls = run_fake(monkeypatch, torch_cpu, name, "honest", tmp_path, cpgold_bin, deterministic=True)
    assert entry["status"] == "pass", entry.get("failures")
    assert entry["pad_rows"] == "unwritten" and entry["unwritten_nonzero"] > 0    # NaN pad rows, left out
    assert calls[0]["deterministic"] is True
    with cpgold.Fixture(golden_path(name)) as fx:
        assert calls[0]["cu_seqlens_q"] == fx.cu_seqlens("q", padded=True).tolist()
        assert calls[0]["seqused_q"] == fx.seqlens("q").tolist()
        assert tuple(calls[0]["window_size"]) == flash.fa3_window(fx)
    assert json.dumps(entry, default=str)  # the summary line is JSON


def test_fake_fa3_reading_pad_rows_fails(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    entry, _ = run_fake(monkeypatch, torch_cpu, "p2p_w2_window_tail_fp16", "reads_pads", tmp_path, cpgold_bin)
    assert entry["status"] == "fail"
    assert any(f.split(":")[0] in ("o", "dq", "dk", "dv") for f in entry["failures"])


def test_a_refusal_is_recorded_with_the_librarys_message(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    entry, _ = run_fake(monkeypatch, torch_cpu, "p2p_w2_window_tail_fp16", "refuses", tmp_path, cpgold_bin)
    assert entry["status"] == "unsupported"
    assert "only supports head dimension at most 256" in entry["reason"]


def test_fp32_is_not_expressible_for_fa3(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    entry, calls = run_fake(monkeypatch, torch_cpu, "allgather_w3_full_mqa_fp32", "honest", tmp_path, cpgold_bin)
    assert entry["status"] == "unsupported" and "dtype fp32" in entry["reason"] and not calls


def test_a_contract_failure_on_pad_rows_only_reads_as_a_convention(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    """An implementation declared under the contract ("zero") whose only failure is pad rows: valid_rows_pass."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3_module(torch_cpu, []))
    adapter = make("fa3", device="cpu")
    adapter.pad_rows = "zero"
    entry = runner.run_fixture(adapter, golden_path("p2p_w2_window_tail_fp16"), "golden", str(tmp_path), cpgold_bin)
    assert entry["status"] == "fail" and entry["valid_rows_pass"] is True
    md = harness.markdown([entry], "t")
    assert "| golden | 0 | 1 (1) |" in md


def test_the_command_writes_summary_and_tables(monkeypatch, torch_cpu, tmp_path, cpgold_bin, capsys):
    from cpgold.outsiders.__main__ import main
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3_module(torch_cpu, []))
    monkeypatch.setattr(flash.FlashAttn3, "__init__", lambda self, deterministic=False, **o:
                        flash._FlashAdapter.__init__(self, deterministic, device="cpu"))
    code = main(["fa3", golden_path("p2p_w2_window_tail_fp16"), golden_path("allgather_w3_full_mqa_fp32"),
                 "--in-process", "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
                 "--table", str(tmp_path / "t.md")])
    assert code == 0
    summary = json.load(open(tmp_path / "s.json"))
    assert summary["counts"]["pass"] == 1 and summary["counts"]["unsupported"] == 1
    assert summary["pad_rows"] == "unwritten"
    assert "| golden | 1 | 0 (0) | 0 | 0 | 1 |" in open(tmp_path / "t.md").read()


def test_a_refusal_in_the_backward_is_a_refusal(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    """FlashAttention-4 refuses GQA with dim_qk != dim_v only in its backward (an assert): unsupported, not error."""
    module = fake_fa3_module(torch_cpu, [])
    honest = module.flash_attn_varlen_func

    class RefusingBackward(torch_cpu.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise AssertionError("GQA backward requires head_dim == head_dim_v")

    def forward_only(*args, **kwargs):
        out, lse = honest(*args, **kwargs)
        return RefusingBackward.apply(out), lse

    module.flash_attn_varlen_func = forward_only
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    entry = runner.run_fixture(make("fa3", device="cpu"), golden_path("p2p_w2_window_tail_fp16"), "golden",
                               str(tmp_path), cpgold_bin)
    assert entry["status"] == "unsupported"
    assert entry["reason"].startswith("backward: AssertionError: GQA backward requires head_dim == head_dim_v")


def test_write_candidate_for_one_fixture(monkeypatch, torch_cpu, tmp_path, cpgold_bin, capsys):
    from cpgold.outsiders.__main__ import main
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3_module(torch_cpu, []))
    monkeypatch.setattr(flash.FlashAttn3, "__init__", lambda self, deterministic=False, **o:
                        flash._FlashAdapter.__init__(self, deterministic, device="cpu"))
    name = golden_path("p2p_w2_window_tail_fp16")
    out = tmp_path / "c.h5"
    assert main(["fa3", name, "--write-candidate", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fa3: versions "))
    printed = json.loads(line[len("fa3: versions "):])   # in COMMAND's output, as `serve run` prints them
    assert set(COMMON) <= set(printed) and printed["cudnn"] == "not used" and "flash-attn-3 build" in printed
    report = cpgold.check(name, out, pad_rows="unwritten", cpgold=cpgold_bin)
    assert report["pass"]
    before = out.read_bytes()
    with pytest.raises(SystemExit):
        main(["fa3", name, "--write-candidate", str(out)])     # an existing file is never overwritten
    assert out.read_bytes() == before
    assert main(["fa3", golden_path("allgather_w3_full_mqa_fp32"), "--write-candidate", str(tmp_path / "d.h5")]) == 3
    assert not (tmp_path / "d.h5").exists()


def test_fixture_list_selects_by_name_and_prefix(tmp_path):
    for suite in ("a", "b"):
        (tmp_path / suite).mkdir()
        for i in range(3):
            (tmp_path / suite / f"f{i}.h5").write_bytes(b"")
    items = harness.fixture_list([str(tmp_path / "a"), str(tmp_path / "b")], first={"b": 1})
    assert [(s, p.split("/")[-1]) for s, p in items] == [("a", "f0.h5"), ("a", "f1.h5"), ("a", "f2.h5"), ("b", "f0.h5")]
    assert len(harness.fixture_list([str(tmp_path / "a")], only=["a/f1.h5", "f2.h5"])) == 2
    with pytest.raises(FileNotFoundError, match="neither a folder nor a file"):
        harness.fixture_list([str(tmp_path / "none")])


FAKE_CHILD = r'''
import json, os, sys, time
args = sys.argv[1:]
skip, results = int(args[args.index("--skip") + 1]), args[args.index("--results") + 1]
plan = os.environ["FAKE_PLAN"].split(",")   # per fixture: ok, waits (for the file FAKE_GO), dies
for i, what in enumerate(plan[skip:], skip):
    if what == "dies":
        print("a warning on stderr", file=sys.stderr, flush=True)
        os._exit(7)
    if what == "waits":
        while not os.path.exists(os.environ["FAKE_GO"]):
            time.sleep(0.05)
    with open(results, "a") as f:
        f.write(json.dumps({"fixture": f"f{i}", "suite": "s", "status": "pass"}) + "\n")
    print(f"verdict f{i}", flush=True)
'''


def _isolated_in_thread(tmp_path, monkeypatch, plan):
    import threading
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    monkeypatch.setenv("FAKE_PLAN", ",".join(plan))
    monkeypatch.setenv("FAKE_GO", str(tmp_path / "go"))
    results = tmp_path / "results.jsonl"
    results.write_text("")
    items = [("golden", golden_path("allgather_w3_full_mqa_fp32"))] * len(plan)
    t = threading.Thread(target=runner.isolated, args=([sys.executable, str(child)], items, str(results)))
    t.start()
    return t, results


def test_isolated_passes_each_verdict_on_while_the_child_goes_on(tmp_path, monkeypatch, capsys):
    # the child prints f0's verdict, then blocks on f1: the verdict must be out before the child ends
    import time
    t, results = _isolated_in_thread(tmp_path, monkeypatch, ["ok", "waits"])
    seen, deadline = "", time.monotonic() + 30
    while "verdict f0" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    running = t.is_alive()
    (tmp_path / "go").write_text("")
    t.join(30)
    assert "verdict f0" in seen, "f0's verdict was held back until the child ended"
    assert running and "verdict f1" not in seen
    assert "verdict f1" in capsys.readouterr().out
    assert len(runner.read_results(str(results))) == 2


def test_isolated_records_a_death_and_goes_on_after_it(tmp_path, monkeypatch, capsys):
    t, results = _isolated_in_thread(tmp_path, monkeypatch, ["ok", "dies", "ok"])
    t.join(60)
    entries = runner.read_results(str(results))
    assert [e["status"] for e in entries] == ["pass", "error", "pass"]
    assert "the process died (exit 7) running this fixture" in entries[1]["reason"]
    assert "a warning on stderr" in entries[1]["reason"]
    out = capsys.readouterr().out
    assert "verdict f0" in out and "verdict f2" in out and "exit 7" in out


DSL_ASSERT = ("ThreadRankError: rank 0 of 8 failed: CUDADialectError: \n\x1b[91m\x1b[1merror:\x1b[0m cudaErrorAssert "
              "(error code: 710) \n- \x1b[1mError name: cudaErrorAssert\n- Error code: 710\n")   # FA4's form, seen on the device


@pytest.mark.parametrize("reason,lost", [
    (DSL_ASSERT, True),
    ("AcceleratorError: CUDA error: device-side assert triggered", True),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", True),
    ("ValueError: No dot product attention backend is available", False),
])
def test_a_child_stops_after_a_fixture_that_lost_the_cuda_context(reason, lost, monkeypatch, tmp_path):
    # the next fixture in the same process would only repeat the sticky error, so the child exits with CONTEXT_LOST
    ran = []

    def fake_run_fixture(adapter, path, suite, workdir, cpgold_bin):
        ran.append(path)
        return {"fixture": path, "suite": suite, "status": "error", "reason": reason}

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(runner, "run_fixture", fake_run_fixture)
    monkeypatch.setattr(runner.os, "_exit", fake_exit)
    adapter = types.SimpleNamespace(name="fake")
    results = tmp_path / "r.jsonl"
    items = [("s", "f0.h5"), ("s", "f1.h5")]
    if lost:
        with pytest.raises(SystemExit) as stop:
            runner.worker(adapter, items, str(results), str(tmp_path), None, echo=False, child=True)
        assert stop.value.code == runner.CONTEXT_LOST and ran == ["f0.h5"]
    else:
        runner.worker(adapter, items, str(results), str(tmp_path), None, echo=False, child=True)
        assert ran == ["f0.h5", "f1.h5"]
    assert runner.context_lost(reason) == lost


def _main_with_fake_fa3(monkeypatch, torch, calls):
    from cpgold.outsiders.__main__ import main
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3_module(torch, calls))
    monkeypatch.setattr(flash.FlashAttn3, "__init__", lambda self, deterministic=False, **o:
                        flash._FlashAdapter.__init__(self, deterministic, device="cpu"))
    return main


TWO = ["p2p_w2_window_tail_fp16", "allgather_w2_window_bf16"]


def test_resume_runs_only_what_a_stopped_run_did_not_record(monkeypatch, torch_cpu, tmp_path, cpgold_bin, capsys):
    calls = []
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, calls)
    args = ["fa3", *map(golden_path, TWO), "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
            "--in-process"]    # the fake library is in this process only
    assert main(args) == 0 and len(calls) == 2
    results = tmp_path / "s.json.jsonl"
    first = results.read_text().splitlines()[0]
    results.write_text(first + "\n")                        # the run stopped after its first fixture
    calls.clear()
    assert main(args + ["--resume"]) == 0
    assert len(calls) == 1                                  # only the second fixture ran
    with cpgold.Fixture(golden_path(TWO[1])) as fx:
        assert calls[0]["cu_seqlens_q"] == fx.cu_seqlens("q", padded=True).tolist()
    summary = json.load(open(tmp_path / "s.json"))
    assert [e["fixture"] for e in summary["fixtures"]] == [n + ".h5" for n in TWO]
    assert summary["counts"]["pass"] == 2 and summary["resumed_with"] == 1
    assert "1 fixtures recorded, 1 to run" in capsys.readouterr().out
    calls.clear()
    assert main(args + ["--resume"]) == 0 and not calls     # everything recorded: nothing runs, same summary
    assert json.load(open(tmp_path / "s.json"))["counts"]["pass"] == 2


COMMON = ("python", "platform", "torch", "cuda", "cudnn_torch", "nccl", "device", "compute_capability", "driver",
          "libcudnn_mapped", "variables")


def test_the_run_file_records_the_versions_before_any_fixture_runs(monkeypatch, torch_cpu, tmp_path, cpgold_bin):
    seen = []
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, [])
    honest = sys.modules["flash_attn_interface"].flash_attn_varlen_func

    def reading_the_run_file(*args, **kwargs):   # what a run stopped from outside at this moment would leave
        seen.append(json.loads((tmp_path / "s.json.run.json").read_text()))
        return honest(*args, **kwargs)

    monkeypatch.setattr(sys.modules["flash_attn_interface"], "flash_attn_varlen_func", reading_the_run_file)
    args = ["fa3", *map(golden_path, TWO), "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
            "--in-process"]
    assert main(args) == 0 and len(seen) == 2
    run = seen[0]
    assert run["adapter"] == "fa3" and run["options"] == {"deterministic": False} and run["resumes"] == []
    v = run["versions"]
    assert set(COMMON) <= set(v) and v["cudnn"] == "not used" and v["library"].startswith("flash-attn-3 ")
    assert "flash-attn-3 build" in v and run["versions_digest"] == digest(v)
    lines = runner.read_results(str(tmp_path / "s.json.jsonl"))
    assert [e["versions_digest"] for e in lines] == [run["versions_digest"]] * 2
    assert not any("versions" in e for e in lines)     # the same versions as the run's: named, not repeated
    summary = json.load(open(tmp_path / "s.json"))
    assert summary["versions"] == v and summary["versions_digest"] == run["versions_digest"]
    assert [e["versions_digest"] for e in summary["fixtures"]] == [run["versions_digest"]] * 2


def test_resume_refuses_other_versions_unless_told(monkeypatch, torch_cpu, tmp_path, cpgold_bin, capsys):
    calls = []
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, calls)
    args = ["fa3", *map(golden_path, TWO), "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
            "--in-process"]    # the fake library is in this process only
    assert main(args) == 0
    results, run_file = tmp_path / "s.json.jsonl", tmp_path / "s.json.run.json"
    run = json.loads(run_file.read_text())
    run["versions"].update(torch="0.0.1", driver="1.0")                # the stopped run ran on other versions
    start_digest = run["versions_digest"] = digest(run["versions"])
    first = dict(json.loads(results.read_text().splitlines()[0]), versions_digest=start_digest)
    results.write_text(json.dumps(first) + "\n")                      # and stopped after its first fixture
    run_file.write_text(json.dumps(run))
    kept = results.read_text(), run_file.read_text()
    calls.clear()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and not calls
    assert "--resume: the versions are not those the stopped run started with" in err
    assert f'torch "{torch_cpu.__version__}" (recorded "0.0.1")' in err and '(recorded "1.0")' in err
    assert "nothing was run" in err and "--resume-any-versions" in err
    assert (results.read_text(), run_file.read_text()) == kept          # nothing overwritten
    without = dict(run)
    del without["versions"]                                             # a run file that records no versions
    run_file.write_text(json.dumps(without))
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume"])
    assert stop.value.code == 2 and "records no versions of the stopped run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume-any-versions"])
    assert stop.value.code == 2 and "--resume-any-versions: only with --resume" in capsys.readouterr().err
    run_file.write_text(json.dumps(run))
    assert main(args + ["--resume", "--resume-any-versions"]) == 0 and len(calls) == 1
    assert "going on with other versions than the stopped run's: " in capsys.readouterr().err
    after = json.loads(run_file.read_text())
    assert after["versions"]["torch"] == "0.0.1"                        # what the run started with stays
    (resumed,) = after["resumes"]
    assert resumed["resumed_with"] == 1 and resumed["versions"]["torch"] == torch_cpu.__version__
    assert any(d.startswith("torch ") for d in resumed["differences"]) and resumed["versions_digest"] != start_digest
    lines = runner.read_results(str(results))
    assert [e["versions_digest"] for e in lines] == [start_digest, resumed["versions_digest"]]
    summary = json.load(open(tmp_path / "s.json"))
    assert summary["versions"]["torch"] == "0.0.1" and summary["resumes"] == after["resumes"]
    assert summary["counts"]["pass"] == 2


def test_resume_refuses_the_results_of_another_run(monkeypatch, torch_cpu, tmp_path, cpgold_bin, capsys):
    calls = []
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, calls)
    args = ["fa3", golden_path(TWO[0]), "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
            "--in-process"]    # the fake library is in this process only
    assert main(args) == 0
    before = (tmp_path / "s.json.jsonl").read_text()
    calls.clear()
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume", "--deterministic"])
    assert stop.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert "--resume: options" in err and '"deterministic": true' in err and "nothing was run" in err
    assert (tmp_path / "s.json.jsonl").read_text() == before
    (tmp_path / "s.json.run.json").unlink()                 # results whose run cannot be told
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume"])
    assert stop.value.code == 2 and "does not say which run" in capsys.readouterr().err


def test_isolated_children_append_after_the_entries_of_a_stopped_run(tmp_path, monkeypatch, capsys):
    import threading
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    monkeypatch.setenv("FAKE_PLAN", "ok,ok")
    monkeypatch.setenv("FAKE_GO", str(tmp_path / "go"))
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"fixture": "earlier", "suite": "s", "status": "pass"}) + "\n")
    items = [("golden", golden_path(TWO[0]))] * 2
    t = threading.Thread(target=runner.isolated, args=([sys.executable, str(child)], items, str(results)))
    t.start()
    t.join(60)
    assert [e["fixture"] for e in runner.read_results(str(results))] == ["earlier", "f0", "f1"]


def test_resume_drops_an_unfinished_last_line_and_runs_its_fixture_again(monkeypatch, torch_cpu, tmp_path, cpgold_bin,
                                                                         capsys):
    calls = []
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, calls)
    args = ["fa3", *map(golden_path, TWO), "--cpgold", cpgold_bin, "--summary", str(tmp_path / "s.json"),
            "--in-process"]    # the fake library is in this process only
    assert main(args) == 0
    results = tmp_path / "s.json.jsonl"
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n" + lines[1][:40])     # killed while writing the second line
    calls.clear()
    assert main(args + ["--resume"]) == 0 and len(calls) == 1
    assert "ends in an unfinished line" in capsys.readouterr().err
    assert json.load(open(tmp_path / "s.json"))["counts"]["pass"] == 2
    with pytest.raises(SystemExit) as stop:                 # one candidate keeps no results to go on from
        main(["fa3", golden_path(TWO[0]), "--write-candidate", str(tmp_path / "c.h5"), "--resume"])
    assert stop.value.code == 2 and "not with --write-candidate" in capsys.readouterr().err
    assert not (tmp_path / "c.h5").exists()
    results.write_text("not json\n")                        # not this command's results: refused, left as it is
    with pytest.raises(SystemExit) as stop:
        main(args + ["--resume"])
    assert stop.value.code == 2 and "is not a results file of this command" in capsys.readouterr().err
    assert results.read_text() == "not json\n"


# ------------------------------------------------------------------ a library that crashes the process
FAKE_CRASHING_FA3 = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
from test_outsiders import fake_fa3_module

_honest = fake_fa3_module(torch, []).flash_attn_varlen_func


def flash_attn_varlen_func(q, k, v, *args, **kwargs):
    if str(list(q.shape)) + " " + str(q.dtype) == os.environ["FAKE_SEGV_Q"]:   # this fixture's Q: die as a kernel would
        os.kill(os.getpid(), signal.SIGSEGV)
    return _honest(q, k, v, *args, **kwargs)
"""
CRASH_SUITE = ["a2a_w2_full_gqa_fp16_nan_pads", "allgather_w2_window_bf16", "p2p_w2_window_tail_fp16"]


def _crashing_fa3_run(tmp_path, cpgold_bin, *extra):
    """`python3 -m cpgold.outsiders fa3 SUITE/` in a child process with a fake flash_attn_interface that dies by
    SIGSEGV on the middle fixture of three: (completed process, summary path)."""
    import os
    import shutil
    import subprocess
    suite = tmp_path / "suite"
    suite.mkdir()
    rows = {}
    for name in CRASH_SUITE:
        shutil.copy(golden_path(name), suite / f"{name}.h5")
        with cpgold.Fixture(golden_path(name)) as fx:
            dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[fx.dtype]
            rows[name] = f"{[fx.total_rows('q'), fx.heads_q, fx.dim_qk]} {dtype}"
    assert len(set(rows.values())) == len(rows)       # Q's shape and dtype tell the crashing fixture apart
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "flash_attn_interface.py").write_text(FAKE_CRASHING_FA3.format(tests=os.path.dirname(__file__)))
    package = os.path.dirname(os.path.dirname(cpgold.__file__))
    env = dict(os.environ, FAKE_SEGV_Q=rows[CRASH_SUITE[1]],
               PYTHONPATH=os.pathsep.join([str(fake), package] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    summary = tmp_path / "fa3.json"
    proc = subprocess.run([sys.executable, "-m", "cpgold.outsiders", "fa3", str(suite), "--set", "device=cpu",
                           "--cpgold", cpgold_bin, "--summary", str(summary), *extra],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return proc, summary


def test_a_crash_of_fa3_loses_only_its_fixture_by_default(tmp_path, cpgold_bin):
    proc, summary = _crashing_fa3_run(tmp_path, cpgold_bin)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]     # an error, reported: not a crash
    entries = {e["fixture"]: e for e in json.load(open(summary))["fixtures"]}
    assert sorted(entries) == [n + ".h5" for n in CRASH_SUITE]
    crashed = entries[CRASH_SUITE[1] + ".h5"]
    assert crashed["status"] == "error" and "killed by signal SIGSEGV (11)" in crashed["reason"], crashed
    assert "flash_attn_varlen_func" in crashed["reason"]         # the child's Python stack, from faulthandler
    assert [entries[n + ".h5"]["status"] for n in (CRASH_SUITE[0], CRASH_SUITE[2])] == ["pass", "pass"]
    assert json.load(open(summary))["counts"] == {"pass": 2, "fail": 0, "empty": 0, "error": 1, "unsupported": 0}
    assert "killed by signal SIGSEGV" in proc.stdout and '"error": 1' in proc.stdout
    # the children computed their own versions: the same as the parent recorded, so each line names them only
    tag = json.load(open(summary))["versions_digest"]
    assert tag and all(e["versions_digest"] == tag and "versions" not in e for e in entries.values())


def test_in_process_is_the_opt_out_and_a_crash_then_ends_the_run(tmp_path, cpgold_bin):
    import signal
    proc, summary = _crashing_fa3_run(tmp_path, cpgold_bin, "--in-process")
    assert proc.returncode == -signal.SIGSEGV and not summary.exists()
    # the run died on its second fixture: what it ran on was recorded at its start, and its first result names it
    run = json.loads((tmp_path / "fa3.json.run.json").read_text())
    v = run["versions"]
    assert set(COMMON) <= set(v) and v["cudnn"] == "not used" and v["module"].endswith("flash_attn_interface.py")
    assert v["torch"] != "not installed" and run["adapter"] == "fa3"
    (first,) = runner.read_results(str(tmp_path / "fa3.json.jsonl"))
    assert first["fixture"] == CRASH_SUITE[0] + ".h5" and first["versions_digest"] == run["versions_digest"]


def test_flash_adapters_isolate_by_default_and_the_flags_exclude_each_other(monkeypatch, torch_cpu, capsys):
    assert flash.FlashAttn3.isolate and flash.FlashAttn4.isolate and flash.VarlenAttn.isolate
    main = _main_with_fake_fa3(monkeypatch, torch_cpu, [])
    with pytest.raises(SystemExit) as stop:
        main(["fa3", golden_path(TWO[0]), "--isolate", "--in-process"])
    assert stop.value.code == 2 and "--isolate and --in-process: give one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fa3", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the default for fa3, fa4, te_cp, varlen" in text and "--in-process" in text
