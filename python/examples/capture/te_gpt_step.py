"""A small GPT of TransformerEngine TransformerLayers, one training step on a packed THD batch (padding between the
sequences and tail rows), every attention call captured by cpgold.capture, then the capture checked.

One GPU (W = 1):
    python3 python/examples/capture/te_gpt_step.py --out /tmp/te_capture
Context parallelism over NCCL, two GPUs (W = 2, TransformerEngine's dual-chunk THD split, p2p ring):
    torchrun --nproc-per-node 2 python/examples/capture/te_gpt_step.py --out /tmp/te_capture_cp2
Context parallelism on W thread ranks of one GPU (cpgold.thread_ranks; W = 4 here):
    python3 python/examples/capture/te_gpt_step.py --thread-ranks 4 --out /tmp/te_capture_t4
Backend: TransformerEngine's own variables, read when it is imported (NVTE_FUSED_ATTN=1 NVTE_FLASH_ATTN=0 for cuDNN's
fused attention, NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=1 for FlashAttention), or --backend fused|flash which sets them;
NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 makes TE print the backend it chose. --poison-pads puts NaN on the pad and tail rows of
q, k and v as every DotProductAttention receives them (a forward pre-hook; the gradient of the replaced rows is 0, so
the step's parameters stay finite): a correct attention never reads them.

The two lines that capture (docs/capture.md):
    cap = cpgold.capture.Capture(args.out)
    cap.attach(model)
and `with cap.step(i):` around the step. Rank 0 then runs the check (python3 -m cpgold.capture check FOLDER does the
same from a shell) and the script exits with its code: 0 every call passes, 1 a call fails, 2 nothing usable.
"""
import argparse
import os
import sys

