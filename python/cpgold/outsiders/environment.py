"""What a process ran on: the versions and the device every outsider result records (docs/outsiders.md).

`environment()` is the part common to every adapter: Python, the platform, the host and process, torch with the
CUDA, cuDNN and NCCL it reports, the device, the driver, the libcudnn files the process has mapped and the variables
that select behaviour.
An adapter's `versions()` adds its own libraries (`packages`, `build_of`); `process_versions(adapter)` is what the
runner, the rank harness and the resident server record: the environment, then the adapter's own fields.

Nothing here needs a GPU or a library: what is missing reads "not installed", "no CUDA device" or "not found", and
a query that fails records its error text instead of stopping the run.
"""
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys

NO_DEVICE = "no CUDA device"
NOT_INSTALLED = "not installed"
# Fields that say where or in which process a run happened rather than what it ran with: kept in the records, left
# out when versions are compared (a resume) and from their digest.
WHERE = frozenset({"host", "platform", "pid", "gpus", "device_index", "libcudnn_mapped", "module"})
# Variables recorded when set (NCCL_NVLS_ENABLE and CUDA_VISIBLE_DEVICES also when unset); of them,
# CUDA_VISIBLE_DEVICES is where, not what.
VARIABLES = ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES")
VARIABLE_PREFIXES = ("NVTE_",)
DRIVER_TIMEOUT = 5.0   # seconds nvidia-smi may take to answer
CUDNN_DISTRIBUTIONS = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")   # the wheels that ship libcudnn
FA4_RUNS_ON = ("nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi")   # FlashAttention-4's compiler and runtime

_driver = []   # the driver version, asked once per process


def _error(e):
    return f"error: {type(e).__name__}: {str(e).strip()[:400]}"


def packages(*names):
    """{distribution: version} as importlib.metadata knows them; "not installed" for one it does not know."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = NOT_INSTALLED
        except Exception as e:  # noqa: BLE001 - broken metadata: recorded as such
            out[name] = _error(e)
    return out


def build_of(name):
    """What an installed distribution records of its build: the commit of a VCS install (direct_url.json's
    vcs_info), the local label of its version (3.0.0+LABEL), the file or URL it was installed from; "not installed",
    or a sentence saying that it records no build beyond its version."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return NOT_INSTALLED
    except Exception as e:  # noqa: BLE001
        return _error(e)
    version = dist.version or "?"
    found = []
    if "+" in version:
        found.append(f"local version label {version.split('+', 1)[1]}")
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except (ValueError, OSError):
        direct = {}
    if isinstance(direct, dict):
        vcs = direct.get("vcs_info") if isinstance(direct.get("vcs_info"), dict) else {}
        if vcs.get("commit_id"):
            found.append(f"commit {vcs['commit_id']}")
        if direct.get("url"):
            archive = direct.get("archive_info") if isinstance(direct.get("archive_info"), dict) else {}
            digest = archive.get("hash") or (archive.get("hashes") or {}).get("sha256")
            found.append(f"installed from {direct['url']}" + (f" ({digest})" if digest else ""))
    return "; ".join(found) if found else f"no build commit recorded (the metadata says version {version})"


def libcudnn_mapped(maps="/proc/self/maps"):
    """The libcudnn*.so* files this process has mapped (sorted, each once), from /proc/self/maps; a string saying
    why where the file cannot be read (not Linux)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError as e:
        return f"unknown ({maps}: {e.strerror or e})"
    found = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6:
            path = parts[5].strip()
            base = os.path.basename(path.replace(" (deleted)", ""))
            if base.startswith("libcudnn") and ".so" in base:
                found.add(path)
    return sorted(found)


def driver_version(timeout=DRIVER_TIMEOUT):
    """The NVIDIA driver's version: pynvml where it imports, else `nvidia-smi --query-gpu=driver_version`, else
    "not found (...)" saying what was tried. torch has no driver query."""
    why = []
    try:
        import pynvml
    except ImportError:
        why.append("no pynvml")
    else:
        try:
            pynvml.nvmlInit()
            try:
                v = pynvml.nvmlSystemGetDriverVersion()
            finally:
                pynvml.nvmlShutdown()
            return v.decode() if isinstance(v, bytes) else str(v)
        except Exception as e:  # noqa: BLE001 - no driver, or NVML refuses: nvidia-smi next
            why.append(f"pynvml: {type(e).__name__}: {str(e).strip()[:200]}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        why.append("no nvidia-smi on PATH")
    else:
        try:
            p = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=timeout)
            lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
            if p.returncode == 0 and lines:
                return lines[0]
            why.append(f"nvidia-smi: exit {p.returncode}: {(p.stderr or p.stdout).strip()[:200]}")
        except subprocess.TimeoutExpired:
            why.append(f"nvidia-smi: no answer within {timeout:g} s")
        except OSError as e:
            why.append(f"nvidia-smi: {e.strerror or e}")
    return f"not found ({'; '.join(why)})"


def _driver_once():
    if not _driver:
        _driver.append(driver_version())
    return _driver[0]


def variables(environ=None):
    """The variables that select NCCL's, TransformerEngine's and CUDA's behaviour, as this process has them."""
    environ = os.environ if environ is None else environ
    out = {name: environ.get(name, "unset") for name in VARIABLES}
    out.update({k: environ[k] for k in environ if k.startswith(VARIABLE_PREFIXES)})
    return dict(sorted(out.items()))


