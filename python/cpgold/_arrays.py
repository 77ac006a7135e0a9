"""numpy / torch interchange: dtype mapping, float32 conversion and row gathers that work on both."""
import numpy as np

TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def is_torch(x):
    return type(x).__module__.startswith("torch")


def ndim(x):
    return x.dim() if is_torch(x) else np.ndim(x)


def _import_torch(what):
    try:
        import torch
    except ImportError:
        raise ModuleNotFoundError(f"{what} needs PyTorch, which is not installed in this Python ({__import__('sys').executable}): "
                                  "pip install torch, or use the numpy form (framework='numpy', the default)",
                                  name="torch") from None
    return torch


def torch_dtype(case_dtype):
    torch = _import_torch("torch tensors")

    if case_dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {sorted(TORCH_DTYPE_NAMES)}, got {case_dtype!r}")
    return getattr(torch, TORCH_DTYPE_NAMES[case_dtype])


def to_torch(x, case_dtype, device=None):
    """numpy values of the case dtype (bf16 read as float32) -> a torch tensor of that dtype; exact."""
    torch = _import_torch("inputs as torch tensors (framework='torch')")

    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype=torch_dtype(case_dtype), device=device)


# numpy dtypes of ml_dtypes (and of jax, which uses it) that widen exactly to float32.
_EXTENSION_FLOATS = ("bfloat16", "float16")


def _refuse_element(dtype_name, what):
    if dtype_name in ("float64", "torch.float64", "longdouble", "float128"):
        raise ValueError(f"{what}: expected float32, bf16 or fp16 values, found {dtype_name} (refused rather than "
                         "rounded to float32, as `cpgold check` refuses float64 candidate files: convert it yourself "
                         "if the rounding is what you mean)")
    raise ValueError(f"{what}: expected a floating-point array (float32, bf16 or fp16), got dtype {dtype_name}")


def host_array(x, what):
    """(numpy array, element) of a numpy array or torch tensor without converting its values: a view where possible
    (a CUDA tensor is copied to the host); torch's bfloat16 as its 16-bit words with element "bfloat16", else ""."""
    if is_torch(x):
        import torch

        if not x.is_floating_point():
            _refuse_element(str(x.dtype), what)
        t = x.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bfloat16"
        return t.numpy(), ""
    return np.asarray(x), ""


def to_float32(x, what):
    """numpy or torch (float32, bf16, fp16; any device: CUDA tensors are copied to the host) -> contiguous numpy
    float32. bf16/fp16 (torch, numpy's float16, ml_dtypes' bfloat16) convert exactly; float64 and other types are
    refused (ValueError), as `cpgold check` refuses them in candidate files."""
    if is_torch(x):
        import torch

        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            _refuse_element(str(x.dtype), what)
        return x.detach().to("cpu").float().contiguous().numpy()
    a = np.asarray(x)
    if not ((a.dtype.kind == "f" and a.dtype.itemsize in (2, 4)) or a.dtype.name in _EXTENSION_FLOATS):
        _refuse_element(a.dtype.name, what)
    return np.ascontiguousarray(a.astype(np.float32, copy=False))


def _index_like(index, x):
    if is_torch(x):
        import torch

        return torch.as_tensor(index, dtype=torch.long, device=x.device)
    return index


def take_rows(x, index, axis):
    """x[index] along axis (numpy or torch)."""
    if is_torch(x):
        return x.index_select(axis, _index_like(index, x))
    return np.take(x, index, axis=axis)


def put_rows(x, index, total, axis, fill):
    """A new array with `total` rows along axis: rows `index` from x, the rest `fill`."""
    shape = list(x.shape)
    if shape[axis] != len(index):
        raise ValueError(f"expand: {shape[axis]} rows along axis {axis}, the layout has {len(index)} valid rows")
    shape[axis] = total
    if is_torch(x):
        import torch

        out = torch.full(shape, fill, dtype=x.dtype, device=x.device)
        out.index_copy_(axis, _index_like(index, x), x)
        return out
    out = np.full(shape, fill, dtype=x.dtype)
    sel = [slice(None)] * len(shape)
    sel[axis] = index
    out[tuple(sel)] = x
    return out
