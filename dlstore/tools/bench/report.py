"""The bench report: tables (text, Markdown), the plot, the recommendation."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT_VERSION = 1


# --------------------------------------------------------------------------- the report


@dataclass
class BenchReport:
    """Everything one ``run_bench`` measured; ``to_json()`` is what ``report.json`` holds.

    Attributes:
        machine: ``machine_info()`` plus ``disk``: ``disk_info()`` of the work folder.
        settings: what was asked for (formats, workers, cache states, ...).
        data: the image folder read (samples, classes, bytes, where it came from).
        disk: ``disk_bandwidth()`` of the work folder.
        stores: per variant name: size on disk, bytes/sample, conversion time and rate.
        reads: one dict per (variant, order, workers, cache) cell with every run.
        recommendation: the fastest format on this disk and its ratio to ImageFolder.
        notes: caveats found while running (unverified cold runs, no plot, ...).
    """

    machine: dict[str, Any]
    settings: dict[str, Any]
    data: dict[str, Any]
    disk: dict[str, Any]
    stores: dict[str, dict[str, Any]]
    reads: list[dict[str, Any]]
    recommendation: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"report_version": REPORT_VERSION, "created": self.created, "machine": self.machine,
                "settings": self.settings, "data": self.data, "disk": self.disk, "stores": self.stores,
                "reads": self.reads, "recommendation": self.recommendation, "notes": self.notes}

    def cell(self, variant: str, order: str, workers: int, cache: str) -> dict[str, Any] | None:
        for row in self.reads:
            if (row["format"], row["order"], row["workers"], row["cache"]) == (variant, order, workers, cache):
                return row
        return None

    # ---- text forms

    def _header(self) -> list[tuple[str, str]]:
        m, d, s = self.machine, self.machine.get("disk", {}), self.settings
        ram = f"{m['ram_bytes'] / 2**30:.1f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
        rot = {True: ", kernel reports rotational", False: ", non-rotational", None: ""}[d.get("rotational")]
        model = f" ({d['model']})" if d.get("model") else ""
        free = f", {d['free_bytes'] / 2**30:.0f} GiB free" if d.get("free_bytes") is not None else ""
        disk = self.disk
        verified = "" if disk["cold_verified"] else " (NOT verified cold: see notes)"
        return [
            ("machine", f"{m['cpu'] or 'unknown CPU'}, {m['usable_cpus']} usable CPU(s) of {m['logical_cpus']}, {ram}"),
            ("disk", f"{d.get('path')}: {d.get('fstype')} on {d.get('device')}{model}{rot}{free}"),
            ("raw disk", f"{disk['read_mb_s']['median']:,.0f} MB/s sequential read, cold (median of "
             f"{len(disk['read_mb_s']['runs'])}, {disk['read_mb_s']['min']:,.0f}-{disk['read_mb_s']['max']:,.0f})"
             f"{verified}; write+fsync {disk['write_mb_s']:,.0f} MB/s; {disk['file_bytes'] / 2**20:,.0f} MiB file"),
            ("data", f"{self.data['samples']} images in {self.data['classes']} classes from {self.data['source']}"),
            ("settings", f"static {s['static']}, batch {s['batch_size']}, stores read with backend "
             f"{self.backends()}, {s['repeats']} round(s), eviction {s['eviction']}, torch threads {s['torch_threads']}"),
            ("versions", f"dlstore {m.get('dlstore')}, torch {m['torch']}, torchvision {m['torchvision']}, "
             f"python {m['python']}"),
        ]

    def backends(self) -> str:
        """The ``backend`` asked for, and (for ``auto``) what built the stores' batches per num_workers value."""
        built: dict[int, set[str]] = {}
        for r in self.reads:
            if r.get("backend"):
                built.setdefault(r["workers"], set()).add(r["backend"])
        said = ", ".join(f"{'/'.join(sorted(names))} at num_workers={w}" for w, names in sorted(built.items()))
        asked = self.settings.get("backend", "auto")
        return f"{asked} ({said})" if asked == "auto" and said else asked

    def _store_rows(self) -> list[list[str]]:
        rows = []
        for name, st in self.stores.items():
            conv = st.get("convert")
            rows.append([name, st["encoding"], f"{st['bytes'] / 2**20:,.1f}", f"{st['bytes_per_sample']:,.0f}",
                         f"{st['size_vs_source']:.2f}x",
                         "-" if conv is None else f"{conv['seconds']:.2f}",
                         "-" if conv is None else f"{conv['images_per_s']:,.0f}"])
        return rows

    _STORE_HEAD = ["format", "encoding", "size MiB", "B/sample", "vs source", "convert s", "images/s"]
    _READ_HEAD = ["format", "order", "workers", "cache", "samples/s", "spread", "steady/s", "MB/s", "p50 ms", "p95 ms",
                  "resident", "% disk", "vs ImageFolder"]

    def _read_rows(self) -> list[list[str]]:
        rows = []
        for r in self.reads:
            sps = r["samples_per_s"]
            rows.append([
                r["format"], r["order"], str(r["workers"]), r["cache"] + ("" if r["verified"] else "?"),
                f"{sps['median']:,.0f}", f"{sps['spread'] * 100:.0f}%",
                "-" if r["steady_samples_per_s"] is None or r["cache"] == "cold"
                else f"{r['steady_samples_per_s']['median']:,.0f}",
                f"{r['mb_per_s']['median']:,.1f}",
                f"{r['batch_latency_ms']['p50']:.1f}", f"{r['batch_latency_ms']['p95']:.1f}",
                f"{max(r['resident_at_start']):.2f}" if r["cache"] == "cold" else f"{min(r['resident_at_start']):.2f}",
                "-" if r.get("disk_fraction") is None else f"{r['disk_fraction'] * 100:.0f}%",
                "-" if r.get("vs_imagefolder") is None else f"{r['vs_imagefolder']:,.1f}x",
            ])
        return rows

    def table(self) -> str:
        """The plain-text report the CLI prints."""
        lines = [f"{k:9s} {v}" for k, v in self._header()] + [""]
        lines += _text_table(self._STORE_HEAD, self._store_rows()) + [""]
        lines += _text_table(self._READ_HEAD, self._read_rows())
        lines += ["", _LEGEND]
        lines += ["", self.recommendation["text"]]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        """``report.md``: the same content as Markdown tables."""
        lines = ["# dlstore bench", ""]
        lines += [f"- {k}: {v}" for k, v in self._header()]
        lines += ["", f"**{self.recommendation['text']}**", "", "## Stores", ""]
        lines += _md_table(self._STORE_HEAD, self._store_rows())
        lines += ["", "## Reads", "",
                  _LEGEND, ""]
        lines += _md_table(self._READ_HEAD, self._read_rows())
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out: str | os.PathLike) -> dict[str, Path]:
        """Write ``report.json``, ``report.md`` and (matplotlib installed) ``report.png`` into ``out``.

        Returns:
            kind (``json``, ``md``, ``png``) -> path written.
        """
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        try:   # installed but unusable (built for another numpy) counts as absent: the run's numbers stand
            import matplotlib  # noqa: F401
        except ImportError as exc:
            why = "is not installed" if importlib.util.find_spec("matplotlib") is None else f"cannot be imported ({exc})"
            note = f"matplotlib {why}: report.png skipped (pip install 'dlstore[plot]')"
            if note not in self.notes:
                self.notes.append(note)
        else:
            written["png"] = _plot(self, out / "report.png")
        written["json"] = out / "report.json"
        written["json"].write_text(json.dumps(self.to_json(), indent=1) + "\n")
        written["md"] = out / "report.md"
        written["md"].write_text(self.markdown())
        return written


