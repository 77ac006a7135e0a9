"""What the reproductions of this folder share: offsets, the float64 references, the library versions and the launcher
of rank processes. Torch and the libraries only, no cpgold; each script imports it from its own folder."""
import argparse
import json
import os
import socket
import subprocess
import sys
import time


def offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def cu_seqlens(torch, device, seqlens_q, seqlens_kv, padded_q, padded_kv):
    """TransformerEngine's THD offsets (int32 on `device`) of the sequences and of their padded slots."""
    i32 = dict(dtype=torch.int32, device=device)
    return {"cu_seqlens_q": torch.tensor(offsets(seqlens_q), **i32),
            "cu_seqlens_kv": torch.tensor(offsets(seqlens_kv), **i32),
            "cu_seqlens_q_padded": torch.tensor(offsets(padded_q), **i32),
            "cu_seqlens_kv_padded": torch.tensor(offsets(padded_kv), **i32)}


def padded_bf16_inputs(torch, seed, slots, lengths, heads_q, heads_kv, dim_qk, dim_v):
    """q, k, v, dout (rows of the padded slots, standard normal from a generator seeded with `seed`, zero in each
    slot's padding) in bf16, and the slot offsets."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(slots)
    x = {"q": torch.randn(rows, heads_q, dim_qk, generator=g), "k": torch.randn(rows, heads_kv, dim_qk, generator=g),
         "v": torch.randn(rows, heads_kv, dim_v, generator=g), "dout": torch.randn(rows, heads_q, dim_v, generator=g)}
    off = offsets(slots)
    for t in x.values():
        for b, n in enumerate(lengths):
            t[off[b] + n:off[b + 1]] = 0
    return {n: t.to(torch.bfloat16) for n, t in x.items()}, off


def gqa_reference(q, k, v, dout, scale, causal):
    """Masked attention of one sequence and its gradients in float64. q, dout: [n_q, hq, d]; k, v: [n, hkv, d]; query
    head h reads KV head h // (hq / hkv); causal (top-left) needs n_q = n."""
    import torch
    n, hkv, hq = k.shape[0], k.shape[1], q.shape[1]
    g = hq // hkv
    ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("hqk,khd->qhd", p, ve)
    dp = torch.einsum("qhd,khd->hqk", dout, ve)
    ds = p * (dp - (dout * o).sum(-1).transpose(0, 1).unsqueeze(-1))
    return {"o": o, "dq": torch.einsum("hqk,khd->qhd", ds, ke) * scale,
            "dk": (torch.einsum("hqk,qhd->khd", ds, q) * scale).reshape(n, hkv, g, -1).sum(2),
            "dv": torch.einsum("hqk,qhd->khd", p, dout).reshape(n, hkv, g, -1).sum(2)}


def reference(q, k, v, dout, scale, causal):
    """Attention of one sequence and its gradients in float64 (q, k, v, dout: [n, h, d]); causal: top-left."""
    return gqa_reference(q, k, v, dout, scale, causal)


def causal_reference(q, k, v, dout, scale):
    """Causal attention of one sequence and its gradients in float64; q, k, v, dout: [n, h, d]."""
    return gqa_reference(q, k, v, dout, scale, True)


