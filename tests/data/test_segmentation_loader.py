"""A segmentation store through every read path of ``dlstore.loader``: the image and its mask get the
same crop and flip in threads, ring workers, the DataLoader back-end and ``device=``.

The store is coupled: channel 0 of every image is 40 x its mask's class, so wherever a batch's mask
is a class, the image must show that class's value at the same pixel; where the mask is the
ignore fill, the image must be its fill. A crop or flip applied to one field and not the other,
or with other draws, breaks this at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

import dlstore

IGNORE, IMAGE_FILL = 255, 0
BACKENDS = [("threads", 0), ("ring", 2), ("dataloader", 2)]


@pytest.fixture(scope="module")
def coupled(tmp_path_factory):
    pairs = []
    for k in range(40):
        yy, xx = np.mgrid[:24, :28]
        mask = ((xx // 4 + yy // 6 + k) % 6).astype(np.uint8)
        image = np.stack([mask * 40, (xx * 9 + 1).astype(np.uint8), np.full_like(mask, k + 1)]).astype(np.uint8)
        pairs.append((tv_tensors.Image(torch.from_numpy(image)), tv_tensors.Mask(torch.from_numpy(mask))))
    dst = tmp_path_factory.mktemp("coupled") / "c.shards"
    dlstore.convert(pairs, dst, static="center_crop=24x28", progress=False, workers=0)   # (a list: sizes unknown)
    return dst


def _transform():
    return v2.Compose([v2.RandomCrop(20, padding=4, fill={tv_tensors.Image: IMAGE_FILL, tv_tensors.Mask: IGNORE}),
                       v2.RandomHorizontalFlip()])


def _check_coupled(images, masks):
    """Every sample's image agrees with its mask (see the module doc); returns how many were flipped."""
    assert images.dtype == torch.uint8 and masks.dtype == torch.uint8
    assert images.shape[0] == masks.shape[0] and images.shape[2:] == masks.shape[1:]
    labelled = masks != IGNORE
    assert torch.equal(images[:, 0][labelled], masks[labelled] * 40)
    assert (images.permute(1, 0, 2, 3)[:, ~labelled] == IMAGE_FILL).all()
    # channel 1 rises with x (9 per pixel) unless the sample was flipped
    rows = images[:, 1].to(torch.int64)
    both = labelled[:, :, 1:] & labelled[:, :, :-1]
    steps = (rows[:, :, 1:] - rows[:, :, :-1])
    flipped = [(steps[k][both[k]] < 0).all().item() for k in range(len(rows))]
    return sum(flipped)


def test_dataset_source_of_tv_tensors_pairs_is_a_segmentation_store(coupled):
    ds = dlstore.open_dataset(coupled)
    image, mask = ds[3]
    assert ds.fields is not None and image.shape == (3, 24, 28) and mask.shape == (24, 28)
    assert torch.equal(image[0], mask * 40) and (image[2] == 4).all()


@pytest.mark.parametrize("backend, workers", BACKENDS)
def test_every_backend_transforms_image_and_mask_together(coupled, backend, workers):
    ds = dlstore.open_dataset(coupled, transform=_transform())
    loader = dlstore.loader(ds, batch_size=8, shuffle=True, num_workers=workers, backend=backend, seed=5)
    flipped = seen = 0
    samples = []
    for images, masks in loader:
        flipped += _check_coupled(images, masks)
        seen += len(images)
        samples += images[:, 2, 10, 10].tolist()   # which sample (k + 1; 0 where padded)
    assert seen == 40 and 5 < flipped < 35
    assert len({s for s in samples if s}) >= 35    # an epoch: (nearly) every sample, the centre rarely padded


def test_backends_give_the_same_batches_for_one_seed(coupled):
    """One seed: the same order and the same draws, whichever back-end reads (the loader's contract)."""
    runs = {}
    for backend, workers in BACKENDS:
        ds = dlstore.open_dataset(coupled, transform=_transform())
        loader = dlstore.loader(ds, batch_size=8, shuffle=True, num_workers=workers, backend=backend, seed=9)
        runs[backend] = [(x.clone(), y.clone()) for x, y in loader]
    first = runs["threads"]
    for backend, batches in runs.items():
        assert len(batches) == len(first)
        for (a, b), (c, d) in zip(first, batches):
            assert torch.equal(a, c) and torch.equal(b, d), backend


