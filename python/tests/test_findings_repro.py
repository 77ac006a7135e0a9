"""The standalone reproductions of docs/findings/repro/ on the CPU, without a GPU or the libraries: their float64
references against autograd, their exit codes (0 not reproduced, 1 reproduced, 2 cannot run) against fake libraries
that have or lack each defect, and TE-2's prediction of the ring steps without a row's keys."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="the reproductions need torch (not installed here)")

REPRO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "findings", "repro")


def script(name):
    return os.path.normpath(os.path.join(REPRO, name))


def load(name):
    spec = importlib.util.spec_from_file_location(name[:-3], script(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name, *args, path=None, env=None):
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(p for p in (path, e.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, script(name), *args], capture_output=True, text=True, env=e, timeout=300)


def autograd_attention(q, k, v, dout, scale, ok):
    """Masked softmax attention through autograd (float64); rows without a visible key have O = 0."""
    g = q.shape[1] // k.shape[1]
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    s = s.masked_fill(~ok, -1e300)
    p = torch.softmax(s, -1) * ok.any(-1, keepdim=True)
    o = torch.einsum("hqk,khd->qhd", p, ve)
    o.backward(dout)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def random_qkv(n_q, n_k, hq, hkv, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_q, hq, d, generator=g, dtype=torch.float64),
            torch.randn(n_k, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(n_k, hkv, dv, generator=g, dtype=torch.float64),
            torch.randn(n_q, hq, dv, generator=g, dtype=torch.float64))


# ------------------------------------------------------------------ the references
@pytest.mark.parametrize("n_q,n_k,hq,hkv,causal,window", [
    (5, 5, 4, 2, True, None), (3, 7, 4, 1, True, None), (6, 6, 2, 2, False, (0, 3)), (5, 5, 1, 1, False, (2, 0)),
    (4, 6, 4, 4, False, None), (3, 1, 2, 1, True, None)])
def test_te1_reference_matches_autograd_with_masks_windows_gqa_and_keyless_rows(n_q, n_k, hq, hkv, causal, window):
    m = load("te1_cp_wrong_pairs.py")
    q, k, v, do = random_qkv(n_q, n_k, hq, hkv, 8, 6)
    ok = m.visible(n_q, n_k, causal, window)
    got, want = m.reference(q, k, v, do, 0.3, ok), autograd_attention(q, k, v, do, 0.3, ok)
    for t in want:
        assert torch.allclose(got[t], want[t], atol=1e-12), t


@pytest.mark.parametrize("name", ["te5_d256_backward.py", "fa2_fa3_dies_instead_of_raising.py"])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_references_match_autograd(name, causal):
    m = load(name)
    q, k, v, do = random_qkv(6, 6, 4, 2, 8, 8)
    ok = torch.ones(6, 6, dtype=torch.bool).tril() if causal else torch.ones(6, 6, dtype=torch.bool)
    got, want = m.reference(q, k, v, do, 0.4, causal), autograd_attention(q, k, v, do, 0.4, ok)
    for t in want:
        assert torch.allclose(got[t], want[t], atol=1e-12), t


@pytest.mark.parametrize("name", ["te4_p2p_tail_rows_assert.py", "fa3_causal_window_minus_one.py"])
def test_causal_references_match_autograd(name):
    m = load(name)
    q, k, v, do = random_qkv(5, 5, 2, 2, 8, 8)
    got = m.reference(q, k, v, do, 0.4)
    want = autograd_attention(q, k, v, do, 0.4, torch.ones(5, 5, dtype=torch.bool).tril())
    for t in want:
        assert torch.allclose(got[t], want[t], atol=1e-12), t


def test_fa1_reference_and_te3_dkdv_match_autograd():
    q, k, v, do = random_qkv(4, 4, 2, 2, 8, 8)
    for causal in (False, True):
        ok = torch.ones(4, 4, dtype=torch.bool).tril() if causal else torch.ones(4, 4, dtype=torch.bool)
        got, want = load("fa1_nonfinite_pad_rows.py").reference(q, k, v, do, 0.5, causal), \
            autograd_attention(q, k, v, do, 0.5, ok)
        for t in want:
            assert torch.allclose(got[t], want[t], atol=1e-12), t
    q, k, v, do = random_qkv(4, 6, 4, 1, 8, 8)
    dk, dv = load("te3_gqa_query_less_dkdv.py").reference_dkdv(q, k, v, do, 0.5)
    want = autograd_attention(q, k, v, do, 0.5, torch.ones(4, 6, dtype=torch.bool))
    assert torch.allclose(dk, want["dk"], atol=1e-12) and torch.allclose(dv, want["dv"], atol=1e-12)
    dk0, dv0 = load("te3_gqa_query_less_dkdv.py").reference_dkdv(q[:0], k, v, do[:0], 0.5)
    assert not dk0.any() and not dv0.any()


def test_te2_predicts_the_steps_without_a_rows_keys():
    m = load("te2_p2p_keyless_step.py")
    assert m.dual_chunk_rows([4], 2, 0) == [0, 3] and m.dual_chunk_rows([4, 4], 2, 1) == [1, 2, 5, 6]
    one = m.expected_and_predicted(m.CASES["one_token"], m.make_inputs(m.CASES["one_token"]), 2)
    assert [(row, n) for row, (_, _, _, n) in one.items()] == [(0, 1)]   # rank 0's second step: pad rows only
    case = m.CASES["keyless_step"]
    x = m.make_inputs(case)
    pred = m.expected_and_predicted(case, x, 2)
    # sequence 0 has its one key on rank 0: every row of it meets one step without it; sequence 1 none
    assert {row: n for row, (b, _, _, n) in pred.items()} == {0: 1, 1: 1, 2: 1, 3: 1, 4: 0, 5: 0, 6: 0, 7: 0}
    for row, (b, e, p, n) in pred.items():
        _, lse = m.reference(x["q"][row:row + 1].double(), x["k"][4 * b:4 * b + case["seqlens_kv"][b]].double(),
                             x["v"][4 * b:4 * b + case["seqlens_kv"][b]].double(), case["dims"][0] ** -0.5)
        factor = lse[0].exp() / (lse[0].exp() + n)
        assert torch.allclose(p, e * factor.unsqueeze(-1), atol=1e-12)


# ------------------------------------------------------------------ exit codes against fake libraries
FAKE_ATTENTION = '''
import os
import torch


def _attention(q, k, v, cu, used, causal, window, leaky):
    """Per sequence of a padded varlen batch: FlashAttention's masking; leaky multiplies whole slots (pad rows too)
    as a kernel that loads whole tiles does, clean reads valid rows only."""
    outs = []
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        n = int(used[b]) if used is not None else e - s
        rows = e - s if leaky else n
        qs, ks, vs = q[s:s + rows], k[s:s + rows], v[s:s + rows]
        sc = torch.einsum("qhd,khd->hqk", qs, ks).float() * qs.shape[-1] ** -0.5
        i = torch.arange(rows).view(-1, 1)
        j = torch.arange(rows).view(1, -1)
        ok = (j < n) & (i < n)
        left, right = window
        if causal:
            right = 0
        if left is not None:
            ok = ok & (j >= i - left)
        if right is not None:
            ok = ok & (j <= i + right)
        sc = sc.masked_fill(~ok, float("-inf"))
        p = torch.where(ok, torch.softmax(sc.masked_fill(~ok.any(-1, keepdim=True), 0.0), -1),
                        torch.zeros_like(sc))
        o = torch.einsum("hqk,khd->qhd", p.to(vs.dtype), vs)
        pad = torch.zeros(e - s - o.shape[0], *o.shape[1:], dtype=o.dtype)
        outs.append(torch.cat([o, pad]))
    return torch.cat(outs)
'''

FAKE_FA4 = FAKE_ATTENTION + '''

def _resolve(causal, left, right):
    """The window resolution of flash_attn/cute/interface.py: FAKE_FA4_RULE=sum as 4.0.0b28 and b29 (a pair summing
    below zero is unbounded, after causal set the right side to 0), both as 4.0.0b30 and later (only two negative
    sides are unbounded, before causal sets the right side)."""
    if os.environ["FAKE_FA4_RULE"] == "sum":
        if causal:
            right = 0
        if left is not None and right is not None and left + right < 0:
            left = right = None
    else:
        if left is not None and right is not None and left < 0 and right < 0:
            left = right = None
        if causal:
            right = 0
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, (None, None)
        return False, (left, right)
    return causal, (None, None)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), deterministic=False, return_lse=False):
    if os.environ.get("FAKE_FA4_BASELINE") == "broken":
        return torch.zeros_like(q[..., :v.shape[-1]])
    causal, window = _resolve(causal, *window_size)
    return _attention(q, k, v, cu_seqlens_q, seqused_q, causal, window, os.environ.get("FAKE_LEAKY") == "1")
'''

FAKE_FA3 = FAKE_ATTENTION + '''
import signal


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, causal=False, deterministic=False, window_size=(-1, -1)):
    unsupported = (q.shape[-1] == 128 and v.shape[-1] == 64) or (q.shape[-1] == 256 and deterministic)
    if unsupported and os.environ.get("FAKE_FA3") == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if unsupported and os.environ.get("FAKE_FA3") == "raise":
        raise RuntimeError("this head dim combination is not supported")
    if unsupported and os.environ.get("FAKE_FA3") == "garbage":
        return (q[..., :1] * 0 + k.sum() * 0 + v.sum() * 0 + 7).expand(*q.shape[:-1], v.shape[-1])
    g = q.shape[1] // k.shape[1]
    return _attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), cu_seqlens_q, seqused_q, causal,
                      (None, None), os.environ.get("FAKE_LEAKY") == "1")
'''

TE_HELPER_2_20_2 = '''
import torch


def get_thd_padding_mask(num_tokens, cu_seqlens, cu_seqlens_padded):
    rows = torch.arange(num_tokens, device=cu_seqlens_padded.device)
    sequence = torch.searchsorted(cu_seqlens_padded[1:], rows, right=True)
    valid_end = cu_seqlens_padded[sequence] + cu_seqlens[sequence + 1] - cu_seqlens[sequence]
    return rows >= valid_end
'''

TE_HELPER_FIXED = '''
import torch


def get_thd_padding_mask(num_tokens, cu_seqlens, cu_seqlens_padded):
    rows = torch.arange(num_tokens, device=cu_seqlens_padded.device)
    b = cu_seqlens.numel() - 1
    sequence = torch.searchsorted(cu_seqlens_padded[1:], rows, right=True).clamp(max=b - 1)
    valid_end = cu_seqlens_padded[sequence] + cu_seqlens[sequence + 1] - cu_seqlens[sequence]
    return (rows >= valid_end) | (rows >= cu_seqlens_padded[-1])
'''


def write_package(root, files, dist=None):
    """Writes {relative path: text} under root, and a dist-info for (distribution name, version)."""
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
    if dist:
        name, version = dist
        info = os.path.join(root, f"{name.replace('-', '_')}-{version}.dist-info")
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(root)


@pytest.fixture
def fake_fa4(tmp_path):
    return write_package(tmp_path / "fa4", {"flash_attn/cute/__init__.py": FAKE_FA4}, ("flash-attn-4", "4.0.0b99"))


@pytest.mark.parametrize("rule,expected", [("sum", 0), ("both", 1)])
def test_fa3_direct_route_tells_the_window_rules_apart(fake_fa4, rule, expected):
    r = run("fa3_causal_window_minus_one.py", "--route", "direct", "--device", "cpu", path=fake_fa4,
            env={"FAKE_FA4_RULE": rule})
    assert r.returncode == expected, r.stdout + r.stderr
    assert '"flash-attn-4": "4.0.0b99"' in r.stdout
    if expected:
        assert "window_size=(-1, 0)" in r.stdout and "<-- wrong" in r.stdout and "rows all zero" in r.stdout


def test_fa3_direct_route_cannot_judge_a_broken_baseline(fake_fa4):
    r = run("fa3_causal_window_minus_one.py", "--device", "cpu", path=fake_fa4,
            env={"FAKE_FA4_RULE": "sum", "FAKE_FA4_BASELINE": "broken"})
    assert r.returncode == 2 and "baseline" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("leaky,expected", [("1", 1), ("0", 0)])
def test_fa1_judges_pad_row_values_on_valid_outputs(fake_fa4, leaky, expected):
    r = run("fa1_nonfinite_pad_rows.py", "--impl", "fa4", "--device", "cpu", path=fake_fa4,
            env={"FAKE_FA4_RULE": "both", "FAKE_LEAKY": leaky})
    assert r.returncode == expected, r.stdout + r.stderr
    if leaky == "1":   # the pattern of the records: v -> O, dQ, dK; q -> dK, dV; k -> dQ; dout -> dK, dV; 1e4 none
        line = {ln.split(":")[0].strip(): ln for ln in r.stdout.splitlines() if "pad rows of" in ln}
        assert "o (" in line["pad rows of v    = nan"] and "dq (" in line["pad rows of k    = nan"]
        assert "dk (" in line["pad rows of q    = +inf"] and "dv (" in line["pad rows of dout = nan"]
        assert "as expected" in line["pad rows of v    = 1e4"]
    else:
        fills = [ln for ln in r.stdout.splitlines() if ln.startswith("  pad rows of ")]
        assert len(fills) == 12 and all("as expected" in ln for ln in fills), r.stdout


@pytest.mark.parametrize("mode,expected,words", [("segv", 1, "signal 11 (SIGSEGV) in the forward"),
                                                 ("raise", 0, "raised in the forward"), ("garbage", 1, "<-- wrong"),
                                                 ("fine", 0, "ended")])
def test_fa2_exit_code_follows_how_the_library_refuses(tmp_path, mode, expected, words):
    path = write_package(tmp_path / "fa3", {"flash_attn_interface.py": FAKE_FA3}, ("flash-attn-3", "3.0.0"))
    r = run("fa2_fa3_dies_instead_of_raising.py", "--device", "cpu", "--config", "dims_128_64", "--config",
            "d128_det_gqa", path=path, env={"FAKE_FA3": mode})
    assert r.returncode == expected, r.stdout + r.stderr
    line = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  ")}
    assert sorted(line) == ["d128_det_gqa", "dims_128_64"]
    assert words in line["dims_128_64"] and "ended" in line["d128_det_gqa"]


@pytest.mark.parametrize("helper,expected,words", [(TE_HELPER_2_20_2, 1, "IndexError"),
                                                   (TE_HELPER_FIXED, 0, "[False, True, True, True]")],
                         ids=["as_in_2.20.2", "sequence_clamped"])
def test_te4_helper_reproduces_the_out_of_bounds_index(tmp_path, helper, expected, words):
    path = write_package(tmp_path / "te", {
        "transformer_engine/__init__.py": "__version__ = '2.20.2-fake'\n",
        "transformer_engine/pytorch/__init__.py": "",
        "transformer_engine/pytorch/attention/__init__.py": "",
        "transformer_engine/pytorch/attention/dot_product_attention/__init__.py": "",
        "transformer_engine/pytorch/attention/dot_product_attention/utils.py": helper})
    r = run("te4_p2p_tail_rows_assert.py", "--helper", path=path)
    assert r.returncode == expected, r.stdout + r.stderr
    assert words in r.stdout


@pytest.mark.parametrize("name,args", [
    ("te1_cp_wrong_pairs.py", []), ("te2_p2p_keyless_step.py", []), ("te2_p2p_keyless_step.py", ["--stats"]),
    ("te3_gqa_query_less_dkdv.py", []), ("te4_p2p_tail_rows_assert.py", ["--helper"]), ("te5_d256_backward.py", []),
    ("fa1_nonfinite_pad_rows.py", ["--impl", "fa3"]), ("fa2_fa3_dies_instead_of_raising.py", []),
    ("fa3_causal_window_minus_one.py", []), ("fa3_causal_window_minus_one.py", ["--route", "te"])])
def test_a_missing_library_is_exit_2_naming_it(tmp_path, name, args):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run(name, *args, env={"PYTHONPATH": str(empty)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.startswith("cannot run: ") or "\ncannot run: " in r.stdout, r.stdout


def test_fa1_refuses_inconsistent_lengths_with_exit_2():
    r = run("fa1_nonfinite_pad_rows.py", "--impl", "fa4", "--lengths", "3", "--padded", "2")
    assert r.returncode == 2 and "--lengths [3] and --padded [2]" in r.stderr
