"""``dlstore bench``: storage formats measured on a given disk.

* ``options``: the vocabulary of what is measured (variants, orders, cache states, workers);
* ``settings``: one run's settings, parsed and checked once (``BenchSettings``), and the check
  of SRC (an image folder, not a store);
* ``run``: the run's steps: prepare the images, convert, measure, summarise;
* ``reading``: one timed pass over a store or the image folder;
* ``probes``: the machine (hardware, disks, page cache, raw bandwidth);
* ``report``: tables, plot and recommendation.
"""

from .options import Variant, default_formats, parse_variants
from .report import BenchReport
from .run import run_bench
from .settings import BenchSettings, check_source

__all__ = ["BenchReport", "BenchSettings", "Variant", "check_source", "default_formats", "parse_variants", "run_bench"]