def test_device_stage_normalises_only_the_image(coupled):
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    host = dlstore.open_dataset(coupled, transform=_transform())
    full = dlstore.open_dataset(coupled, transform=v2.Compose([*_transform().transforms, *tail]))
    plain = list(dlstore.loader(host, batch_size=8, seed=2))
    moved = list(dlstore.loader(full, batch_size=8, seed=2, device="cpu"))
    assert len(plain) == len(moved) == 5
    for (a, b), (c, d) in zip(plain, moved):
        assert torch.equal(b, d) and d.dtype == torch.uint8
        torch.testing.assert_close(c, (a.float() / 255 - 0.5) / 0.25)


@pytest.mark.parametrize("mode", ["preload", "stream"])
def test_gpudataset_holds_images_and_masks_and_augments_them_together(coupled, mode):
    """device="cpu" runs the GPU code: the records resident (or streamed), each batch's crop and flip
    on both, the images converted to the dataset's dtype and normalised, the masks left integers."""
    extra = {"on_overflow": "stream", "max_memory": 1000} if mode == "stream" else {}
    held = dlstore.GPUDataset(coupled, device="cpu", dtype=torch.uint8, transform=_transform(), **extra)
    assert held.mode == mode and held.shape == (3, 24, 28)
    flipped = seen = 0
    for images, masks in dlstore.loader(held, batch_size=8, shuffle=True, seed=3):
        flipped += _check_coupled(images, masks)
        seen += len(images)
    assert seen == 40 and 5 < flipped < 35
    mean, std = [0.2, 0.4, 0.5], [0.3, 0.2, 0.25]
    served = dlstore.GPUDataset(coupled, device="cpu", dtype=torch.float16, normalize=(mean, std),
                                transform=_transform(), **extra)
    plain = list(dlstore.loader(held, batch_size=8, shuffle=True, seed=4))
    converted = list(dlstore.loader(served, batch_size=8, shuffle=True, seed=4))
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    for (a, b), (c, d) in zip(plain, converted):
        assert torch.equal(b, d) and d.dtype == torch.uint8 and c.dtype == torch.float16
        assert torch.equal(c, ((a.float() / 255 - m) / s).half())
    image, mask = served[7]
    stored_image, stored_mask = dlstore.open_dataset(coupled).read(7)
    assert torch.equal(mask, stored_mask) and torch.equal(image, ((stored_image[None].float() / 255 - m) / s).half()[0])


def test_gpudataset_refuses_what_it_cannot_hold_for_masks(coupled):
    from dlstore.errors import ArgumentError

    with pytest.raises(ArgumentError, match="padding=.*own"):
        dlstore.GPUDataset(coupled, device="cpu", padding=4)
    with pytest.raises(ArgumentError, match="shard=True"):
        dlstore.GPUDataset(coupled, device="cpu", shard=True, rank=0, world_size=2)


def test_ring_carries_masks_in_shared_memory_and_never_overwrites_one_held(coupled):
    """The ring's workers write each batch's masks into a shared-memory slot beside its images (not
    through their pipes); a slot is reused only once the user holds neither its images nor its masks."""
    ds = dlstore.open_dataset(coupled, transform=_transform())
    loader = dlstore.loader(ds, batch_size=4, shuffle=True, num_workers=2, backend="ring", prefetch_factor=1, seed=1)
    assert loader.strategy.spec.target == ((20, 20), torch.uint8)
    kept, copies = [], []
    for images, masks in loader:          # only the masks kept: their slots must stay theirs
        kept.append(masks)
        copies.append(masks.clone())
        _check_coupled(images, masks)
    assert len(kept) == 10 and all(torch.equal(a, b) for a, b in zip(kept, copies))
    # the first batches' masks are the slots themselves (once the user holds every slot, the loader
    # hands out copies rather than wait: the ring, looked at from here)
    slots = [t.data_ptr() for t in loader.strategy._ring.target_slots]
    assert kept[0].data_ptr() in slots and kept[1].data_ptr() in slots
