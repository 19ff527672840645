"""flashtile: exact, IO-aware FlashAttention for PyTorch with Triton kernels.

A drop-in for flash_attn (same names, arguments and layouts) and for
``torch.nn.functional.scaled_dot_product_attention``. CUDA tensors run compiled Triton kernels;
CPU tensors run the same tiled algorithm in PyTorch (see ``flashtile._backend``).
"""

from flashtile._backend import check_values
from flashtile.errors import InputError, InputTypeError
from flashtile.explain import explain
from flashtile.flex import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    FlexKernelOptions,
    and_masks,
    create_block_mask,
    create_mask,
    flex_attention,
    noop_mask,
    or_masks,
)
from flashtile.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.padding import pad_input, unpad_input
from flashtile.profiler import profile
from flashtile.sdpa import scaled_dot_product_attention

__version__ = "0.2.0"

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "InputError",
    "InputTypeError",
    "and_masks",
    "check_values",
    "create_block_mask",
    "create_mask",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flex_attention",
    "noop_mask",
    "or_masks",
    "pad_input",
    "profile",
    "scaled_dot_product_attention",
    "unpad_input",
]