def _torch_fields(torch):
    out = {"torch": str(getattr(torch, "__version__", "?"))}
    cuda_build = getattr(getattr(torch, "version", None), "cuda", None)
    out["cuda"] = str(cuda_build) if cuda_build else "none (torch built without CUDA)"
    try:
        v = torch.backends.cudnn.version()
        out["cudnn_torch"] = str(v) if v is not None else "not available (torch.backends.cudnn.version() is None)"
    except Exception as e:  # noqa: BLE001 - e.g. another cuDNN loaded first (TransformerEngine's): its text
        out["cudnn_torch"] = _error(e)
    if not cuda_build:
        out["nccl"] = "none (torch built without CUDA)"
    else:
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)
        except Exception as e:  # noqa: BLE001
            out["nccl"] = _error(e)
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # noqa: BLE001
        count, out["device_error"] = 0, _error(e)
    if count:
        try:
            index = torch.cuda.current_device()
            out["device"] = torch.cuda.get_device_name(index)
            out["device_index"] = f"cuda:{index}"
            out["compute_capability"] = "sm%d%d" % tuple(torch.cuda.get_device_capability(index))
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
        except Exception as e:  # noqa: BLE001
            out["device"] = _error(e)
    else:
        out.update(device=NO_DEVICE, compute_capability=NO_DEVICE, gpus=[])
    return out


def environment():
    """The common environment of this process (see the module's docstring); never raises."""
    out = {"python": platform.python_version(), "platform": platform.platform(), "host": platform.node(),
           "pid": os.getpid()}
    try:
        import torch
    except ImportError:
        out.update(torch=NOT_INSTALLED, cuda=NOT_INSTALLED, cudnn_torch=NOT_INSTALLED, nccl=NOT_INSTALLED,
                   device=NO_DEVICE, compute_capability=NO_DEVICE, gpus=[])
    except Exception as e:  # noqa: BLE001 - a broken installation: its error
        out.update(torch=_error(e), device=NO_DEVICE)
    else:
        out.update(_torch_fields(torch))
    out["driver"] = _driver_once()
    out["libcudnn_mapped"] = libcudnn_mapped()
    out["variables"] = variables()
    return out


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def process_versions(adapter):
    """What this process runs an adapter on: environment(), then the adapter's own versions() on top (an adapter's
    word on a field wins). An adapter without versions() or whose versions() raises still records the environment,
    and the error under "adapter_versions". JSON values only."""
    out = environment()
    try:
        own = adapter.versions()
        if not isinstance(own, dict):
            raise TypeError(f"versions() returned {type(own).__name__}, not a dict")
        out.update(own)
    except Exception as e:  # noqa: BLE001 - recorded, never fatal
        out["adapter_versions"] = _error(e)
    return _plain(out)


def comparable(versions):
    """The fields of a versions record that a resume must match: everything but WHERE (and CUDA_VISIBLE_DEVICES)."""
    out = {k: v for k, v in versions.items() if k not in WHERE}
    if isinstance(out.get("variables"), dict):
        out["variables"] = {k: v for k, v in out["variables"].items() if k != "CUDA_VISIBLE_DEVICES"}
    return _plain(out)


def digest(versions):
    """A short name of the comparable fields: equal for processes that ran with the same versions."""
    if isinstance(versions, list):
        text = json.dumps([comparable(v) for v in versions], sort_keys=True)
    else:
        text = json.dumps(comparable(versions), sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(recorded, now):
    """["FIELD NOW (recorded RECORDED)", ...] over the comparable fields that differ, sorted by field; for lists of
    per-rank records, each difference names its rank."""
    if isinstance(recorded, list) or isinstance(now, list):
        recorded = recorded if isinstance(recorded, list) else [recorded]
        now = now if isinstance(now, list) else [now]
        if len(recorded) != len(now):
            return [f"ranks {len(now)} (recorded {len(recorded)})"]
        return [f"rank {r}: {d}" for r, (a, b) in enumerate(zip(recorded, now)) for d in differences(a, b)]
    a, b = comparable(recorded or {}), comparable(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "absent") != b.get(key, "absent"):
            out.append(f"{key} {json.dumps(b.get(key, 'absent'))} (recorded {json.dumps(a.get(key, 'absent'))})")
    return out


def describe(versions):
    """A versions record on one line, for logs: `key value, ...`."""
    return ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in versions.items())


if __name__ == "__main__":   # python3 -m cpgold.outsiders.environment: this process's environment as JSON
    json.dump(environment(), sys.stdout, indent=1)
    print()
