"""``dlstore tune`` and ``dlstore profile``: which loader settings, and does the loop wait for data."""

from __future__ import annotations

import os

import click

from ..errors import DlstoreError
from .common import STORE_BACKENDS, check_device, fail, gone, renamed


def _threads_gone(value: str) -> str:
    new = "--backend dataloader" if value.strip() == "0" else f"--backend threads --num-threads {value}"
    return f"--threads is gone since 0.3: pass {new}"


def _shm_ring_gone(value: bool) -> str:
    new = "--backend ring (with --num-workers N)" if value else "--backend dataloader"
    return f"--{'' if value else 'no-'}shm-ring is gone since 0.3: pass {new}"


@click.command()
@click.argument("path", metavar="STORE_OR_FOLDER", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True,
              help="The batch size you train with.")
@click.option("--device", default=None,
              help="Training device (cpu, cuda, cuda:1): batches are copied there inside the timing; "
                   "pin_memory is tried only for CUDA. Default: stop at the host.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds for the search (the baseline, the default loader and the confirmation always run).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Measurements of each setting; its median decides.")
@click.option("--max-workers", type=click.IntRange(min=1), default=None,
              help="Highest num_workers to try (default: a little over the usable CPUs).")
@click.option("--static", default="",
              help='For a raw image FOLDER: static transforms applied per sample, as your current '
                   'pipeline does (e.g. "resize=256,center_crop=224"); PILToTensor follows.')
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (dlstore profile --from-tune reads it).")
def tune(path, batch_size, device, budget, repeats, max_workers, static, as_json):
    """Measure loader settings on STORE_OR_FOLDER and recommend the fastest.

    STORE_OR_FOLDER is a dlstore store or a raw ImageFolder tree (decoded per
    sample, as torchvision does), so you can tune your current pipeline too.
    """
    import json

    from .._system import cpu_info
    from ..tools.tuning import open_for_tuning
    from ..tools.tuning import tune as run_tune

    check_device(device)
    try:
        dataset = open_for_tuning(path, static=static or None)
        cpus = cpu_info()
        if not as_json:
            click.echo(f"{path}: {len(dataset)} samples, batch {batch_size}, "
                       f"device {device or 'none (host only)'}, budget {budget:g} s")
            click.echo(f"cpus: {cpus}")
        result = run_tune(dataset, batch_size, device=device, budget=budget, max_workers=max_workers,
                          repeats=repeats, cpus=cpus, log=lambda line: click.echo(line, err=True))
    except RuntimeError as exc:
        if "stack expects each tensor to be equal size" in str(exc):
            fail(ValueError(f"{path}: samples have different sizes, so they cannot be batched; add a "
                            "size-fixing op to --static (e.g. center_crop=224)"))
        raise
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    click.echo(result.table())
    for warning in result.warnings:
        click.echo(f"warning: {warning}")
    if result.best.note:
        click.echo(f"note: {result.best.note}")
    if result.best.kwargs == result.baseline.kwargs:
        click.echo(f"recommended (nothing beat num_workers=0): {result.call()}")
    else:
        click.echo(f"recommended ({result.speedup:.2f}x num_workers=0, measured in turn beside it "
                   f"in {sum(t.stage == 'confirm' for t in result.trials) // 2} pairs): {result.call()}")


