"""User-facing errors.

Every error a user can cause (bad input, a missing model, a damaged store) is raised as a
:class:`MotCagError` whose message is one sentence that says what to do. The CLI prints the message on
stderr and exits non-zero, without a traceback.
"""

from __future__ import annotations


class MotCagError(Exception):
    """An error the user can act on; its message is shown as is."""

    exit_code: int = 1


class ModelNotFoundError(MotCagError):
    """A model name resolved to nothing on this machine."""


class StoreError(MotCagError):
    """A store is missing, damaged, or belongs to another source model."""


class TranslatorError(MotCagError):
    """No translator for a pair, or a translator used with the wrong pair."""
