"""Read-time (random) transforms written on the command line: ``"random_crop=224:4,hflip"``.

The static spec (``--static``) is what conversion runs once; this is what a training loop draws
per epoch, given to ``dlstore profile --transform`` so that the loader measured is the one you
train with. Each op becomes its torchvision v2 transform (dlstore runs those per batch where it
can, as it does for the same transforms given in Python).
"""

from __future__ import annotations

from typing import Any

from ..errors import ArgumentError

OPS = {
    "random_crop": "random_crop=SIZE or SIZE:PADDING (v2.RandomCrop)",
    "random_resized_crop": "random_resized_crop=SIZE (v2.RandomResizedCrop, antialias)",
    "hflip": "hflip or hflip=P (v2.RandomHorizontalFlip)",
    "vflip": "vflip or vflip=P (v2.RandomVerticalFlip)",
}


def _number(op: str, text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ArgumentError(f"transform {op}={text!r}: expected {OPS[op]}") from None
    if value < 0 or (kind is int and value == 0 and op != "random_crop"):
        raise ArgumentError(f"transform {op}={text!r}: must be positive")
    return value


def parse_transform(text: str | None) -> Any:
    """``"random_crop=224:4,hflip"`` -> ``v2.Compose([v2.RandomCrop(224, padding=4), v2.RandomHorizontalFlip()])``;
    None or ``""`` -> None.

    Raises:
        ValueError: an unknown op or a bad number, naming the op and the accepted forms.
    """
    if not text or not text.strip():
        return None
    from torchvision.transforms import v2

    ops = []
    for part in (p.strip() for p in text.split(",")):
        name, _, arg = part.partition("=")
        if name not in OPS:
            raise ArgumentError(f"unknown transform {name!r} in {text!r}; use " + ", ".join(OPS.values()))
        if name == "random_crop":
            size, _, pad = arg.partition(":")
            ops.append(v2.RandomCrop(_number(name, size, int), padding=_number(name, pad, int) if pad else None))
        elif name == "random_resized_crop":
            ops.append(v2.RandomResizedCrop(_number(name, arg, int), antialias=True))
        else:
            p = _number(name, arg, float) if arg else 0.5
            ops.append((v2.RandomHorizontalFlip if name == "hflip" else v2.RandomVerticalFlip)(p=p))
    return v2.Compose(ops)


__all__ = ["OPS", "parse_transform"]