def versions(torch, transformer_engine, te, torch_cudnn=True):
    """Versions as the libraries report them, and the cuDNN files this process mapped; torch_cudnn: with the cuDNN
    version torch reports."""
    try:
        te_cudnn = ".".join(str(p) for p in te.get_cudnn_version())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        te_cudnn = f"unknown ({type(e).__name__})"
    out = {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn_te": te_cudnn}
    if torch_cudnn:
        try:
            out["cudnn_torch"] = str(torch.backends.cudnn.version())
        except Exception as e:  # noqa: BLE001 - torch refuses when TE loaded another cuDNN than torch's own
            out["cudnn_torch"] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    with open("/proc/self/maps") as f:
        out["cudnn_files"] = sorted({ln.split()[-1] for ln in f if "libcudnn" in ln and "/" in ln})
    out.update(gpu=torch.cuda.get_device_name(), capability="sm%d%d" % torch.cuda.get_device_capability())
    return out


def te_ran():
    """TE's backend of its last call, as the non-CP reproductions print it."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa
    b = te_dpa._attention_backends
    return f"FusedAttention (sub-backend {int(b['fused_attention_backend'])})" if b.get("use_fused_attention") else b


def import_torch_te():
    """torch and transformer_engine, after a line of their versions; None after a `cannot run` line."""
    try:
        import torch
        import transformer_engine
    except ImportError as e:
        print(f"cannot run: {e}")
        return None
    print(f"transformer_engine {transformer_engine.__version__}, torch {torch.__version__}")
    return torch, transformer_engine


def import_te_one_gpu(deterministic):
    """torch, transformer_engine and transformer_engine.pytorch set for cuDNN FusedAttention alone (and
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 when deterministic) on a GPU; None after a `cannot run` line."""
    os.environ.update(FUSED_ONLY, NVTE_UNFUSED_ATTN="0")
    if deterministic:
        os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    try:
        import torch
        import transformer_engine
        import transformer_engine.pytorch as te
    except ImportError as e:
        print(f"cannot run: {e}")
        return None
    if not torch.cuda.is_available():
        print("cannot run: no GPU visible")
        return None
    return torch, transformer_engine, te


def te_one_gpu_start(doc, add_arguments=None):
    """The start of a one-GPU reproduction's main: its command line (--deterministic, then what add_arguments(parser)
    adds) parsed, and torch and TE imported for cuDNN FusedAttention alone (import_te_one_gpu). Returns (the
    arguments, (torch, transformer_engine, transformer_engine.pytorch), the backward's mode in words); where it cannot
    run, it ends the process with exit 2 after a `cannot run` line, as the parser does on a bad command line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--deterministic", action="store_true", help="NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (set at import)")
    if add_arguments is not None:
        add_arguments(ap)
    a = ap.parse_args()
    libs = import_te_one_gpu(a.deterministic)
    if libs is None:
        raise SystemExit(2)
    mode = "deterministic (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)" if a.deterministic else "default (non-deterministic)"
    return a, libs, mode


def te_one_gpu_end(libs, what, count):
    """The end of a one-GPU reproduction's main: the backend TE ran, the versions of `libs` (torch,
    transformer_engine, transformer_engine.pytorch) and `what: count`. Returns its exit: 1 when count is not 0."""
    print(f"TE ran: {te_ran()}")
    print("versions: " + json.dumps(versions(*libs)))
    print(f"{what}: {count}")
    return 1 if count else 0


FUSED_ONLY = {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1"}   # TE's backends: cuDNN FusedAttention alone


def cp_launcher_start(rank_worker, rank_main, backends=FUSED_ONLY):
    """The start of a CP reproduction's main, TE's attention backends set by `backends` (and NVTE_UNFUSED_ATTN=0).
    In a rank process (rank_worker set by run_ranks' --rank-worker) it runs rank_main() and returns (0, None): main
    ends with exit 0. In the launcher it returns (None, (torch, transformer_engine)) after a line of their versions,
    or (2, None) after a `cannot run` line."""
    os.environ.update(backends, NVTE_UNFUSED_ATTN="0")
    if rank_worker:
        rank_main()
        return 0, None
    libs = import_torch_te()
    return (2, None) if libs is None else (None, libs)


def rank_start():
    """In a rank process: (rank, world) from the launcher's environment, with the rank's GPU and NCCL's group set."""
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    return rank, world


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script, args, world, timeout, env_extra=None):
    """Runs `script --rank-worker ARGS` as `world` ranks on this host; returns (exit, stdout, stderr) per rank. Every
    rank is killed when the timeout (seconds, all ranks together) runs out."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), NCCL_NVLS_ENABLE="0", **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), "--rank-worker", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline, outs = time.time() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


def rank_results(outs):
    """The last `RESULT {json}` line of each rank; raises RuntimeError when a rank did not finish."""
    results = []
    for r, (code, out, err) in enumerate(outs):
        lines = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
        if code != 0 or not lines:
            tail = [ln for ln in err.strip().splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"rank {r} ended with exit {code}: " + " | ".join(tail)[-400:])
        results.append(json.loads(lines[-1]))
    return results
