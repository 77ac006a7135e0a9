"""cpgold.thread_ranks: torch.distributed with W ranks as threads. The collectives are checked with coded values
(every element names its source rank and position), the routing leaves other groups to torch, failures name the
rank and the call, and a ring attention written against torch.distributed passes `cpgold check` per rank."""
import _thread
import os
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the thread-rank group needs it")
dist = torch.distributed
from cpgold.thread_ranks import RankGroup, ThreadRankError, ThreadRanks  # noqa: E402

import cpgold  # noqa: E402
from conftest import golden_path  # noqa: E402

W_SIZES = (2, 3, 4)


def coded(rank, rows, cols=3):
    """[rows, cols] float64 whose element (i, j) is rank * 1e6 + i * 1e3 + j: its origin reads off the value."""
    i = torch.arange(rows, dtype=torch.float64)[:, None]
    j = torch.arange(cols, dtype=torch.float64)[None, :]
    return rank * 1e6 + i * 1e3 + j


@pytest.mark.parametrize("w", W_SIZES)
def test_collectives_move_every_element_to_its_place(w):
    def rank_main(rank, ranks):
        g = ranks.group()
        assert isinstance(g, dist.ProcessGroup) and dist.is_initialized()
        assert dist.get_rank(g) == rank and dist.get_world_size(group=g) == w
        out = {}
        gathered = torch.empty(2 * w, 3, dtype=torch.float64)
        dist.all_gather_into_tensor(gathered, coded(rank, 2), group=g)
        out["all_gather"] = gathered
        a2a = torch.empty(2 * w, 3, dtype=torch.float64)
        dist.all_to_all_single(a2a, coded(rank, 2 * w), group=g)
        out["a2a"] = a2a
        rs = torch.empty(2, 3, dtype=torch.float64)
        dist.reduce_scatter_tensor(rs, coded(rank, 2 * w), group=g)
        out["reduce_scatter"] = rs
        ar = coded(rank, 2)
        work = dist.all_reduce(ar, op=dist.ReduceOp.MAX, group=g, async_op=True)
        work.wait()
        out["all_reduce_max"] = ar
        # a ring exchange the way TransformerEngine's p2p path posts it: even ranks send first, odd ranks receive first
        send, recv = coded(rank, 4), torch.empty(4, 3, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % w, g), dist.P2POp(dist.irecv, recv, (rank - 1) % w, g)]
        for req in dist.batch_isend_irecv(ops if rank % 2 == 0 else ops[::-1]):
            req.wait()
        out["ring"] = recv
        # plain isend/irecv, two messages to the same peer: they match in posting order
        r1, r2 = torch.empty(1, 3, dtype=torch.float64), torch.empty(1, 3, dtype=torch.float64)
        reqs = [dist.isend(coded(rank, 1) + 0.5, (rank + 1) % w, g), dist.isend(coded(rank, 1) + 0.25, (rank + 1) % w, g),
                dist.irecv(r1, (rank - 1) % w, g), dist.irecv(r2, (rank - 1) % w, g)]
        for req in reqs:
            req.wait()
        out["ordered"] = (r1, r2)
        return out

    results = ThreadRanks(w, device="cpu", timeout=30).run(rank_main)
    for rank, out in enumerate(results):
        assert torch.equal(out["all_gather"], torch.cat([coded(r, 2) for r in range(w)]))
        assert torch.equal(out["a2a"], torch.cat([coded(r, 2 * w)[2 * rank:2 * rank + 2] for r in range(w)]))
        assert torch.equal(out["reduce_scatter"], sum(coded(r, 2 * w)[2 * rank:2 * rank + 2] for r in range(w)))
        assert torch.equal(out["all_reduce_max"], coded(w - 1, 2))
        assert torch.equal(out["ring"], coded((rank - 1) % w, 4))
        assert torch.equal(out["ordered"][0], coded((rank - 1) % w, 1) + 0.5)
        assert torch.equal(out["ordered"][1], coded((rank - 1) % w, 1) + 0.25)


