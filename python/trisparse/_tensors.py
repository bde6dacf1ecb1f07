"""How torch tensors, streams and workspaces cross into trisparse._C (plain integers)."""

import os

import torch

from . import _C

# TRISPARSE_POISON_WORKSPACE=1 (the test suite sets it): every workspace is filled with 0xFF bytes
# (NaN in every float type) before its op runs, as a reused allocator block may hold anything, so
# that a kernel reading workspace it did not write shows.
_POISON = os.environ.get("TRISPARSE_POISON_WORKSPACE", "0") == "1"

# The codes of trisparse::dtype (include/trisparse/core/dtype.hpp), as the extension gives them.
_DTYPE_CODES = {getattr(torch, name): code for name, code in _C.dtype_codes}
FLOAT_DTYPES = tuple(_DTYPE_CODES)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The attention's score scale: `scale`, or 1/sqrt(head_dim) (the C++ plans' default,
    detail::resolve_scale; here in Python so that torch.compile traces it)."""
    if scale is not None:
        return float(scale)
    if head_dim < 1:
        raise ValueError(f"the head dim must be >= 1, got {head_dim}")
    return head_dim**-0.5


def device_index(device: torch.device) -> int:
    """-1 for the CPU, else the CUDA device's index."""
    if device.type == "cpu":
        return -1
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    raise ValueError(f"trisparse runs on the CPU and on CUDA devices, not on {device}")


def dtype_code(dtype: torch.dtype) -> int:
    """The C++ dtype enum's value of a float dtype."""
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"trisparse takes float16, bfloat16, float32 or float64, not {dtype}")
    return _DTYPE_CODES[dtype]


def foldable(t: torch.Tensor) -> bool:
    """Whether [B, H, N, D] t can be seen as [N, B * H, D] (head b * H + h: sequence b's head h)
    without a copy: its heads evenly spaced (B = 1, H = 1, or a batch stride of H head strides).
    Other ranks: True."""
    if t.dim() != 4:
        return True
    s = t.stride()
    return t.shape[0] == 1 or t.shape[1] == 1 or s[0] == t.shape[1] * s[1]


def rows_heads(t: torch.Tensor) -> tuple[int, int]:
    """(rows, heads) of a [rows, H, D] tensor or of [B, H, N, D] as `view` sees it: (N, B * H)."""
    shape = t.shape
    if len(shape) == 4:
        return shape[2], shape[0] * shape[1]
    return shape[0], shape[1]


def _device(t: torch.Tensor) -> int:
    """view's device code, without a torch.device object where it can."""
    if t.is_cuda:
        return t.get_device()
    if t.is_cpu:
        return -1
    return device_index(t.device)  # raises, naming the device


def view(t: torch.Tensor) -> tuple:
    """A [rows, heads, dim] tensor whose last dimension is contiguous, or a `foldable` [B, H, N,
    D] one as [N, B * H, D] (no torch view made), as _C's tensor tuple. (On every op's path: one
    shape and one stride query, and no torch.device object.)"""
    shape = t.shape
    stride = t.stride()
    if len(shape) == 4:
        b, h, n, d = shape
        if not foldable(t):
            raise ValueError(f"a [B, H, N, D] tensor of strides {stride} has no [N, B * H, D] view")
        rows, heads, dim = n, b * h, d
        stride = (stride[2], stride[0] if h == 1 else stride[1])
    else:
        rows, heads, dim = shape
    return (t.data_ptr(), _DTYPE_CODES[t.dtype], _device(t), rows, heads, dim, stride[0], stride[1])


def view2(t: torch.Tensor | None) -> tuple | None:
    """A [n, H] tensor (per node or per edge, one value a head) as the [n, H, 1] view the plans
    take (no torch view made); None stays None."""
    if t is None:
        return None
    (n, h), (s0, s1) = t.shape, t.stride()
    return (t.data_ptr(), _DTYPE_CODES[t.dtype], _device(t), n, h, 1, s0, s1)


def aligned16(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels' 16-byte row loads take [rows, H, D] t as it is: a unit last
    stride, row and head strides that are multiples of 8 elements, a 16-byte aligned start. False
    while torch.compile traces (a traced graph has no pointer to test: the callers' copy is)."""
    if torch.compiler.is_compiling():
        return False
    s = t.stride()
    return s[-1] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and t.data_ptr() % 16 == 0


def rows16(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where its rows are not aligned16."""
    return t if aligned16(t) else t.contiguous()


# torch's current stream as an integer without a torch.cuda.Stream object (what inductor's
# generated code calls); torch.cuda.current_stream where a build lacks it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream(device: torch.device) -> int:
    """torch's current stream on `device` as an integer (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def workspace(nbytes: int, device: torch.device) -> tuple[torch.Tensor | None, int, int]:
    """(owner, pointer, bytes): `nbytes` from torch's caching allocator, which is stream-ordered
    (the block is reused only after the current stream's work on it), as the plans need."""
    if nbytes == 0:
        return None, 0, 0
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if _POISON:
        buf.fill_(255)
    return buf, buf.data_ptr(), nbytes


def dropout_state(dropout: float, state: torch.Tensor | None) -> int:
    """The device address of attention dropout's {seed, offset} (int64 [2]), 0 without dropout."""
    return state.data_ptr() if dropout > 0 and state is not None else 0


def new_dropout_state(dropout: float, device: torch.device) -> torch.Tensor | None:
    """Attention dropout's {seed, offset} for one call, drawn from torch's generator of `device`
    (on the device: no host round trip; None without dropout)."""
    if dropout <= 0:
        return None
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=device)
