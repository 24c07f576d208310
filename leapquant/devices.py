"""The one check of a torch device the library is handed: that this machine has it and it holds data."""
from __future__ import annotations

import torch


def device_here(device: object, what: str) -> torch.device:
    """``device`` as tensors made there report it (``cpu:0`` is ``cpu``; ``cuda`` gets the current device's index):
    the device of an empty tensor made there. A device torch cannot name or reach here, or the meta device (no data),
    raises a ``ValueError`` saying it cannot hold ``what`` (torch's own errors for a missing device vary with the
    device and the build: RuntimeError, TypeError, AssertionError, ImportError)."""
    try:
        dev = torch.empty(0, device=device).device
    except (RuntimeError, TypeError, AssertionError, ImportError) as e:
        raise ValueError(f"device: {device!r} cannot hold {what} ({type(e).__name__}: {e})") from None
    if dev.type == "meta":
        raise ValueError(f"device: {device!r} holds no data ({what} must be read and written)")
    return dev