def test_subgroups_map_global_ranks_like_te_a2a_p2p():
    """Four ranks split as TransformerEngine's a2a+p2p tests do: a2a groups {0,1}, {2,3}; p2p groups {0,2}, {1,3}.
    Peers are global ranks; each group's traffic stays inside it."""
    def rank_main(rank, ranks):
        a2a = ranks.new_group([0, 1] if rank < 2 else [2, 3])
        p2p = ranks.new_group([0, 2] if rank % 2 == 0 else [1, 3])
        assert dist.get_rank(a2a) == rank % 2 and dist.get_rank(p2p) == rank // 2
        assert isinstance(a2a, RankGroup) and a2a.global_ranks() == ([0, 1] if rank < 2 else [2, 3])
        peer = p2p.global_ranks()[1 - dist.get_rank(p2p)]
        recv = torch.empty(2, 3, dtype=torch.float64)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, coded(rank, 2), peer, p2p),
                                           dist.P2POp(dist.irecv, recv, peer, p2p)]):
            req.wait()
        g = torch.empty(4, 3, dtype=torch.float64)
        dist.all_gather_into_tensor(g, coded(rank, 2), group=a2a)
        return recv, g

    results = ThreadRanks(4, device="cpu", timeout=30).run(rank_main)
    for rank, (recv, g) in enumerate(results):
        assert torch.equal(recv, coded(rank ^ 2, 2))
        base = rank - rank % 2
        assert torch.equal(g, torch.cat([coded(base, 2), coded(base + 1, 2)]))


def test_unmatched_send_times_out_naming_rank_and_peer():
    def rank_main(rank, ranks):
        g = ranks.group()
        if rank == 0:
            dist.isend(coded(0, 1), 1, g).wait()

    with pytest.raises(ThreadRankError, match=r"rank 0 .*send to rank 1.*no matching call within 0.5 s"):
        ThreadRanks(2, device="cpu", timeout=0.5).run(rank_main)


def test_exception_on_one_rank_stops_the_others_at_once():
    def rank_main(rank, ranks):
        g = ranks.group()
        if rank == 1:
            raise ValueError("planted failure")
        dist.irecv(torch.empty(1), 1, g).wait()

    with pytest.raises(ThreadRankError, match="rank 1 of 2 failed: ValueError: planted failure"):
        ThreadRanks(2, device="cpu", timeout=60).run(rank_main)


def test_mismatched_collectives_and_shapes_are_errors():
    def different_calls(rank, ranks):
        g = ranks.group()
        t = torch.zeros(2)
        if rank == 0:
            dist.all_reduce(t, group=g)
        else:
            dist.broadcast(t, 0, group=g)

    with pytest.raises(ThreadRankError, match=r"different ranks"):
        ThreadRanks(2, device="cpu", timeout=10).run(different_calls)

    def bad_sizes(rank, ranks):
        g = ranks.group()
        dist.all_to_all_single(torch.empty(3), torch.zeros(3), group=g)

    with pytest.raises(ThreadRankError, match=r"do not split evenly"):
        ThreadRanks(2, device="cpu", timeout=10).run(bad_sizes)


def test_the_default_group_inside_a_rank_is_the_thread_world_and_torch_is_restored_after():
    original = dist.get_world_size

    def rank_main(rank, ranks):
        assert dist.get_world_size() == 2 and dist.get_rank() == rank
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t)          # no group: code written for init_process_group
        return t

    assert [t.item() for t in ThreadRanks(2, device="cpu", timeout=10).run(rank_main)] == [3.0, 3.0]
    assert dist.get_world_size is original and not dist.is_initialized()


def test_blocking_send_recv_route_with_and_without_a_group():
    """A simple ring with blocking dist.send / dist.recv (even ranks send first): before, torch answered "Group ... is
    not registered" or "Default process group has not been initialized"."""
    def rank_main(rank, ranks):
        w = dist.get_world_size()
        got = torch.empty(2, 3, dtype=torch.float64)
        group = ranks.group() if rank % 2 else None
        if rank % 2 == 0:
            dist.send(coded(rank, 2), (rank + 1) % w)
            src = dist.recv(got, (rank - 1) % w)
        else:
            src = dist.recv(got, (rank - 1) % w, group)
            dist.send(coded(rank, 2), (rank + 1) % w, group=group)
        return src, got

    for rank, (src, got) in enumerate(ThreadRanks(4, device="cpu", timeout=30).run(rank_main)):
        assert src == (rank - 1) % 4
        assert torch.equal(got, coded((rank - 1) % 4, 2))