_LEGEND = ("samples/s: one pass over the data, median over rounds; spread: (max-min)/median; steady/s: "
           "after each worker's first batch (which pays per-epoch set-up), warm runs with 8+ further batches per "
           "worker only (cold, readahead during the first batches fetches much of a small store); MB/s: samples/s x the store's "
           "bytes/sample on disk; p50/p95: per-batch latency; resident: fraction of the store's pages in the "
           "page cache when the run started (cold: max over rounds, warm: min); % disk: cold MB/s over the raw "
           "sequential read bandwidth; vs ImageFolder: same order, workers and cache; '?' after cache: not verified")


def _text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or not _numeric(c) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text == "-")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    right = [bool(rows) and _numeric(rows[0][i]) for i in range(len(head))]
    return (["| " + " | ".join(head) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _plot(report: BenchReport, path: Path) -> Path:
    """Bar chart: samples/s per format, cold vs warm (random order when measured, best workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = "random" if "random" in report.settings["orders"] else report.settings["orders"][0]
    names = list(report.stores)
    caches = report.settings["cache"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(names), 4))
    width = 0.8 / len(caches)
    for k, cache in enumerate(caches):
        values = [_best(report.reads, name, order, cache)[0] for name in names]
        ax.bar([i + (k - (len(caches) - 1) / 2) * width for i in range(len(names))], values, width, label=cache)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (best num_workers)")
    ax.set_title(f"dlstore bench: {order} order, batch {report.settings['batch_size']}, "
                 f"{report.machine.get('disk', {}).get('fstype')} at {report.machine.get('disk', {}).get('path')}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _best(reads: list[dict[str, Any]], name: str, order: str, cache: str) -> tuple[float, int | None]:
    """(median samples/s, workers) of the best workers value of a format in one (order, cache)."""
    best: tuple[float, int | None] = (0.0, None)
    for r in reads:
        if (r["format"], r["order"], r["cache"]) == (name, order, cache):
            if r["samples_per_s"]["median"] > best[0]:
                best = (r["samples_per_s"]["median"], r["workers"])
    return best


def _overlap(reads: list[dict[str, Any]], a: tuple, b: tuple) -> bool:
    """Whether two cells' samples/s ranges (min..max over rounds) overlap."""
    rows = {(r["format"], r["order"], r["workers"], r["cache"]): r["samples_per_s"] for r in reads}
    ra, rb = rows[a], rows[b]
    return ra["min"] <= rb["max"] and rb["min"] <= ra["max"]


def recommend(reads: list[dict[str, Any]], names: list[str], orders: list[str], caches: list[str],
               disk: dict[str, Any]) -> dict[str, Any]:
    cache = "cold" if "cold" in caches else caches[0]
    order = "random" if "random" in orders else orders[0]
    stores = [n for n in names if n != "imagefolder"]
    where = f"{disk.get('fstype')} at {disk.get('path')}"
    setting = f"{cache} cache, {order} order, best num_workers"
    if not stores:
        rate, workers = _best(reads, "imagefolder", order, cache)
        return {"format": None, "cache": cache, "order": order, "workers": workers, "samples_per_s": rate,
                "vs_imagefolder": None,
                "text": f"Recommendation: none (only imagefolder measured: {rate:,.0f} samples/s, {setting})"}
    ranked = sorted(((_best(reads, n, order, cache), n) for n in stores), key=lambda t: -t[0][0])
    (rate, workers), name = ranked[0]
    result: dict[str, Any] = {"format": name, "cache": cache, "order": order, "workers": workers,
                              "samples_per_s": rate, "vs_imagefolder": None}
    text = (f"Recommendation: {name} is the fastest format on this disk ({where}): {rate:,.0f} samples/s "
            f"({setting}: {workers})")
    if "imagefolder" in names:
        base, base_workers = _best(reads, "imagefolder", order, cache)
        if base > 0:
            result["vs_imagefolder"] = rate / base
            text += f", {rate / base:,.1f}x ImageFolder ({base:,.0f} samples/s with num_workers={base_workers})"
    if len(ranked) > 1:
        (second_rate, second_workers), second = ranked[1]
        if second_rate > 0:
            tie = _overlap(reads, (name, order, workers, cache), (second, order, second_workers, cache))
            result["tied_with"] = second if tie else None
            text += f"; next: {second} ({rate / second_rate:.2f}x slower" + (
                "; their ranges over rounds overlap: a tie in this run)" if tie else ")")
    if cache == "cold" and "warm" in caches:  # the answer when the data fits in the page cache
        (w_rate, w_workers), w_name = max(((_best(reads, n, order, "warm"), n) for n in stores),
                                          key=lambda t: t[0][0])
        result["warm"] = {"format": w_name, "workers": w_workers, "samples_per_s": w_rate, "vs_imagefolder": None}
        text += f". With a warm cache (data fits in RAM): {w_name}, {w_rate:,.0f} samples/s"
        w_base, _ = _best(reads, "imagefolder", order, "warm") if "imagefolder" in names else (0.0, None)
        if w_base > 0:
            result["warm"]["vs_imagefolder"] = w_rate / w_base
            text += f", {w_rate / w_base:,.1f}x ImageFolder"
    result["text"] = text
    return result
