"""The ``dlstore`` command line: one module per group of commands. The CLI prints; the library returns.

Every module here imports only click at the top (torch and the rest inside the commands), so
``dlstore --help`` and every ``dlstore COMMAND --help`` answer at once.
"""

from __future__ import annotations

import click

from .bench import bench
from .common import parse_bytes
from .demo import demo
from .measure import profile, tune
from .store import convert, info, show, verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dlstore")
def main() -> None:
    """dlstore: precomputed image stores and fast loaders for PyTorch training."""


for _command in (convert, info, show, verify, demo, tune, profile, bench):
    main.add_command(_command)

__all__ = ["main", "parse_bytes"]
