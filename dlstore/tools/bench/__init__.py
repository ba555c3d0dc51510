"""``dlstore bench``: storage formats measured on a given disk.

* ``options``: what is measured (variants, orders, cache states, workers);
* ``run``: the measurement rounds (machine probes come from ``dlstore._system``);
* ``report``: tables, plot and recommendation.
"""

from .options import Variant, default_formats, parse_variants
from .report import BenchReport
from .run import run_bench

__all__ = ["BenchReport", "Variant", "default_formats", "parse_variants", "run_bench"]
