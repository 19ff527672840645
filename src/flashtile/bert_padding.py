"""flash_attn 2.x's module path ``flash_attn.bert_padding``: ``from flashtile.bert_padding import unpad_input``
works where code imported from flash_attn. The helpers live in ``flashtile.padding``."""

from flashtile.padding import index_first_axis, index_put_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]
