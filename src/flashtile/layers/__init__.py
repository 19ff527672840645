"""flash_attn 2.x's module path ``flash_attn.layers``: ``flashtile.layers.rotary`` holds its rotary embedding."""
