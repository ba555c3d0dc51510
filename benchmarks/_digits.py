"""The digits of benchmarks/train_parity.py: the ImageFolder written from scikit-learn's
``load_digits``, the torchvision pipeline, the store, the two test sets, and the pixel check
that holds a path's batch to torchvision's crop (see train_parity.py's docstring)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

import dlstore

SIZE, PADDING = 32, 4
TEST_FRACTION = 0.25
SHIFT_SEED = 12345


# --- data ------------------------------------------------------------------------------------

def write_digits(root: Path, *, test_fraction: float = TEST_FRACTION, seed: int = 0
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """sklearn's digits as ``root/train`` and ``root/test`` ImageFolders of 32x32 grayscale PNGs.

    Class folders are ``0`` ... ``9`` (ImageFolder's sorted order is the digit's value), files
    ``NNNN.png`` after the sample's index in ``load_digits``.

    Returns:
        Per split, the pixels written (uint8 (N, 1, 32, 32)) and the labels, in ImageFolder's order.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    rng = np.random.RandomState(seed)
    written: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(digits.target == label))
        n_test = round(len(members) * test_fraction)
        for split, chosen in (("test", members[:n_test]), ("train", members[n_test:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in sorted(chosen):
                img = Image.fromarray(images[i], mode="L").resize((SIZE, SIZE), Image.BILINEAR)
                img.save(folder / f"{i:04d}.png")
                written[split][0].append(np.asarray(img))
                written[split][1].append(label)
    return {split: (torch.from_numpy(np.stack(x))[:, None], torch.tensor(y)) for split, (x, y) in written.items()}


def pipeline(mean: float, std: float, *, augment: bool = True) -> v2.Compose:
    """The torchvision pipeline every path implements (``augment=False``: the evaluation one)."""
    crop = [v2.RandomCrop(SIZE, padding=PADDING)] if augment else []
    return v2.Compose([v2.Grayscale(1), v2.CenterCrop(SIZE), v2.PILToTensor(), *crop,
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize([mean], [std])])


@dataclasses.dataclass
class Setup:
    """Everything the paths share: folders, store, pipeline, the reference pixels, the test sets."""

    train_dir: Path
    test_dir: Path
    store: Path
    mean: float
    std: float
    pipeline: v2.Compose
    hybrid: dlstore.HybridTransform
    base: torch.Tensor       # the training pixels written to the PNGs, uint8 (N, 1, 32, 32), ImageFolder order
    test_x: torch.Tensor     # the test pixels through ToDtype + Normalize: float32 (M, 1, 32, 32)
    test_y: torch.Tensor
    shifted_x: torch.Tensor  # the test pixels through RandomCrop (seed SHIFT_SEED) + ToDtype + Normalize
    convert_s: float


def prepare(root: Path) -> Setup:
    """Write the folders, measure mean/std on the training pixels, convert the store, make the test sets."""
    written = write_digits(root)
    base, test_u8, test_y = written["train"][0], *written["test"]
    pixels = base.double() / 255
    mean, std = round(pixels.mean().item(), 4), round(pixels.std().item(), 4)
    pipe = pipeline(mean, std)
    hybrid = dlstore.split_transforms(pipe)
    store = root / "digits.shards"
    t0 = time.perf_counter()
    dlstore.convert(root / "train", store, static=hybrid, workers=0, progress=False)
    convert_s = time.perf_counter() - t0
    # The test sets as torchvision makes them from the same pixels (the PNGs are lossless; whether
    # the decoders give these pixels back is the pixel check's business).
    to_float = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([mean], [std])])
    crop = v2.RandomCrop(SIZE, padding=PADDING)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SHIFT_SEED)
        shifted = torch.stack([crop(x) for x in test_u8])
    return Setup(root / "train", root / "test", store, mean, std, pipe, hybrid, base,
                 to_float(test_u8), test_y, to_float(shifted), convert_s)


def pixel_check(images: torch.Tensor, base: torch.Tensor, setup: Setup, *, tolerance: float) -> dict:
    """Does each of ``images`` equal torchvision's crop+ToDtype+Normalize of ``base`` for some offset?

    Args:
        images: a batch from a path, (B, 1, 32, 32), any float dtype, any device.
        base: the pixels written to those samples' PNGs, uint8 (B, 1, 32, 32).
        tolerance: largest absolute difference that counts as equal.

    Returns:
        matched (samples within tolerance for some offset), samples, distinct (offsets among the
        matched; 1 for a batch would mean one crop shared by every sample), worst (largest,
        over samples, of the smallest difference over offsets).
    """
    h, w = base.shape[-2:]
    padded = v2.functional.pad(base, [PADDING] * 4, fill=0)                  # uint8: exact
    ref = v2.Normalize([setup.mean], [setup.std])(v2.ToDtype(torch.float32, scale=True)(padded))
    windows = ref.unfold(2, h, 1).unfold(3, w, 1)                             # B, C, Y, X, h, w
    out = images.detach().to("cpu", torch.float32)[:, :, None, None]
    error = (windows - out).abs().amax(dim=(1, 4, 5)).flatten(1)             # B, Y*X
    best, where = error.min(dim=1)
    ok = best <= tolerance
    return {"matched": int(ok.sum()), "samples": len(images), "distinct": len(set(where[ok].tolist())),
            "worst": float(best.max())}