def _loader_options(f):
    """The loader's own arguments, as dlstore.loader and DataLoader name them; given ones override --from-tune."""
    options = [
        click.option("--from-tune", "from_tune", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Profile what dlstore tune recommended: the file `dlstore tune --json` wrote."),
        click.option("--loader", "which", type=click.Choice(["auto", "dlstore", "dataloader"]), default="auto",
                     show_default=True,
                     help="dlstore: dlstore.loader (its back-end: --backend); dataloader: torch's DataLoader. "
                          "auto: as tune's kwargs mean (dlstore when they name a backend), dlstore when "
                          "--backend or --num-threads is given, else dlstore for a store, DataLoader for a folder."),
        click.option("--num-workers", "workers", type=click.IntRange(min=0), default=None,
                     help="Worker processes (default: DataLoader min(4, usable CPUs); dlstore.loader 0)."),
        renamed("--num-workers", "the loader's num_workers"),
        click.option("--backend", type=click.Choice(STORE_BACKENDS), default=None,
                     help="dlstore.loader's back-end: threads (in this process), ring (--num-workers processes "
                          "writing into shared memory), dataloader (its torch DataLoader back-end). Default: auto."),
        click.option("--num-threads", type=click.IntRange(min=1), default=None,
                     help="Threads of --backend threads (default: the usable CPUs, at most 8)."),
        gone("--threads", _threads_gone, type=str),
        gone("--shm-ring/--no-shm-ring", _shm_ring_gone),
        click.option("--prefetch-factor", type=click.IntRange(min=1), default=None),
        click.option("--pin-memory", is_flag=True, default=None, help="pin_memory=True (useful with --device cuda)."),
        click.option("--persistent-workers/--no-persistent-workers", default=None),
        click.option("--transform", default="",
                     help='Read-time random transforms, as you train with: e.g. "random_crop=224:4,hflip" or '
                          '"random_resized_crop=224,hflip".'),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command()
@click.argument("path", metavar="STORE_OR_FOLDER", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="The batch size you train with (default: --from-tune's).")
@_loader_options
@click.option("--steps", type=click.IntRange(min=2), default=50, show_default=True,
              help="Training steps to measure (the loader restarts if an epoch is shorter).")
@click.option("--step", "step_spec", default="conv", show_default=True,
              help="Synthetic step: conv (small conv net forward/backward), matmul:N, or sleep:MS "
                   "(an accelerator step that leaves the CPU free).")
@click.option("--device", default="cpu", show_default=True, help="Where the step runs.")
@click.option("--static", default="", help="For a raw image folder: static transforms per sample.")
@click.option("--compare", "compare", default=None, metavar="imagefolder:PATH",
              help="Also run your current pipeline on the same step: torchvision ImageFolder over the raw "
                   "image folder PATH (the store's static transforms per sample, then --transform), through "
                   "torch's DataLoader with the settings given (--num-workers, default min(4, usable CPUs)).")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the timeline(s), one panel per loader: wait vs step over time, GPU "
                   "utilisation on CUDA (needs pip install 'dlstore[plot]').")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), default=None,
              help="Write a torch.profiler trace of the measured steps to this folder (TensorBoard, "
                   "Perfetto), with the dlstore.* stages as named ranges; with --compare one subfolder a loader.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def profile(path, batch_size, from_tune, which, workers, backend, num_threads, prefetch_factor, pin_memory,
            persistent_workers, transform, steps, step_spec, device, static, compare, plot, trace_dir, as_json):
    """Profile a training loop on STORE_OR_FOLDER: time waiting for data vs time in a synthetic step,
    step by step (and GPU utilisation on CUDA)."""
    import json

    from ..tools.profile_run import run_profile
    from ..tools.profiling import synthetic_step
    from ..tools.transform_spec import parse_transform
    from ..tools.tuning import open_for_tuning

    check_device(device)
    try:
        if plot:
            from ..tools.timeline_plot import check_matplotlib

            check_matplotlib()
        folder = _compare_folder(compare) if compare else None
        kwargs = _from_tune(from_tune) if from_tune else {}
        given = {"batch_size": batch_size, "num_workers": workers, "backend": backend, "num_threads": num_threads,
                 "prefetch_factor": prefetch_factor, "pin_memory": pin_memory,
                 "persistent_workers": persistent_workers}
        if backend not in (None, "auto", "threads") and num_threads is None:
            kwargs.pop("num_threads", None)     # tune's thread count, of a back-end no longer asked for
        kwargs.update({k: v for k, v in given.items() if v is not None})
        if "batch_size" not in kwargs:
            raise click.UsageError("give --batch-size (or --from-tune with tune's kwargs)")
        if trace_dir:
            _quiet_kineto_without_cuda()
        step = synthetic_step(step_spec, device=device)
        dataset = open_for_tuning(path, static=static or None, transform=parse_transform(transform))
        store_loader = _which(which, kwargs, dataset, from_tune is not None)
        kwargs = _complete(kwargs, store_loader)
        other = None
        if folder is not None:   # the current pipeline first, as the plot's top panel
            current = open_for_tuning(folder, static=static or getattr(dataset, "manifest", {}).get("static"),
                                      transform=parse_transform(transform))
            other = run_profile(current, _complete({k: v for k, v in kwargs.items() if k not in STORE_LOADER_ONLY},
                                                   False),
                                steps=steps, step=step, step_spec=step_spec, device=device, store_loader=False,
                                transform=transform, label=f"current pipeline: ImageFolder({folder})",
                                trace_dir=os.path.join(trace_dir, "imagefolder") if trace_dir else None)
        result = run_profile(dataset, kwargs, steps=steps, step=step, step_spec=step_spec, device=device,
                             store_loader=store_loader, transform=transform, label=f"dlstore: {path}",
                             trace_dir=os.path.join(trace_dir, "dlstore") if trace_dir and other else trace_dir)
        if plot:
            from ..tools.timeline_plot import plot_timelines

            plot_timelines([r.timeline for r in (other, result) if r is not None], plot,
                           title=f"dlstore profile: batch {kwargs['batch_size']}, step {step_spec} on {device}")
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)
    if as_json:
        click.echo(json.dumps(dict(result.to_json(), compare=other.to_json() if other else None), indent=2))
        return
    if other is not None:
        click.echo(f"== current pipeline: ImageFolder {folder} ==\n{other}\n\n== dlstore: {path} ==")
    click.echo(str(result))
    if other is not None:
        a, b = other.timeline, result.timeline
        click.echo(f"compare   wait share {a.wait_share():.1%} (ImageFolder) -> {b.wait_share():.1%} (dlstore); "
                   f"ImageFolder took {a.duration / max(b.duration, 1e-9):.2f}x dlstore's time for {len(b.steps)} steps")
    if plot:
        click.echo(f"plot      {plot}")
    if trace_dir:
        click.echo(f"trace     {trace_dir} (tensorboard --logdir {trace_dir}, or open the .pt.trace.json in "
                   "https://ui.perfetto.dev)")


