"""flashtile inside other libraries. Each integration is its own module and imports its library only when it
is imported itself: ``import flashtile`` imports none of them.

- ``flashtile.integrations.transformers``: an ``attn_implementation`` for Hugging Face transformers models.
"""
