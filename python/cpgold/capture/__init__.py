"""cpgold.capture: the attention calls of a real training step recorded per call and rank, joined into cpgold cases
and checked against goldens made from their own inputs (docs/capture.md).

    cap = cpgold.capture.Capture("capture/")       # in the training script: a folder of its own
    cap.attach(model)                               # TransformerEngine's DotProductAttention, and layer names
    with cap.step(0):
        ...the unchanged training step...

    python3 -m cpgold.capture check capture/        # joins the ranks' shards, checks every call

Capture needs torch; join, check and shrink need numpy, h5py and cpgold's C++ core.
"""
from .checking import CaptureReport, check, check_call  # noqa: F401
from .joining import JoinResult, join, load_joined  # noqa: F401
from .recorder import Capture, CaptureWarning, attention  # noqa: F401
from .shrinking import shrink  # noqa: F401
from ._folder import CaptureFolderError  # noqa: F401

__all__ = ["Capture", "CaptureWarning", "CaptureFolderError", "attention", "join", "check", "shrink",
           "CaptureReport", "JoinResult", "check_call", "load_joined"]
