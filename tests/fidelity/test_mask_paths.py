"""The mask column of the fidelity harness: on every read path of a segmentation store, the masks are
torchvision v2's ``Mask`` kernels with the parameters the images were drawn with.

The parameters are not asked of dlstore: they are recovered from each path's images
(``fidelity_harness.recover``: the one window and flip torchvision could draw that gives the
image), then the masks must be v2's kernels on the stored ``tv_tensors.Mask`` with exactly
those parameters (the mask padded with its own fill; a resized crop resampled nearest).
"""

from __future__ import annotations

import pytest
import torch
from fidelity_harness import recover
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.sources.demo import make_segmentation_folder
from dlstore.transforms import BatchRandomCrop, BatchRandomHorizontalFlip, BatchRandomResizedCrop

FORMATS = ("shards", "lmdb", "hdf5")
SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
IMAGE_FILL, MASK_FILL, PAD, CROP = 3, 255, 3, 14


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("maskpaths")
    make_segmentation_folder(root / "seg", count=10, classes=5, size=(24, 30))
    made = {}
    for fmt in FORMATS:
        made[fmt] = root / f"seg{SUFFIX[fmt]}"
        dlstore.convert(root / "seg" / "images", made[fmt], masks=root / "seg" / "masks",
                        static="resize=20,center_crop=18x22", progress=False, workers=0)
    return made


def _crop_flip():
    return v2.Compose([v2.RandomCrop(CROP, padding=PAD, fill={tv_tensors.Image: IMAGE_FILL, tv_tensors.Mask: MASK_FILL}),
                       v2.RandomHorizontalFlip()])


def _check_masks(store, images, masks, *, what):
    """Recover each sample's window and flip from its image; its mask must be v2's with them."""
    raw_images, raw_masks = dlstore.open_dataset(store).read_batch(list(range(len(images))))
    ops = [BatchRandomCrop(CROP, padding=PAD, fill=IMAGE_FILL), BatchRandomHorizontalFlip()]
    crop, flip = recover(ops, raw_images, images, what=what)
    for j in range(len(images)):
        mask = F.pad(tv_tensors.Mask(raw_masks[j]), [PAD] * 4, fill=MASK_FILL)
        mask = F.crop(mask, int(crop["top"][j]), int(crop["left"][j]), CROP, CROP)
        if bool(flip["flip"][j]):
            mask = F.horizontal_flip(mask)
        assert torch.equal(masks[j], mask.as_subclass(torch.Tensor)), f"{what}: sample {j}"


PATHS = {
    "get_batch": lambda ds: [ds.get_batch(range(10), generator=torch.Generator().manual_seed(1))],
    "threads": lambda ds: list(dlstore.loader(ds, batch_size=4, num_workers=0, seed=2)),
    "ring": lambda ds: list(dlstore.loader(ds, batch_size=4, num_workers=2, backend="ring", seed=3)),
    "dataloader": lambda ds: list(dlstore.loader(ds, batch_size=4, num_workers=2, backend="dataloader", seed=4)),
    "device": lambda ds: list(dlstore.loader(ds, batch_size=4, seed=5, device="cpu")),
    "gpudataset": lambda ds: list(dlstore.loader(dlstore.GPUDataset(ds.path, device="cpu", dtype=torch.uint8,
                                                                   transform=ds.transform), batch_size=4, seed=6)),
}


# every path on every format where the format changes how the batch is read (the in-process ones);
# the worker and resident paths read every format alike, so on one
CASES = [(fmt, path) for path in ("get_batch", "threads", "device") for fmt in FORMATS] + \
    [("lmdb", path) for path in ("ring", "dataloader", "gpudataset")]


@pytest.mark.parametrize("fmt, path", CASES)
def test_masks_follow_the_images_on_every_path(stores, fmt, path):
    ds = dlstore.open_dataset(stores[fmt], transform=_crop_flip())
    batches = PATHS[path](ds)
    images = torch.cat([b[0] for b in batches])
    masks = torch.cat([b[1] for b in batches])
    assert images.shape == (10, 3, CROP, CROP) and masks.shape == (10, CROP, CROP)
    _check_masks(stores[fmt], images, masks, what=f"{fmt}/{path}")


def test_resized_crop_masks_are_v2_nearest_for_the_recovered_box(stores):
    op = v2.RandomResizedCrop((12, 16), scale=(0.3, 1.0))
    ds = dlstore.open_dataset(stores["hdf5"], transform=op)
    images, masks = ds.get_batch(range(10), generator=torch.Generator().manual_seed(7))
    raw_images, raw_masks = ds.read_batch(list(range(10)))
    (box,) = recover([BatchRandomResizedCrop((12, 16), scale=(0.3, 1.0))], raw_images, images, what="rrc")
    for j in range(10):
        args = [int(box[k][j]) for k in ("top", "left", "height", "width")]
        ref = F.resized_crop(tv_tensors.Mask(raw_masks[j]), *args, [12, 16])
        assert torch.equal(masks[j], ref.as_subclass(torch.Tensor)), j
