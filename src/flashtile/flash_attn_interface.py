"""flash_attn 2.x's module path ``flash_attn.flash_attn_interface``: ``from flashtile.flash_attn_interface import
flash_attn_func`` works where code imported from flash_attn. The functions live in ``flashtile.interface`` and
``flashtile.kvcache``."""

from flashtile.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
