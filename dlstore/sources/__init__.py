"""Where samples come from: an ImageFolder-exact folder scan, decoding with guards, demo images.

Nothing here knows about stores or transforms.
"""

from .decode import DEFAULT_MAX_PIXELS, pil_loader
from .folder import IMG_EXTENSIONS, UNLABELLED, Source, find_classes, scan

__all__ = ["DEFAULT_MAX_PIXELS", "IMG_EXTENSIONS", "UNLABELLED", "Source", "find_classes", "pil_loader", "scan"]