def test_collectives_not_offered_are_refused_naming_the_call():
    def rank_main(rank, ranks):
        dist.gather(torch.zeros(1), None, 0, group=ranks.group())

    with pytest.raises(ThreadRankError, match=r"torch.distributed.gather is not offered by thread ranks"):
        ThreadRanks(2, device="cpu", timeout=10).run(rank_main)


def test_default_device_is_the_cpu_without_cuda():
    ranks = ThreadRanks(2)
    assert ranks.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            ThreadRanks(2, device="cuda")


# ---------------------------------------------------------------- a user's CP code checked with cpgold
def positions(fx, rank, side):
    """Per rank-local row: (sequence, position in sequence, valid)."""
    rows = fx.partitioned_indices(rank, side)
    cu_p = fx.cu_seqlens(side, padded=True)
    lens = fx.seqlens(side)
    seq = np.searchsorted(cu_p, rows, side="right") - 1
    inside = seq < len(lens)
    seq = np.where(inside, seq, -1)
    pos = np.where(inside, rows - cu_p[np.clip(seq, 0, len(lens) - 1)], -1)
    valid = inside & (pos < np.where(inside, lens[np.clip(seq, 0, len(lens) - 1)], 0))
    return torch.as_tensor(seq), torch.as_tensor(pos), torch.as_tensor(valid)


def ring_attention_forward(rank, ranks, fx):
    """A p2p (ring) CP forward in float64 written against torch.distributed: every rank keeps its Q shard and
    passes K/V shards around the ring, merging partial results by LSE. Masks from global positions."""
    g = ranks.group()
    w = dist.get_world_size(g)
    x = fx.rank_inputs(rank, "torch")
    qs, qp, qv = positions(fx, rank, "q")
    q = torch.where(qv[:, None, None], x["q"].double(), torch.zeros((), dtype=torch.float64))
    kv = [torch.where(positions(fx, rank, "kv")[2][:, None, None], x[n].double(), torch.zeros((), dtype=torch.float64))
          for n in ("k", "v")]
    kv_meta = positions(fx, rank, "kv")
    hq, hkv = fx.heads_q, fx.heads_kv
    left, right = fx.window
    if fx.causal:
        right = 0
    m = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    acc = torch.zeros(q.shape[0], hq, fx.dim_v, dtype=torch.float64)
    den = torch.zeros(hq, q.shape[0], dtype=torch.float64)
    for step in range(w):
        k, v = kv
        ks, kp, kvalid = kv_meta
        lens_q, lens_kv = torch.as_tensor(fx.seqlens("q")), torch.as_tensor(fx.seqlens("kv"))
        same = (qs[:, None] == ks[None, :]) & qv[:, None] & kvalid[None, :]
        delta = lens_kv[ks.clamp(min=0)][None, :] - lens_q[qs.clamp(min=0)][:, None]
        i, j = qp[:, None], kp[None, :]
        vis = same.clone()
        if left >= 0:
            vis &= j >= i + delta - left
        if right >= 0:
            vis &= j <= i + delta + right
        if step + 1 < w:
            nxt = [torch.empty_like(t) for t in (k, v)] + [torch.empty_like(t) for t in kv_meta]
            sends = [k, v, *kv_meta]
            ops = []
            for s, r in zip(sends, nxt):
                ops += [dist.P2POp(dist.isend, s.contiguous(), (rank + 1) % w, g),
                        dist.P2POp(dist.irecv, r, (rank - 1) % w, g)]
            reqs = dist.batch_isend_irecv(ops)
        for h in range(hq):
            kh = h // (hq // hkv)
            s = fx.softmax_scale * (q[:, h] @ k[:, kh].T)
            s = torch.where(vis, s, torch.tensor(float("-inf"), dtype=torch.float64))
            new_m = torch.maximum(m[h], s.max(dim=1).values)
            safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
            p = torch.exp(s - safe[:, None])
            scale_old = torch.where(torch.isinf(m[h]), torch.zeros_like(safe), torch.exp(m[h] - safe))
            acc[:, h] = acc[:, h] * scale_old[:, None] + p @ v[:, kh]
            den[h] = den[h] * scale_old + p.sum(dim=1)
            m[h] = new_m
        if step + 1 < w:
            for req in reqs:
                req.wait()
            kv = nxt[:2]
            kv_meta = tuple(nxt[2:])
    seen = den > 0
    o = torch.where(seen.T[:, :, None], acc / torch.where(seen, den, torch.ones_like(den)).T[:, :, None],
                    torch.zeros_like(acc))
    lse = torch.where(seen, m + torch.log(torch.where(seen, den, torch.ones_like(den))),
                      torch.tensor(float("-inf"), dtype=torch.float64))
    return {"o": o.float().numpy(), "lse": lse.float().numpy()}


