"""``dlstore tune`` and ``dlstore profile``: which loader settings, and does the loop wait for data."""

from __future__ import annotations

import click

from ..errors import DlstoreError
from .common import check_device, fail, renamed


@click.command()
@click.argument("path", metavar="STORE_OR_FOLDER", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True,
              help="The batch size you train with.")
@click.option("--device", default=None,
              help="Training device (cpu, cuda, cuda:1): batches are copied there inside the timing; "
                   "pin_memory is tried only for CUDA. Default: stop at the host.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds for the whole search.")
@click.option("--max-workers", type=click.IntRange(min=1), default=None,
              help="Highest num_workers to try (default: a little over the usable CPUs).")
@click.option("--static", default="",
              help='For a raw image FOLDER: static transforms applied per sample, as your current '
                   'pipeline does (e.g. "resize=256,center_crop=224"); PILToTensor follows.')
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def tune(path, batch_size, device, budget, max_workers, static, as_json):
    """Measure DataLoader settings on STORE_OR_FOLDER and recommend the fastest.

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
                          cpus=cpus, log=lambda line: click.echo(line, err=True))
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
    click.echo(f"recommended ({result.speedup:.2f}x workers=0): {result.call()}")


@click.command()
@click.argument("path", metavar="STORE", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True)
@click.option("--num-workers", "workers", type=click.IntRange(min=0), default=None,
              help="num_workers of the DataLoader (default: min(4, usable CPUs)).")
@renamed("--num-workers", "the DataLoader's num_workers")
@click.option("--prefetch-factor", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--pin-memory", is_flag=True, help="pin_memory=True (useful with --device cuda).")
@click.option("--steps", type=click.IntRange(min=2), default=50, show_default=True,
              help="Training steps to measure (the loader restarts if an epoch is shorter).")
@click.option("--step", "step_spec", default="conv", show_default=True,
              help="Synthetic step: conv (small conv net forward/backward), matmul:N, or sleep:MS "
                   "(an accelerator step that leaves the CPU free).")
@click.option("--device", default="cpu", show_default=True, help="Where the step runs.")
@click.option("--static", default="", help="For a raw image folder: static transforms per sample.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def profile(path, batch_size, workers, prefetch_factor, pin_memory, steps, step_spec, device, static,
            as_json):
    """Profile a training loop on STORE: time waiting for data vs time in a synthetic step."""
    import itertools
    import json

    from torch.utils.data import DataLoader

    from .._system import usable_cpus
    from ..tools.profiling import TimedDataset, profile_loader, synthetic_step
    from ..tools.tuning import loader_kwargs, open_for_tuning

    check_device(device)
    workers = min(4, usable_cpus()) if workers is None else workers
    try:
        step = synthetic_step(step_spec, device=device)
        dataset = TimedDataset(open_for_tuning(path, static=static or None), max_workers=max(workers, 1))
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)
    kwargs = loader_kwargs(batch_size, workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory)
    loader = DataLoader(dataset, shuffle=True, **kwargs)

    def batches():  # as many epochs as it takes to reach --steps
        while True:
            yield from loader

    with profile_loader(itertools.islice(batches(), steps), device=device) as p:
        for x, y in p:
            step(x, y)
    report = p.report()
    if as_json:
        stats = {kind: vars(s) for kind, s in dataset.stats().items()}
        click.echo(json.dumps({"loader": kwargs, "step": step_spec, "device": device,
                               "report": report.to_json(), "dataset_latency": stats}, indent=2))
        return
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    click.echo(f"loader    DataLoader(dataset, {args}, shuffle=True)")
    click.echo(f"step      {step_spec} on {device}")
    click.echo("per-sample fetch latency (TimedDataset, all workers):")
    click.echo("  " + dataset.report().replace("\n", "\n  "))
    click.echo(str(report))


