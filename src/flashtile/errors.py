"""The exceptions flashtile raises for inputs it cannot take.

flash_attn's own checks raise ``RuntimeError`` (code written for it catches that), while Python code
usually expects ``ValueError`` for a bad value and ``TypeError`` for a bad type. flashtile's input errors
are both: ``InputError`` is a ``ValueError`` and a ``RuntimeError``; ``InputTypeError`` is also a
``TypeError``. Every check runs before anything launches, and each message says what was expected, what
came, and how to fix it.
"""

from __future__ import annotations


class InputError(ValueError, RuntimeError):
    """An input flashtile cannot take: a ValueError, and a RuntimeError as flash_attn raises."""


class InputTypeError(InputError, TypeError):
    """An input of the wrong type (or dtype): an ``InputError`` that is also a TypeError."""


class UnsupportedDtypeError(InputTypeError):
    """An input dtype the kernels do not take (q, k, v must be float16, bfloat16 or float32)."""


class UnsupportedHeadDimError(InputError):
    """A head dimension the kernels do not take."""


def require(condition: bool, message: str, error: type[Exception] = InputError) -> None:
    """Raise ``error(message)`` unless ``condition``. The message is built before the call, so checks that run on
    every call of an entry point use a plain ``if`` instead, as do checks whose message holds a size: under
    torch.compile an f-string of a symbolic size would fix the size (a recompile for every new one) or fail to
    trace."""
    if not condition:
        raise error(message)
