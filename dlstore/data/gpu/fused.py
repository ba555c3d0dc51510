"""One fused gather for the GPU loader: crop (with padding) + flip + conversion + memory format.

The unfused path runs, per group of batches, ``index_select`` -> ``F.pad`` ->
window gather -> flip ``where`` -> conversion -> ``contiguous(channels_last)``:
about six passes over the group. All of crop, padding and flip only *move*
pixels, so they compose into one map from output coordinates to source
coordinates in the resident tensor, separable per axis::

    out[g, c, y, x] = data[idx[g], c, rows[g, y], cols[g, x]]     (rows/cols = -1: the fill value)

``rows`` (G, th) and ``cols`` (G, tw) are tiny; one advanced-index read with
broadcast index tensors produces the output directly in the requested memory
format (indexing in (G, th, tw, C) order gives channels_last once permuted).
Then the conversion (``ToDtype(scale=True)`` + ``Normalize``, when the data are
held as uint8) runs on the gathered batch: either the same float32 operations
as the unfused path (eager), or, compiled, a lookup in a (C, 256) table built
by those very operations, so that compiled and eager give the same bits on
any compiler (no FMA contraction can change a table lookup).

The random parameters are drawn by the ops' own ``sample`` methods, in the same
order, with the same shapes, device and generator as the unfused path: the
output is bit-identical to it (and so to torchvision per sample, which the
unfused path is held to by tests/fidelity).

Padding modes: every mode ``BatchRandomCrop`` has (constant with a fill value,
edge, reflect, symmetric): the per-axis map is torchvision's own ``F.pad``
applied to ``arange``. Not fused (the loader keeps the unfused path):
``BatchRandomResizedCrop`` (bilinear/antialiased resampling is a weighted sum,
not a gather), ``BatchCutout``, per-sample torchvision ops, plain callables,
more than one crop, stream mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...transforms.batch import (
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
)
from .padding import fill_vector, pad_map, unpadded_crop
from .resident import Resident

log = logging.getLogger(__name__)


def _axis(size: int, before: int, after: int, mode: str, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_map(size, before, after, mode), torch.arange(out)


def _fill(fill: Any, channels: int, dtype: torch.dtype) -> tuple[torch.Tensor]:
    return (fill_vector(fill, channels, dtype, "cpu"),)


def _arange(n: int) -> tuple[torch.Tensor]:
    return (torch.arange(n),)


def _gather(data: torch.Tensor, n: torch.Tensor, c: torch.Tensor, y: torch.Tensor, x: torch.Tensor,
            keep: torch.Tensor | None, fill: torch.Tensor | None, lut: torch.Tensor | None) -> torch.Tensor:
    """The fused kernel: one read of ``data`` at broadcast (n, c, y, x); fill where not ``keep``;
    ``lut[c, value]`` when given (the conversion of uint8 values, as a table)."""
    v = data[n, c, y, x]
    if keep is not None:
        v = torch.where(keep, v, fill)
    if lut is not None:
        v = lut[c, v.long()]
    return v


def _compiled_gather() -> Callable[..., torch.Tensor] | None:
    try:
        return torch.compile(_gather, dynamic=True)
    except Exception as exc:  # noqa: BLE001  (no backend here: the eager kernel gives the same bits)
        log.info("torch.compile unavailable (%s); the fused gather runs eagerly", exc)
        return None


class FusedGather:
    """Crop + flip + conversion + memory format of a group of batches, as one gather.

    Built by :meth:`build` from the loader's plan when every step is fusable. Call it
    with the group's sample indices and the loader's augmentation generator.

    Attributes:
        geometry: the crop / flip ops, in plan order (a first crop whose padding is the
            dataset's resident padding has it removed: it reads the padded copy).
        resident: whether that is the case.
        convert: the conversion step (the dataset's ``conversion`` or a ``BatchNormalize``), or None.
        compiled: whether the gather runs through ``torch.compile``.
    """

    def __init__(self, ds: Resident, geometry: list[Any], convert: Callable[..., torch.Tensor] | None, *,
                 channels_last: bool, compile: bool, resident: bool = False):
        self.ds = ds
        self.resident = resident
        self.geometry = geometry
        self.convert = convert
        self.channels_last = channels_last
        self._lut = None
        if convert is not None and ds.data.dtype == torch.uint8:
            c = ds.shape[0]
            levels = torch.arange(256, dtype=torch.uint8, device=ds.device).view(1, 1, 256, 1)
            # the conversion of every uint8 value, by the very operations the unfused path runs
            self._lut = convert(levels.expand(1, c, 256, 1).contiguous()).view(c, 256)
        self._kernel = _compiled_gather() if compile else None
        self.compiled = self._kernel is not None
        self._consts: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _const(self, make: Callable[..., tuple[torch.Tensor, ...]], *args: Any) -> tuple[torch.Tensor, ...]:
        """``make(*args)``: small tensors made on the host once and kept on the device, so that
        no group pays a host-to-device copy (a synchronisation, from pageable memory)."""
        key = (make.__name__, *args)
        if key not in self._consts:
            self._consts[key] = tuple(t.to(self.ds.device) for t in make(*args))
        return self._consts[key]

    @classmethod
    def build(cls, ds: Resident, plan: list[tuple[Callable[..., torch.Tensor], bool]], *,
              channels_last: bool, compile: bool = False) -> FusedGather | str:
        """The fused gather for ``plan`` on ``ds``, or the reason it does not apply (a str)."""
        if ds.mode not in ("preload", "uint8") or ds.data is None:
            return f"the dataset is in {ds.mode!r} mode (batches come from the store, not a resident tensor)"
        geometry: list[Any] = []
        convert = None
        for fn, _ in plan:
            if convert is not None:
                return f"{fn!r} runs after the conversion"
            if type(fn) in (BatchRandomCrop, BatchRandomHorizontalFlip):
                geometry.append(fn)
            elif type(fn) is BatchNormalize or fn is ds.conversion:
                convert = fn if fn is ds.conversion else (lambda x, op=fn: op.apply(x, {}))
            else:
                return f"{fn!r} is not a crop, a flip or the conversion"
        if sum(type(op) is BatchRandomCrop for op in geometry) > 1:
            return "more than one crop"
        resident = False
        if geometry and type(geometry[0]) is BatchRandomCrop and ds.padding != (0, 0, 0, 0):
            crop = unpadded_crop(geometry[0], ds)
            resident = crop is not geometry[0]
            geometry[0] = crop
        return cls(ds, geometry, convert, channels_last=channels_last, compile=compile, resident=resident)

    def __call__(self, idx: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        ds = self.ds
        data = ds.data
        device = data.device
        g = len(idx)
        c = data.shape[1]
        left, top, _, _ = ds.padding
        if self.resident:  # the first op, a crop, reads the padded copy: coordinates of the whole tensor
            h, w = data.shape[-2:]
            rows = torch.arange(h, device=device).expand(g, h)
            cols = torch.arange(w, device=device).expand(g, w)
        else:              # the samples as stored, inside any resident padding
            h, w = ds.shape[1:]
            rows = torch.arange(top, top + h, device=device).expand(g, h)
            cols = torch.arange(left, left + w, device=device).expand(g, w)
        fill = None
        for op in self.geometry:
            params = op.sample((g, c, h, w), generator=generator, device=device)
            if type(op) is BatchRandomHorizontalFlip:
                cols = torch.where(params["flip"].to(device)[:, None], cols.flip(1), cols)
                continue
            pl, pt, pr, pb = op.padding_for(h, w)
            th, tw = op.size
            ry = self._const(_axis, h, pt, pb, op.padding_mode, th)
            rx = self._const(_axis, w, pl, pr, op.padding_mode, tw)
            ry = ry[0][params["top"].to(device)[:, None] + ry[1]]
            rx = rx[0][params["left"].to(device)[:, None] + rx[1]]
            rows = torch.where(ry >= 0, rows.gather(1, ry.clamp_min(0)), -1)
            cols = torch.where(rx >= 0, cols.gather(1, rx.clamp_min(0)), -1)
            if op.padding_mode == "constant" and any((pl, pt, pr, pb)):
                fill = self._const(_fill, op.fill, c, data.dtype)[0]
            h, w = th, tw
        keep = None
        if fill is not None:
            keep = (rows >= 0)[:, :, None] & (cols >= 0)[:, None, :]        # (G, th, tw)
            rows, cols = rows.clamp_min(0), cols.clamp_min(0)
        channels = self._const(_arange, c)[0]
        n = idx.to(device).view(g, 1, 1, 1)
        if self.channels_last:      # gathered as (G, H, W, C): channels_last once permuted
            index = (n, channels.view(1, 1, 1, c), rows.view(g, h, 1, 1), cols.view(g, 1, w, 1))
            keep = None if keep is None else keep[..., None]
            fill = None if fill is None else fill.view(1, 1, 1, c)
        else:
            index = (n, channels.view(1, c, 1, 1), rows.view(g, 1, h, 1), cols.view(g, 1, 1, w))
            keep = None if keep is None else keep[:, None]
            fill = None if fill is None else fill.view(1, c, 1, 1)
        out = self._run(data, index, keep, fill)
        if self.channels_last:
            out = out.permute(0, 3, 1, 2)
        if self.convert is not None and not (self._lut is not None and self.compiled):
            out = self.convert(out)
        return out

    def _run(self, data: torch.Tensor, index: tuple[torch.Tensor, ...], keep: torch.Tensor | None,
             fill: torch.Tensor | None) -> torch.Tensor:
        if self._kernel is not None:
            try:
                return self._kernel(data, *index, keep, fill, self._lut)
            except Exception as exc:  # noqa: BLE001  (any compiler failure: the eager kernel is exact too)
                log.warning("torch.compile of the fused gather failed (%s); running it eagerly", exc)
                self._kernel = None
                self.compiled = False
        return _gather(data, *index, keep, fill, None)
