"""JPEG records decoded by the device stage (dlstore.data.device_decode), run on device="cpu":
the host hands over records and the boxes and flips it drew; the pixels are torchvision's
``resized_crop`` of PIL's decode for those boxes, and the draws are the host path's."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.data.device_decode import DeviceDecode, EncodedBatch

CPU = torch.device("cpu")


def _pipeline(normalise: bool):
    ops = [v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()]
    if normalise:
        ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])]
    return v2.Compose(ops)


def _pil(ds, i):
    return F.pil_to_tensor(Image.open(io.BytesIO(ds.reader.raw.get_many([i])[0].tobytes())))


@pytest.mark.parametrize("normalise", [False, True])
@pytest.mark.parametrize("seed", [0, 5])
def test_device_decode_gives_the_host_paths_batches(jpeg_store, normalise, seed):
    """Same generator, same batches as the host path (decode + crop on the loader's threads), for
    two epochs of a shuffled order; the host batches handed over hold no pixels."""
    ds = dlstore.open_dataset(jpeg_store, transform=_pipeline(normalise))
    host_ds, steps = ds.host_stage(records_to=CPU)
    assert isinstance(steps[0], DeviceDecode) and host_ds.records_out
    assert isinstance(host_ds.get_batch([0, 1], generator=torch.Generator().manual_seed(0))[0], EncodedBatch)
    reference = dlstore.loader(ds, 4, shuffle=True, device="cpu", seed=seed)   # on the CPU the host decodes
    host = dlstore.loader(host_ds, 4, shuffle=True, backend="threads", num_threads=2, seed=seed)
    for epoch in range(2):
        reference.set_epoch(epoch)
        host.set_epoch(epoch)
        pairs = list(zip(reference, host, strict=True))
        assert len(pairs) == len(reference)
        for (want, want_labels), (records, got_labels) in pairs:
            assert isinstance(records, EncodedBatch)
            got = steps[0](records, CPU)
            for step in steps[1:]:                      # deterministic (Normalize): no generator needed
                got = step(got, None)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.equal(got_labels, want_labels)


def test_each_crop_is_torchvisions_of_pils_decode_for_the_drawn_box(jpeg_store):
    ds = dlstore.open_dataset(jpeg_store, transform=_pipeline(False))
    host_ds, steps = ds.host_stage(records_to=CPU)
    idx = [3, 0, 11, 7, 7]
    batch, _ = host_ds.get_batch(idx, generator=torch.Generator().manual_seed(2))
    out = steps[0](batch, CPU)
    assert out.shape == (len(idx), 3, 24, 24) and batch.flips.any() and not batch.flips.all()
    for j, i in enumerate(idx):
        t, left, h, w = batch.boxes[j].tolist()
        image = _pil(ds, i)
        assert tuple(batch.sizes[j].tolist()) == tuple(image.shape[1:])
        assert 0 <= t and t + h <= image.shape[1] and 0 <= left and left + w <= image.shape[2]
        expected = F.resized_crop(image, t, left, h, w, [24, 24], antialias=True)
        expected = expected.flip(-1) if batch.flips[j] else expected
        assert torch.equal(out[j], expected), f"sample {i}"


def test_only_an_exact_jpeg_crop_with_nothing_after_it_on_the_host_goes_as_records(tmp_path, jpeg_store):
    reduced = dlstore.open_dataset(jpeg_store, transform=_pipeline(True), reduced_decode=True)
    assert not any(isinstance(s, DeviceDecode) for s in reduced.host_stage(records_to=CPU)[1])
    after = dlstore.open_dataset(jpeg_store, transform=v2.Compose([v2.RandomResizedCrop(24), v2.RandomCrop(20)]))
    assert not any(isinstance(s, DeviceDecode) for s in after.host_stage(records_to=CPU)[1])
    raw = tmp_path / "raw.shards"
    images = np.random.default_rng(0).integers(0, 256, (6, 30, 30, 3), dtype=np.uint8)
    dlstore.convert((images, np.zeros(6, dtype=np.int64)), raw, workers=0, progress=False)
    plain = dlstore.open_dataset(raw, transform=_pipeline(True))
    assert not any(isinstance(s, DeviceDecode) for s in plain.host_stage(records_to=CPU)[1])
    # without a device to decode on, the host decodes, as before
    ds = dlstore.open_dataset(jpeg_store, transform=_pipeline(True))
    host_ds, steps = ds.host_stage()
    assert not host_ds.records_out and not any(isinstance(s, DeviceDecode) for s in steps)


def test_the_host_stage_of_a_reduced_decode_keeps_it(jpeg_store):
    reduced = dlstore.open_dataset(jpeg_store, transform=_pipeline(True), reduced_decode=True)
    host_ds, _ = reduced.host_stage()
    alone = dlstore.open_dataset(jpeg_store, transform=_pipeline(False), reduced_decode=True)
    exact = dlstore.open_dataset(jpeg_store, transform=_pipeline(False))
    idx = list(range(len(alone)))
    got, want, full = (d.get_batch(idx, generator=torch.Generator().manual_seed(1))[0] for d in (host_ds, alone, exact))
    assert not torch.equal(want, full)        # this draw decodes some records at a reduced scale
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvjpeg)")
def test_cuda_decode_is_within_its_bound_of_the_host_path(jpeg_store):
    """On CUDA (nvjpeg, the CUDA resize) the crops are the host path's for the same draws, within
    rounding: a bound, not equality (scripts/gpu_check.py measures it on a bigger store)."""
    ds = dlstore.open_dataset(jpeg_store, transform=_pipeline(False))
    cuda = torch.device("cuda", torch.cuda.current_device())
    host_ds, steps = ds.host_stage(records_to=cuda)
    idx = list(range(len(ds)))
    want = ds.get_batch(idx, generator=torch.Generator().manual_seed(4))[0]
    got = steps[0](host_ds.get_batch(idx, generator=torch.Generator().manual_seed(4))[0], cuda)
    assert got.is_cuda and got.shape == want.shape and got.dtype == torch.uint8
    diff = (got.cpu().int() - want.int()).abs().float()
    psnr = 10 * torch.log10(255.0**2 / diff.pow(2).mean().clamp_min(1e-10))
    assert diff.mean() <= 1.5 and psnr >= 30, f"mean |d| {diff.mean():.3f}, PSNR {psnr:.1f} dB"