@pytest.mark.parametrize("name", ["p2p_w2_causal_gqa_bf16", "p2p_w3_window_two_sided_fp32_inf_pads",
                                  "a2ap2p_w4_window_gqa_bf16"])
def test_ring_attention_on_thread_ranks_passes_per_rank(name, tmp_path, cpgold_bin):
    with cpgold.Fixture(golden_path(name)) as fx:
        outs = ThreadRanks(fx.cp_size, device="cpu", timeout=60).run(lambda r, ranks: ring_attention_forward(r, ranks, fx))
        cpgold.write_ranks(tmp_path / "ring.h5", outs, fixture=fx, lse_layout="ht")
    report = cpgold.check(golden_path(name), tmp_path / "ring.h5", tensors=("o", "lse"), cpgold=cpgold_bin)
    assert report["pass"], cpgold.failures(report)
    assert {r["rank"] for r in report["results"]} == set(range(fx.cp_size))


def test_ring_attention_with_one_rank_rows_reversed_fails(tmp_path, cpgold_bin):
    """The same run with rank 1's output rows written in reverse order (a reorder bug): caught on rank 1 alone."""
    name = "p2p_w3_window_two_sided_fp32_inf_pads"
    with cpgold.Fixture(golden_path(name)) as fx:
        def wrong(rank, ranks):
            out = ring_attention_forward(rank, ranks, fx)
            out["o"] = out["o"][::-1].copy() if rank == 1 else out["o"]
            return out
        outs = ThreadRanks(fx.cp_size, device="cpu", timeout=60).run(wrong)
        cpgold.write_ranks(tmp_path / "ring.h5", outs, fixture=fx, lse_layout="ht")
    report = cpgold.check(golden_path(name), tmp_path / "ring.h5", tensors=("o", "lse"), cpgold=cpgold_bin)
    assert not report["pass"]
    assert {(r["tensor"], r["rank"]) for r in report["results"] if not r["pass"]} == {("o", 1)}


# ---------------------------------------------------------------- a rank busy outside any thread-rank call
def rank_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("cpgold-rank-") and t.is_alive()]


@pytest.fixture
def stop_busy():
    """Ends busy_loop at teardown, so that a rank nobody stopped cannot outlive the test by more than its bound."""
    stop = threading.Event()
    yield stop
    stop.set()


def busy_loop(stop, bound=20.0):
    """Pure Python, short sleeps, no thread-rank call: a rank computing (or stuck) outside torch.distributed."""
    t0 = time.monotonic()
    while not stop.is_set() and time.monotonic() - t0 < bound:
        time.sleep(0.02)


def test_a_rank_busy_outside_any_call_is_named_after_the_timeout_and_stopped(stop_busy):
    def fn(q, k, v, ctx):
        if ctx.rank == 1:
            busy_loop(stop_busy)
        dist.all_reduce(torch.zeros(1), group=ctx.group)
        return q[:, :, :1] * 0, torch.zeros(q.shape[1], q.shape[0])

    t0 = time.monotonic()
    with pytest.raises(ThreadRankError) as raised:
        cpgold.run_cp(fn, golden_path("p2p_w2_causal_gqa_bf16"), backward=False, device="cpu", timeout=0.5)
    elapsed = time.monotonic() - t0
    text = str(raised.value)
    assert elapsed < 5, f"run_cp took {elapsed:.1f} s with timeout 0.5 s"
    assert "rank 0" in text and "all_reduce" in text and "rank 1 never arrived" in text, text
    assert "busy_loop" in text and "no thread-rank call" in text, text   # what rank 1 was doing
    assert not rank_threads(), "a rank thread outlived run_cp"


