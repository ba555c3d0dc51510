"""One version everywhere: the package metadata (``dlstore --version``), ``dlstore.__version__`` and
pyproject.toml, the one docs/migration.md's latest section is about."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from click.testing import CliRunner

import dlstore
from dlstore.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_one_version():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dlstore.__version__ == declared == importlib.metadata.version("dlstore")
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and declared in result.output
    major_minor = ".".join(declared.split(".")[:2])
    latest = re.findall(r"^## .*?(\d+\.\d+) to (\d+\.\d+)", (ROOT / "docs" / "migration.md").read_text(), re.M)
    assert latest and latest[0][1] == major_minor, latest
