"""The per-rank interface of the multi-process CP harness (cpgold.outsiders.ranks, docs/outsiders-nccl.md).

A CP implementation that runs one process per rank (torchrun, NCCL on GPUs or gloo on CPUs) implements
`run_rank(fixture, rank, groups) -> RankResult` (or a plain dict of outputs): it runs forward and backward of its
rank on the fixture's shard of that rank (`fixture.rank_inputs(rank, "torch", groups.device)`) and returns its outputs
in the rank-local layout (o [Lq,hq,dv], lse [hq,Lq], dq [Lq,hq,dqk], dk [Lkv,hkv,dqk], dv [Lkv,hkv,dv]; numpy or torch,
some of them, as `tensors` says). The harness creates the CP groups (every process creates every group in the same
order: `dist.new_group` is collective), writes the rank's candidate file, and rank 0 checks every rank and the
gathered outputs.

Adapters (name: module, class, what):
  te_cp            TransformerEngine's DotProductAttention CP (te.TeContextParallelProcess; needs NCCL and GPUs)
  torch_allgather  a plain torch all-gather CP, the harness's own reference (torch_cp.TorchAllGather; CPU or GPU)
"""
import importlib
from dataclasses import dataclass, field

from .adapter import Adapter, Refused


@dataclass
class GroupInfo:
    """What a rank gets besides the fixture.

    rank, world_size: this process's rank and the world (= the fixture's cp_size). local_rank: the GPU it uses.
    device: torch device of its tensors ("cuda:<local_rank>" under NCCL, "cpu" under gloo). comm: the fixture's comm
    type. cp_global_ranks: every CP rank (TE's cp_global_ranks). groups: the process groups this rank belongs to, in
    the order TransformerEngine takes them: [the CP group] for p2p, a2a and all_gather; [its a2a group (a2a_size
    consecutive ranks), its p2p group (ranks a2a_size apart)] for a2a+p2p. group_ranks: their rank lists."""
    rank: int
    world_size: int
    local_rank: int
    device: object
    comm: str
    cp_global_ranks: list
    groups: list
    group_ranks: list

    @property
    def cp_group(self):
        """What TE's set_context_parallel_group takes as cp_group: the group, or the list [a2a, p2p]."""
        return self.groups[0] if len(self.groups) == 1 else list(self.groups)


@dataclass
class RankResult:
    """One rank's outputs (rank-local layout) and what the implementation said: its backend, log lines, notes."""
    outputs: dict
    backend: str = ""
    log: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)


class RankAdapter(Adapter):
    """Base of the per-rank adapters: `name`, `tensors` (the outputs it gives), `pad_rows`, `requires_cuda`, and
    `run_rank`. `unsupported(fixture)` (a string or None) and Refused from run_rank keep their meaning of Adapter."""
    requires_cuda = False

    def run_rank(self, fixture, rank, groups):
        raise NotImplementedError


def cp_group_ranks(comm, cp_size, rank, a2a_size=0):
    """The rank lists of the groups a rank hands to set_context_parallel_group: every rank for p2p, a2a and
    all_gather; for a2a+p2p [its a2a group (consecutive ranks), its p2p group (ranks a2a_size apart)]."""
    if comm != "a2a+p2p":
        return [list(range(cp_size))]
    a = int(a2a_size or 0)
    if a < 1 or cp_size % a:
        raise Refused(f"a2a_size {a} does not divide cp_size {cp_size}")
    start = rank - rank % a
    return [list(range(start, start + a)), list(range(rank % a, cp_size, a))]


RANK_ADAPTERS = {
    "te_cp": ("te", "TeContextParallelProcess",
              "TransformerEngine DotProductAttention CP, one process per GPU over NCCL (--backend fused|flash)"),
    "torch_allgather": ("torch_cp", "TorchAllGather",
                        "plain torch all-gather CP (CPU under gloo, GPU under NCCL); --set mistake=causal_edge_plus1 "
                        "plants an off-by-one causal edge, --set fail_rank=R|all raises on rank R (or every rank) (fail_when=before|after "
                        "its collectives)"),
}


def rank_adapter_class(name):
    """The class of a per-rank adapter (its module imports no implementation: TE is imported by the constructor)."""
    if name not in RANK_ADAPTERS:
        raise ValueError(f"adapter: {name!r} is not one of {', '.join(RANK_ADAPTERS)}")
    module, cls, _ = RANK_ADAPTERS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def make_rank_adapter(name, **options):
    return rank_adapter_class(name)(**options)
