"""Pick the compute device once and pass it around (no hard-coded ``"cuda"``)."""

from __future__ import annotations

import torch


def pick_device(requested: str | None = None) -> torch.device:
    """Return the device to run on.

    Args:
        requested: ``"cpu"``, ``"cuda"``, ``"cuda:1"``..., or ``None``/``"auto"`` for CUDA when available.

    Returns:
        The torch device.
    """
    if requested in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from mot_cag.errors import MotCagError

        raise MotCagError(f"Device '{requested}' was requested but CUDA is not available; use --device cpu.")
    return dev
