"""The interface every outsider adapter implements (docs/outsiders.md, "Adapters").

An adapter runs one implementation of attention (a kernel library, a framework module, a CP implementation) on a
cpgold fixture's inputs and hands back its outputs in cpgold's candidate layout, with what the implementation said
about itself: its versions, the backend it chose, its log lines, or its refusal. The harness (harness.py) writes the
candidate, checks it with the fixture's rules and the adapter's pad-row convention, and tabulates the verdicts.
"""
from dataclasses import dataclass, field


class Refused(Exception):
    """The implementation refused the configuration at run time (an assert, a gating message, no backend): not a wrong
    result. The message is the implementation's own, kept verbatim in the summary."""


REFUSING = (("transformer_engine", "TE"), ("flash_attn", "FlashAttention"))   # a path part, and whose refusal


def refusal_source(e):
    """Whose code raised `e`: "TE" or "FlashAttention" when the innermost frame of its traceback is in that package
    (an assert or argument check of the library: a refusal of the configuration), None when it is anywhere else (the
    CuTe DSL compiler, torch, Python): such an exception is an error, not a refusal."""
    tb, filename = e.__traceback__, ""
    while tb is not None:
        filename, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    parts = filename.replace("\\", "/").split("/")
    for package, who in REFUSING:
        if package in parts:
            return who
    return None


def as_refusal(e, prefix=""):
    """Refused naming the library when `e` is a refusal (refusal_source), else None: `e` stays an error."""
    who = refusal_source(e)
    if who is None:
        return None
    return Refused(f"{prefix}{who} refuses: {type(e).__name__}: {str(e).strip()[:600]}")


class library_refusals:
    """Raises Refused (as_refusal, `prefix` first) for an assert or argument check of TE or FlashAttention in the
    block; any other exception goes on as it is."""

    def __init__(self, prefix=""):
        self.prefix = prefix

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, (AssertionError, ValueError, NotImplementedError)):
            refusal = as_refusal(e, self.prefix)
            if refusal is not None:
                raise refusal from e
        return False


@dataclass
class Outcome:
    """What one run of an adapter on one fixture gives back.

    outputs: global-layout outputs (some of o [Tq,hq,dv], lse [hq,Tq] or [Tq,hq], dq, dk, dv; numpy or torch), or
    None. rank_outputs: one dict per CP rank in the rank-local layout (what rank r holds), or None; a CP adapter
    gives these and the runner gathers them. scope: of `outputs`, "global" for a non-CP implementation (the larger of
    the CP and non-CP budgets decides) or "cp_gathered". backend: what the implementation says it ran. log: its lines
    about that choice (TransformerEngine's NVTE_DEBUG lines). notes: anything else worth keeping per fixture."""
    outputs: dict = None
    rank_outputs: list = None
    scope: str = "global"
    backend: str = ""
    log: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)


class Adapter:
    """Base of the adapters. Subclasses set `name`, and override `versions`, `unsupported` and `run`.

    pad_rows: the pad-row convention of the implementation's outputs, as `cpgold check --pad-rows` names it: "zero"
    (the contract) or "unwritten" (FlashAttention-3/4 with seqused_q/k never write pad rows). tensors: the outputs it
    gives (None: all five). isolate: run every fixture in a child process, so that a device-side assert or a crash
    loses only that fixture."""
    name = "adapter"
    pad_rows = "zero"
    tensors = None
    isolate = False

    def __init__(self, deterministic=False, **options):
        if options:
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(sorted(options))}")
        self.deterministic = bool(deterministic)

    def options(self):
        """The options that select the implementation's behaviour: kept in the summary and passed to a child."""
        return {"deterministic": self.deterministic}

    def versions(self):
        """What the process runs on: the common environment (environment.py: Python, torch, CUDA, cuDNN, NCCL, the
        device, the driver, the libcudnn mapped, the variables that select behaviour). A subclass adds its
        libraries' versions to this ({**super().versions(), ...}). The runner, the rank harness and the server record
        environment() with what this returns on top (environment.process_versions), so an override that leaves the
        environment out loses nothing."""
        from .environment import environment
        return environment()

    def unsupported(self, fixture):
        """Why the fixture's case cannot be expressed in the implementation's API (a string), or None. Only what the
        API cannot say belongs here; what the implementation refuses at run time raises Refused from run()."""
        return None

    def run(self, fixture):
        """Runs forward and backward on the fixture's inputs; returns an Outcome."""
        raise NotImplementedError
