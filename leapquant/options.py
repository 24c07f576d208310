"""What the command-line tools share: the usage error, the ``--device`` option and how a name is read (``leapquant
info | demo | bench``, ``python -m leapquant.bench``). Imports nothing heavy until a device is parsed."""
from __future__ import annotations


class UsageError(ValueError):
    """An option that cannot run here (the commands exit with status 2 and this one-line reason)."""


def name_word(text: str) -> str:
    """A backend's or a gate's name as the API, the environment and the commands read it (any case, spaces around
    it ignored)."""
    return text.strip().lower()


def parse_device(text: str | None):
    """The torch device of a ``--device`` value (None: cuda when available, else cpu; ``cuda`` alone: the current
    CUDA device), checked to exist on this machine; raises :class:`UsageError` naming the option."""
    import torch

    from .dispatch import default_device
    if text is None:
        device = default_device()
    else:
        try:
            device = torch.device(text)
        except (RuntimeError, ValueError) as e:
            raise UsageError(f"--device {text!r}: {e}") from None
        if device.type not in ("cpu", "cuda"):
            raise UsageError(f"--device {text!r}: leapquant runs on cpu or cuda devices")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {text!r}: CUDA is not available on this machine")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