def test_timeout_none_waits_without_bound_and_bad_timeouts_are_refused():
    def rank_main(rank, ranks):
        if rank == 1:
            time.sleep(0.3)
        dist.barrier(group=ranks.group())
        return rank

    assert ThreadRanks(2, device="cpu", timeout=None).run(rank_main) == [0, 1]
    for bad in (-1, 0, float("nan"), float("inf"), "5", True):
        with pytest.raises(cpgold.InputError, match=r"timeout: expected None or a positive finite number of seconds"):
            ThreadRanks(2, device="cpu", timeout=bad)


def test_a_rank_that_returned_waits_for_a_busy_rank_at_most_the_timeout(stop_busy):
    def rank_main(rank, ranks):
        if rank == 1:
            busy_loop(stop_busy)
        return rank

    t0 = time.monotonic()
    with pytest.raises(ThreadRankError, match=r"rank 1 .*no thread-rank call.*busy_loop"):
        ThreadRanks(2, device="cpu", timeout=0.5).run(rank_main)
    assert time.monotonic() - t0 < 5
    assert not rank_threads()


def test_keyboard_interrupt_while_waiting_leaves_no_rank_thread(stop_busy):
    def rank_main(rank, ranks):
        if rank == 1:
            busy_loop(stop_busy)
        dist.barrier(group=ranks.group())

    timer = threading.Timer(0.3, _thread.interrupt_main)
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ThreadRanks(2, device="cpu", timeout=5).run(rank_main)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 3, "the interrupt waited for the ranks"
    assert not rank_threads(), "a rank thread outlived the KeyboardInterrupt"


def test_an_exception_on_one_rank_stops_a_busy_rank_within_the_timeout(stop_busy):
    def rank_main(rank, ranks):
        if rank == 1:
            raise ValueError("planted failure")
        busy_loop(stop_busy)          # never reaches a thread-rank call

    t0 = time.monotonic()
    with pytest.raises(ThreadRankError, match="rank 1 of 2 failed: ValueError: planted failure"):
        ThreadRanks(2, device="cpu", timeout=0.5).run(rank_main)
    assert time.monotonic() - t0 < 5
    assert not rank_threads()


def test_the_lowest_rank_whose_code_raises_is_reported_whichever_raised_first():
    def rank_main(rank, ranks):
        time.sleep(0.2 if rank == 0 else 0.0)     # rank 1 raises first
        raise ValueError(f"planted on rank {rank}")

    with pytest.raises(ThreadRankError, match="rank 0 of 2 failed: ValueError: planted on rank 0"):
        ThreadRanks(2, device="cpu", timeout=10).run(rank_main)


def test_a_rank_stuck_in_c_code_is_named_not_waited_for(monkeypatch):
    """time.sleep(3) is one C call: no exception reaches the thread before it returns. The run raises after the
    timeout and STOP_GRACE, naming the thread still running and where, instead of waiting for it."""
    import cpgold.thread_ranks as tr
    monkeypatch.setattr(tr, "STOP_GRACE", 0.3)

    def rank_main(rank, ranks):
        if rank == 1:
            time.sleep(3)
        dist.barrier(group=ranks.group())

    world = ThreadRanks(2, device="cpu", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(ThreadRankError, match=r"rank 1 never arrived.*rank threads still running 0.3 s after the run "
                                              r"stopped .*cpgold-rank-1 at rank_main \(test_thread_ranks.py:\d+\)"):
        world.run(rank_main)
    assert time.monotonic() - t0 < 2.5
    assert world.left_running == ["cpgold-rank-1"]
    for t in threading.enumerate():          # let the sleeping thread end before the next test counts threads
        if t.name == "cpgold-rank-1":
            t.join(5)
    assert not rank_threads()