BACKENDS = {"fused": {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
            "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}}


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the capture folder (new or empty)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                   help="set TransformerEngine's backend variables (default: as the environment has them)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--gqa-groups", type=int, default=2, help="KV heads (num_gqa_groups)")
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seqlens", default="100,37,250,9", help="tokens of each packed sequence")
    p.add_argument("--extra-pad", type=int, default=1,
                   help="extra padding after every other sequence, in units of 2 * W rows")
    p.add_argument("--tail", type=int, default=2, help="tail rows after the last sequence, in units of W rows")
    p.add_argument("--mask", default="padding_causal", choices=("padding", "padding_causal"))
    p.add_argument("--window", default=None, help="sliding window LEFT,RIGHT (e.g. 64,0)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--cp-comm", default="p2p", choices=("p2p", "a2a", "all_gather"),
                   help="TransformerEngine's cp_comm_type (tail rows need p2p: give --tail 0 otherwise)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--capture-steps", default=None,
                   help="steps to capture, e.g. 1 (default: every step); the step times printed show the overhead")
    p.add_argument("--poison-pads", action="store_true", help="NaN on the pad rows of q, k, v")
    p.add_argument("--no-check", action="store_true", help="capture only")
    p.add_argument("--thread-ranks", type=int, default=1,
                   help="W > 1: CP over W thread ranks of cpgold.thread_ranks on one GPU (not under torchrun)")
    return p.parse_args()


def main():
    args = arguments()
    if args.backend:
        os.environ.update(BACKENDS[args.backend])
    if args.thread_ranks > 1:
        # TE's torch.compile'd helpers run eagerly under thread ranks (dynamo refuses traces from several threads).
        os.environ.setdefault("NVTE_TORCH_COMPILE", "0")
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    import cpgold.capture

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.thread_ranks > 1:
        sys.exit("te_gpt_step: --thread-ranks runs W ranks in one process: not under torchrun")
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    window = tuple(int(x) for x in args.window.split(",")) if args.window else None
    w = max(world, args.thread_ranks)

    # The packed batch, the same on every rank: sequences padded to a multiple of 2W (TransformerEngine's CP split),
    # every other one with extra padding, then tail rows.
    seqlens = [int(x) for x in args.seqlens.split(",")]
    padded = [-(-n // (2 * w)) * 2 * w + (args.extra_pad * 2 * w if b % 2 == 0 else 0) for b, n in enumerate(seqlens)]
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    cu_padded = torch.tensor([0] + list(torch.tensor(padded).cumsum(0).tolist()), dtype=torch.int32, device=device)
    total = int(cu_padded[-1]) + args.tail * w
    g = torch.Generator(device="cpu").manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (total,), generator=g).to(device)
    valid = torch.zeros(total, dtype=torch.bool, device=device)
    labels = torch.full((total,), -100, dtype=torch.long, device=device)
    for b, n in enumerate(seqlens):
        start = int(cu_padded[b])
        valid[start:start + n] = True
        labels[start:start + n - 1] = tokens[start + 1:start + n]

    torch.manual_seed(0)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(args.vocab, args.hidden, device=device, dtype=dtype)
            self.layers = torch.nn.ModuleList(
                te.TransformerLayer(args.hidden, args.ffn, args.heads, num_gqa_groups=args.gqa_groups,
                                    hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type=args.mask,
                                    window_size=window, attn_input_format="thd", params_dtype=dtype,
                                    layer_number=i + 1, device="cuda")
                for i in range(args.layers))
            self.norm = torch.nn.LayerNorm(args.hidden, device=device, dtype=dtype)
            self.head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)

        def forward(self, tokens):
            h = self.embed(tokens)
            for layer in self.layers:
                h = layer(h, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                          cu_seqlens_kv_padded=cu_padded)
            return self.head(self.norm(h))

    base = GPT()   # every rank starts from the same weights (thread ranks: copies of one model)
    steps = [int(x) for x in args.capture_steps.split(",")] if args.capture_steps else None
    cap = cpgold.capture.Capture(args.out, steps=steps)   # the two lines a training script adds (cap.attach below)

    def rank_step(rank, model, cp_group):
        rows = tex.thd_get_partitioned_indices(cu_padded, total, w, rank) if w > 1 else torch.arange(total, device=device)
        tokens_local, valid_local, labels_local = tokens[rows], valid[rows], labels[rows]
        if w > 1:
            for layer in model.layers:
                layer.set_context_parallel_group(cp_group, list(range(w)), torch.cuda.Stream(), args.cp_comm)
        if args.poison_pads:
            def poison(module, call_args, call_kwargs):
                nan = torch.tensor(float("nan"), dtype=dtype, device=device)
                keep = valid_local[:, None, None]
                q, k, v = (torch.where(keep, x, nan) for x in call_args[:3])
                return (q, k, v) + tuple(call_args[3:]), call_kwargs
            for name, m in model.named_modules():
                if type(m).__name__ == "DotProductAttention":
                    m.register_forward_pre_hook(poison, with_kwargs=True)
        found = cap.attach(model)
        if rank == 0:
            print(f"te_gpt_step: W = {w} ({'thread ranks' if args.thread_ranks > 1 else 'processes'}), {found} "
                  f"DotProductAttention module(s) attached; NVTE_FUSED_ATTN={os.environ.get('NVTE_FUSED_ATTN')}, "
                  f"NVTE_FLASH_ATTN={os.environ.get('NVTE_FLASH_ATTN')}", flush=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        import time
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with cap.step(step):
                logits = model(tokens_local)
                keep = labels_local >= 0
                loss = torch.nn.functional.cross_entropy(logits[keep].float(), labels_local[keep], reduction="sum")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if rank == 0:
                captured = steps is None or step in steps
                print(f"te_gpt_step: step {step}: loss (rank 0) {loss.item():.4f}, {seconds:.3f} s "
                      f"({'captured' if captured else 'not captured'})", flush=True)
        torch.cuda.synchronize()

    if args.thread_ranks > 1:
        import copy

        from cpgold.thread_ranks import ThreadRanks

        from cpgold.outsiders.te import serialize_cute_compiles

        serialize_cute_compiles()   # FlashAttention-4 compiles with one CuTe DSL session per process: one at a time
        replicas = [copy.deepcopy(base) for _ in range(w)]
        ThreadRanks(w, device="cuda", timeout=300).run(lambda r, ranks: rank_step(r, replicas[r], ranks.group()))
        rank = 0
    elif world > 1:
        rank = dist.get_rank()
        rank_step(rank, base, dist.new_group(list(range(world)), backend="nccl"))
    else:
        rank = 0
        rank_step(0, base, None)
    cap.close()
    code = 0
    if world > 1:
        dist.barrier()
    if rank == 0 and not args.no_check:
        report = cpgold.capture.check(args.out)
        print(report.text, end="", flush=True)
        code = report.exit_code
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