def _quiet_kineto_without_cuda() -> None:
    """Keep torch's profiler from printing ``ERROR: ... gpuGetDeviceCount failed`` on a machine without CUDA.

    The trace asks for CPU activities only there, yet kineto (the profiler's back-end) queries the
    CUDA runtime for device properties when a trace stops, and logs the failure as an error. Its
    log level comes from KINETO_LOG_LEVEL, read once when the first trace of the process starts;
    5 (kineto's USDT level) drops its errors (4) and below. One the user set is kept.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def _compare_folder(spec: str) -> str:
    kind, sep, folder = spec.partition(":")
    if kind != "imagefolder" or not sep or not folder:
        raise ValueError(f"--compare {spec!r}: expected imagefolder:PATH (the raw image folder the store "
                         "was converted from)")
    if not os.path.isdir(folder):
        raise ValueError(f"--compare {spec!r}: {folder} is not a folder")
    return folder


# dlstore.loader's own arguments: not DataLoader's
STORE_LOADER_ONLY = ("backend", "num_threads")


def _from_tune(path: str) -> dict:
    import json

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from-tune {path}: not a JSON file ({exc})") from None
    kwargs = data.get("kwargs", data) if isinstance(data, dict) else None
    if not isinstance(kwargs, dict) or "batch_size" not in kwargs:
        raise ValueError(f"--from-tune {path}: expected `dlstore tune --json` output (a \"kwargs\" object "
                         "with batch_size)")
    old = [name for name in ("threads", "shm_ring") if name in kwargs]
    if old:
        said = ", ".join(f"{name}={kwargs[name]!r}" for name in old)
        raise ValueError(f"--from-tune {path}: its kwargs say {said}, dlstore 0.2's spelling; 0.3 says "
                         f"{_backend_of(kwargs)}: edit the file, or run dlstore tune --json again")
    return dict(kwargs)


def _backend_of(old: dict) -> str:
    """What 0.2's ``threads=`` / ``shm_ring=`` kwargs say in 0.3's words."""
    if old.get("shm_ring"):
        return "backend='ring'"
    if old.get("threads"):
        return f"backend='threads', num_threads={old['threads']!r}"
    return "backend='dataloader'"


def _which(which: str, kwargs: dict, dataset, tuned: bool) -> bool:
    from ..data.dataset import StoreDataset
    from ..tools.throughput import uses_store_loader

    if which == "dlstore" or (which == "auto" and (uses_store_loader(kwargs) or "num_threads" in kwargs)):
        if not isinstance(dataset, StoreDataset):
            raise ValueError("dlstore.loader reads stores (dlstore.open_dataset); for an image folder use "
                             "--loader dataloader")
        return True
    if which == "dataloader" or tuned:
        return False
    return isinstance(dataset, StoreDataset)


def _complete(kwargs: dict, store_loader: bool) -> dict:
    """Fill the DataLoader's defaults and drop what it refuses without workers."""
    from .._system import usable_cpus

    kwargs = dict(kwargs)
    if store_loader:
        return kwargs
    for name in STORE_LOADER_ONLY:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is dlstore.loader's; drop it or use --loader dlstore")
    kwargs.setdefault("num_workers", min(4, usable_cpus()))
    kwargs.setdefault("pin_memory", False)
    if not kwargs["num_workers"]:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs
