"""What every outsider result records of the process that ran it (cpgold.outsiders.environment): the common
environment without a GPU or the libraries, and with fakes of torch on a GPU (torch's cuDNN check raising as it does
when TransformerEngine loaded another cuDNN), of NVML and nvidia-smi, of /proc/self/maps and of installed wheels;
each adapter's versions() as the environment plus its own libraries; what a resume compares."""
import json
import os
import sys
import types

import pytest

from cpgold.outsiders import environment as env
from cpgold.outsiders.adapter import Adapter

COMMON = ("python", "platform", "host", "torch", "cuda", "cudnn_torch", "nccl", "device", "compute_capability",
          "gpus", "driver", "libcudnn_mapped", "variables")


@pytest.fixture
def no_driver(monkeypatch, tmp_path):
    """No pynvml and no nvidia-smi: PATH holds an empty folder only; the driver is asked again."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(env, "_driver", [])
    return tmp_path / "bin"


def test_the_environment_without_a_gpu_or_libraries(no_driver, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)          # torch not installed
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    e = env.environment()
    assert set(COMMON) <= set(e)
    assert e["torch"] == "not installed" and e["cuda"] == "not installed" and e["nccl"] == "not installed"
    assert e["device"] == "no CUDA device" and e["compute_capability"] == "no CUDA device" and e["gpus"] == []
    assert e["driver"].startswith("not found (") and "no pynvml" in e["driver"] and "no nvidia-smi" in e["driver"]
    assert e["variables"] == {"CUDA_VISIBLE_DEVICES": "3", "NCCL_NVLS_ENABLE": "unset", "NVTE_FUSED_ATTN": "1"}
    assert e["python"] == ".".join(map(str, sys.version_info[:3]))
    assert json.loads(json.dumps(e)) == e                    # JSON values only


def test_the_environment_of_a_cpu_torch(no_driver):
    torch = pytest.importorskip("torch")
    e = env.environment()
    assert e["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert e["device"] == "no CUDA device" and e["gpus"] == []
    if torch.version.cuda is None:
        assert e["cuda"] == e["nccl"] == "none (torch built without CUDA)"


def fake_torch(cudnn, nccl=(2, 21, 5), devices=("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), current=1):
    """A torch on a GPU machine: `cudnn` is what torch.backends.cudnn.version() returns, or an exception it raises."""
    def cudnn_version():
        if isinstance(cudnn, Exception):
            raise cudnn
        return cudnn

    cuda = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: len(devices), current_device=lambda: current,
        get_device_name=lambda i: devices[i], get_device_capability=lambda i: (9, 0),
        nccl=types.SimpleNamespace(version=lambda: nccl))
    return types.SimpleNamespace(__version__="2.9.0+cu128", version=types.SimpleNamespace(cuda="12.8"),
                                 backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=cudnn_version)),
                                 cuda=cuda)


def test_a_gpu_torch_whose_cudnn_check_refuses(no_driver, monkeypatch):
    refusal = RuntimeError("cuDNN version incompatibility: PyTorch was compiled against (9, 10, 2) but found "
                           "runtime version (9, 8, 0).")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(refusal))
    e = env.environment()
    assert e["cudnn_torch"].startswith("error: RuntimeError: cuDNN version incompatibility")
    assert "(9, 8, 0)" in e["cudnn_torch"]
    assert e["torch"] == "2.9.0+cu128" and e["cuda"] == "12.8" and e["nccl"] == "2.21.5"
    assert e["device"] == "NVIDIA H100 80GB HBM3" and e["device_index"] == "cuda:1"
    assert e["compute_capability"] == "sm90" and len(e["gpus"]) == 2
    monkeypatch.setitem(sys.modules, "torch", fake_torch(91002))
    assert env.environment()["cudnn_torch"] == "91002"


def test_the_driver_from_nvml_then_nvidia_smi(no_driver, monkeypatch):
    smi = no_driver / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.04\necho 580.159.04\n")
    smi.chmod(0o755)
    assert env.driver_version() == "580.159.04"
    smi.write_text("#!/bin/sh\nexec /bin/sleep 5\n")
    assert "nvidia-smi: no answer within 0.2 s" in env.driver_version(timeout=0.2)
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert "nvidia-smi: exit 9: NVIDIA-SMI has failed" in env.driver_version()
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlSystemGetDriverVersion=lambda: b"575.51.03")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert env.driver_version() == "575.51.03"


def test_the_libcudnn_files_mapped(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /opt/venv/nvidia/cudnn/lib/libcudnn.so.9\n"
        "7f01-7f02 r-xp 00001000 08:01 1 /opt/venv/nvidia/cudnn/lib/libcudnn.so.9\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/venv/nvidia/cudnn/lib/libcudnn_graph.so.9\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
        "7f05-7f06 r-xp 00000000 08:01 4 /te/lib/libcudnn_engines_precompiled.so.9.8.0 (deleted)\n")
    assert env.libcudnn_mapped(str(maps)) == [
        "/opt/venv/nvidia/cudnn/lib/libcudnn.so.9", "/opt/venv/nvidia/cudnn/lib/libcudnn_graph.so.9",
        "/te/lib/libcudnn_engines_precompiled.so.9.8.0 (deleted)"]
    assert env.libcudnn_mapped(str(tmp_path / "none")).startswith("unknown (")
    assert isinstance(env.libcudnn_mapped(), list)             # this process's own /proc/self/maps


def wheel(site, name, version, direct_url=None):
    """An installed distribution's metadata (NAME-VERSION.dist-info) under site."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_packages_and_what_a_wheel_records_of_its_build(tmp_path, monkeypatch):
    site = tmp_path / "site"
    wheel(site, "fake-fa-a", "3.0.0")
    wheel(site, "fake-fa-b", "3.0.0+g0251105", {"url": "https://github.com/Dao-AILab/flash-attention",
                                                "vcs_info": {"vcs": "git", "commit_id": "0251105a1b2c"}})
    wheel(site, "fake-fa-c", "3.0.0", {"url": "file:///wheels/flash_attn_3-3.0.0-cp39-abi3-linux_x86_64.whl",
                                       "archive_info": {"hash": "sha256=ab12"}})
    monkeypatch.syspath_prepend(str(site))
    assert env.packages("fake-fa-a", "fake-nothing") == {"fake-fa-a": "3.0.0", "fake-nothing": "not installed"}
    assert env.build_of("fake-fa-a") == "no build commit recorded (the metadata says version 3.0.0)"
    assert env.build_of("fake-fa-b") == ("local version label g0251105; commit 0251105a1b2c; installed from "
                                         "https://github.com/Dao-AILab/flash-attention")
    assert env.build_of("fake-fa-c") == ("installed from file:///wheels/flash_attn_3-3.0.0-cp39-abi3-linux_x86_64.whl"
                                         " (sha256=ab12)")
    assert env.build_of("fake-nothing") == "not installed"


class Plain(Adapter):
    name = "plain"

    def versions(self):
        return {"mylib": "1.2", "device": "my accelerator"}


class Raising(Adapter):
    name = "raising"

    def versions(self):
        raise OSError("no version file")


def test_process_versions_keeps_the_environment_under_any_adapter(no_driver):
    base = Adapter().versions()
    assert set(COMMON) <= set(base)                           # the default is the environment, not {}
    plain = env.process_versions(Plain())
    assert set(COMMON) <= set(plain) and plain["mylib"] == "1.2" and plain["device"] == "my accelerator"
    raising = env.process_versions(Raising())
    assert set(COMMON) <= set(raising) and raising["adapter_versions"] == "error: OSError: no version file"
    assert set(COMMON) <= set(env.process_versions(types.SimpleNamespace()))   # no versions() at all


def test_what_a_resume_compares():
    a = {"torch": "2.9.0", "driver": "580.1", "host": "n1", "pid": 10, "libcudnn_mapped": ["/a/libcudnn.so.9"],
         "module": "/a/x.py", "gpus": ["H100"], "device_index": "cuda:0", "platform": "Linux-6.1",
         "variables": {"CUDA_VISIBLE_DEVICES": "0", "NVTE_FUSED_ATTN": "1"}}
    where = dict(a, host="n2", pid=11, libcudnn_mapped=["/b/libcudnn.so.9"], module="/b/x.py", gpus=["H200"],
                 device_index="cuda:3", platform="Linux-6.2", variables={"CUDA_VISIBLE_DEVICES": "3",
                                                                          "NVTE_FUSED_ATTN": "1"})
    assert env.differences(a, where) == [] and env.digest(a) == env.digest(where)
    what = dict(a, torch="2.10.0", variables={"CUDA_VISIBLE_DEVICES": "0", "NVTE_FUSED_ATTN": "0"})
    assert env.differences(a, what) == [
        'torch "2.10.0" (recorded "2.9.0")',
        'variables {"NVTE_FUSED_ATTN": "0"} (recorded {"NVTE_FUSED_ATTN": "1"})']
    assert env.digest(a) != env.digest(what)
    assert env.differences([a, a], [a, dict(a, driver="590.2")]) == ['rank 1: driver "590.2" (recorded "580.1")']
    assert env.differences([a, a], [a]) == ["ranks 1 (recorded 2)"]


# ------------------------------------------------------------------ each adapter's versions()
def test_flash_adapters_record_their_libraries_and_no_cudnn(no_driver, tmp_path, monkeypatch):
    from cpgold.outsiders import flash
    site = tmp_path / "site"
    for name, version in (("flash-attn-4", "4.0.0b4"), ("nvidia-cutlass-dsl", "4.3.0"), ("quack-kernels", "0.2.2")):
        wheel(site, name, version)
    wheel(site, "flash-attn-3", "3.0.0", {"url": "file:///w/flash_attn_3-3.0.0.whl", "archive_info": {}})
    monkeypatch.syspath_prepend(str(site))
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = lambda q, k, v, window_size=None: None
    cute.__file__ = "/fake/flash_attn/cute/__init__.py"
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", cute)
    v4 = flash.FlashAttn4(device="cpu").versions()
    assert set(COMMON) <= set(v4) and v4["cudnn"] == "not used"
    assert v4["library"] == "flash-attn-4 4.0.0b4" and v4["nvidia-cutlass-dsl"] == "4.3.0"
    assert v4["quack-kernels"] == "0.2.2" and v4["apache-tvm-ffi"] == "not installed"
    assert v4["module"] == cute.__file__
    v3 = flash.FlashAttn3(device="cpu").versions()
    assert set(COMMON) <= set(v3) and v3["cudnn"] == "not used" and "nvidia-cutlass-dsl" not in v3
    assert v3["flash-attn-3 build"] == "installed from file:///w/flash_attn_3-3.0.0.whl"
    varlen = object.__new__(flash.VarlenAttn)    # torch's varlen_attn needs a newer torch: only its signature here
    varlen.signature = "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)"
    v = varlen.versions()
    assert set(COMMON) <= set(v) and v["varlen_attn"] == varlen.signature


def test_te_versions_record_both_cudnns_the_driver_and_fa4_s_dsl(no_driver, tmp_path, monkeypatch):
    from cpgold.outsiders import te
    site = tmp_path / "site"
    wheel(site, "nvidia-cutlass-dsl", "4.3.0")
    wheel(site, "flash-attn-4", "4.0.0b4")
    monkeypatch.syspath_prepend(str(site))
    refusal = RuntimeError("cuDNN version incompatibility: PyTorch was compiled against (9, 10, 2) but found "
                           "runtime version (9, 8, 0).")
    torch = fake_torch(refusal)
    monkeypatch.setitem(sys.modules, "torch", torch)
    m = types.SimpleNamespace(torch=torch, transformer_engine=types.SimpleNamespace(__version__="2.20.2"),
                              te_dpa=types.SimpleNamespace(dpa_utils=types.SimpleNamespace(
                                  get_cudnn_version=lambda: (9, 8, 0))))
    v = te.versions(m, "flash")
    assert set(COMMON) <= set(v)
    assert v["transformer_engine"] == "2.20.2" and v["cudnn_te"] == "9.8.0"
    assert v["cudnn_torch"].startswith("error: RuntimeError: cuDNN version incompatibility")
    assert v["nvidia-cutlass-dsl"] == "4.3.0" and v["flash-attn-4"] == "4.0.0b4"
    assert v["flash-attn-3"] == "not installed" and v["flash-attn-3 build"] == "not installed"
    assert v["device"] == "NVIDIA H100 80GB HBM3" and v["compute_capability"] == "sm90" and v["cuda"] == "12.8"
    assert "nvidia-cutlass-dsl" not in te.versions(m, "fused")


def test_cudnn_and_torch_cp_versions(no_driver, monkeypatch):
    from cpgold.outsiders import cudnn as cudnn_adapter
    thd = object.__new__(cudnn_adapter.CudnnThd)   # the frontend is not installed here: its version calls only
    thd.cudnn = types.SimpleNamespace(backend_version_string=lambda: "9.8.0", __version__="1.12.0")
    v = thd.versions()
    assert set(COMMON) <= set(v) and v["cudnn"] == "9.8.0" and v["frontend"] == "1.12.0"
    assert v["nvidia-cudnn-frontend"] == "not installed"
    pytest.importorskip("torch")
    from cpgold.outsiders.torch_cp import TorchAllGather
    v = TorchAllGather().versions()
    assert set(COMMON) <= set(v) and "gloo_available" in v and "nccl_available" in v


def test_the_environment_module_prints_json(no_driver):
    import subprocess
    p = subprocess.run([sys.executable, "-m", "cpgold.outsiders.environment"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=120)
    assert p.returncode == 0, p.stderr
    assert set(COMMON) <= set(json.loads(p.stdout))
