"""What every command shares: messages on stderr naming flags, exits, sizes, devices, signals."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

# dlstore.loader's back-ends for a store (--backend of profile and bench); the library checks them
# again, this copy keeps --help free of torch
STORE_BACKENDS = ("auto", "threads", "ring", "dataloader")

# The library names an option both ways, ``keyword=value (--flag value)`` or ``--flag
# (keyword=value)``; on the command line only the flag means anything.
_BOTH_WAYS = re.compile(r'\b\w+=(?:"[^"]*"|[^\s()]+) \((--[\w-]+(?: [^()\s]+)?)\)|(--[\w-]+) \(\w+=[^()]*\)')


def as_flags(text: str) -> str:
    return _BOTH_WAYS.sub(lambda m: m.group(1) or m.group(2), text)


def say(message: str) -> None:
    click.echo(as_flags(message), err=True)


def fail(exc: BaseException) -> None:
    say(f"error: {exc}")
    sys.exit(2)


def sigterm_as_interrupt() -> None:
    """Let SIGTERM unwind like Ctrl-C, so cleanup code runs and nothing half-written stays."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def gone(decls: str, fix: Callable[[Any], str], **kwargs: Any):
    """A hidden option that no longer exists: given, the command fails with ``fix(value)``, one line
    naming what replaced it (``kwargs``: click.option's, e.g. a ``type``)."""
    def refuse(ctx: click.Context, param: click.Parameter, value: object) -> None:
        if value is not None:
            raise click.UsageError(fix(value), ctx=ctx)
    name = "gone_" + decls.split("/")[0].lstrip("-").replace("-", "_")
    return click.option(decls, name, hidden=True, expose_value=False, default=None, callback=refuse, **kwargs)


def renamed(new: str, meaning: str):
    """A hidden old option that fails naming its new name (``--workers`` means decode processes only)."""
    return gone("--workers", lambda value: f"--workers is the decode processes of convert and demo; {meaning} is "
                                           f"{new} here")


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"256MB"``, ``"1000"`` -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
             "tb": 1000**4, "tib": 1024**4}
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = stripped[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise click.BadParameter(f"{text!r} is not a size (examples: 1GiB, 256MiB, 5000000)") from None
    if value < 1:
        raise click.BadParameter(f"{text!r}: size must be positive")
    return int(value)



def check_device(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter(f"{device!r}: no CUDA device is visible to this process; use "
                                     "--device cpu, or run on a machine with a GPU", param_hint="--device")
