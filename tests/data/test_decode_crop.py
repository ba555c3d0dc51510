"""RandomResizedCrop at decode time on JPEG stores (dlstore.data.decode_crop), against torchvision/PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.formats.encoding import decode_reduced, image_size, reduced_scale
from dlstore.sources.demo import make_image_folder, synthetic_image
from dlstore.transforms import BatchRandomResizedCrop

BOX = ("top", "left", "height", "width")


def _pil(ds, i):
    return F.pil_to_tensor(Image.open(io.BytesIO(ds.reader.raw.get_many([i])[0].tobytes())))


def test_boxes_of_mixed_sizes_are_the_draws_of_each_size():
    # column j of one draw over mixed sizes is what sample() draws for a batch of image j's size
    crop = BatchRandomResizedCrop(8, scale=(0.08, 1.0))
    sizes = [(20, 30), (31, 17), (9, 64), (48, 48), (12, 10)]
    hs, ws = (torch.tensor([s[k] for s in sizes]) for k in (0, 1))
    mixed = crop.sample_sizes(hs, ws, generator=torch.Generator().manual_seed(3))
    for j, (h, w) in enumerate(sizes):
        alone = crop.sample((len(sizes), 3, h, w), generator=torch.Generator().manual_seed(3))
        assert [int(mixed[k][j]) for k in BOX] == [int(alone[k][j]) for k in BOX]
        assert 0 <= mixed["top"][j] and mixed["top"][j] + mixed["height"][j] <= h
        assert 0 <= mixed["left"][j] and mixed["left"][j] + mixed["width"][j] <= w


@pytest.mark.parametrize("kind", ["baseline", "progressive", "gray", "png", "exif"])
def test_image_size_reads_the_header_as_pil_does(kind):
    img = Image.fromarray(synthetic_image(1, 2, (37, 53)))
    buf = io.BytesIO()
    if kind == "png":
        img.save(buf, format="PNG")
    elif kind == "gray":
        img.convert("L").save(buf, format="JPEG")
    elif kind == "exif":
        exif = Image.Exif()
        exif[0x010E] = "x" * 3000          # a long APP1 segment before the frame header
        img.save(buf, format="JPEG", exif=exif)
    else:
        img.save(buf, format="JPEG", progressive=kind == "progressive")
    record = np.frombuffer(buf.getvalue(), np.uint8).reshape(1, 1, -1)
    assert image_size(record) == (37, 53)


def test_a_record_without_an_image_header_names_the_sample():
    from dlstore.errors import StoreCorruptError

    with pytest.raises(StoreCorruptError, match="s.shards sample 4: .*no image header"):
        image_size(np.frombuffer(b"\xff\xd8 not a jpeg at all", np.uint8), where="s.shards sample 4")


def test_loader_batches_equal_torchvision_resized_crop_with_the_drawn_boxes(jpeg_store):
    ds = dlstore.open_dataset(jpeg_store, transform=v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()]))
    assert ds.shape is None and ds.decode_crop is not None and not ds.per_sample_ops
    loader = dlstore.loader(ds, 5, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert loader.backend == "threads"           # the default: threads, the crop drawn per batch
    batches = list(loader)
    again = list(dlstore.loader(ds, 5, shuffle=True, backend="threads", num_threads=1, generator=torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, again))   # whatever the thread count
    # each batch: torchvision's kernel on PIL's pixels with the boxes its generator draws first, then the flip
    idx = [2, 7, 0, 11, 5]
    g = torch.Generator().manual_seed(5)
    got, _ = ds.get_batch(idx, generator=g)
    pil = [_pil(ds, i) for i in idx]
    g = torch.Generator().manual_seed(5)
    boxes = ds.decode_crop.sample_sizes(torch.tensor([p.shape[1] for p in pil]),
                                        torch.tensor([p.shape[2] for p in pil]), generator=g)
    flips = ds.batch_ops[0].sample((5, 3, 24, 24), generator=g)["flip"]
    for j, p in enumerate(pil):
        want = F.resized_crop(p, *(int(boxes[k][j]) for k in BOX), [24, 24], antialias=True)
        assert torch.equal(got[j], F.horizontal_flip(want) if flips[j] else want)


def test_reduced_scale_keeps_the_output_covered():
    assert reduced_scale(224, 224, (224, 224)) == 1
    assert reduced_scale(447, 900, (224, 224)) == 1
    assert reduced_scale(448, 900, (224, 224)) == 2
    assert reduced_scale(900, 1800, (224, 224)) == 4
    assert reduced_scale(1792, 1792, (224, 224)) == 8
    assert reduced_scale(5000, 5000, (224, 224)) == 8


def test_reduced_decode_is_libjpegs_dct_scaling_and_close_to_exact(tmp_path):
    img = synthetic_image(3, 1, (480, 640))
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    record = np.frombuffer(buf.getvalue(), np.uint8).reshape(1, 1, -1)
    small, s = decode_reduced(record, 4)
    ref = Image.open(io.BytesIO(buf.getvalue()))
    ref.draft("RGB", (160, 120))
    assert s == 4 and small.shape == (3, 120, 160) and np.array_equal(small, np.asarray(ref).transpose(2, 0, 1))
    # a store read with reduced_decode: small crops of large records decode reduced, others exactly
    src = make_image_folder(tmp_path / "src", classes=1, per_class=4, size=(480, 640))
    dlstore.convert(src, tmp_path / "s.lmdb", encoding="jpeg", quality=90, workers=0, progress=False)
    transform = v2.RandomResizedCrop(32, scale=(0.5, 1.0))
    exact = dlstore.open_dataset(tmp_path / "s.lmdb", transform=transform)
    reduced = dlstore.open_dataset(tmp_path / "s.lmdb", transform=transform, reduced_decode=True)
    a, _ = exact.get_batch([0, 1, 2, 3], generator=torch.Generator().manual_seed(1))
    b, _ = reduced.get_batch([0, 1, 2, 3], generator=torch.Generator().manual_seed(1))
    assert a.shape == b.shape == (4, 3, 32, 32) and not torch.equal(a, b)
    mse = float(((a.double() - b.double()) ** 2).mean())
    assert 10 * np.log10(255 ** 2 / mse) > 25
    tight = dlstore.open_dataset(tmp_path / "s.lmdb", transform=v2.RandomResizedCrop(400, scale=(0.9, 1.0)),
                                 reduced_decode=True)
    c, _ = tight.get_batch([0, 1], generator=torch.Generator().manual_seed(2))
    d, _ = dlstore.open_dataset(tmp_path / "s.lmdb", transform=v2.RandomResizedCrop(400, scale=(0.9, 1.0))
                                ).get_batch([0, 1], generator=torch.Generator().manual_seed(2))
    assert torch.equal(c, d)      # no box holds 2x the output: decoded exactly


def test_a_batch_decodes_in_one_call_and_a_damaged_record_is_named(jpeg_store, monkeypatch):
    import torchvision.io

    from dlstore.errors import StoreCorruptError

    ds = dlstore.open_dataset(jpeg_store, transform=v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()]))
    ds.get_batch([0, 1, 2, 3], generator=torch.Generator().manual_seed(0))   # the reader's check against PIL
    real, calls = torchvision.io.decode_jpeg, []
    monkeypatch.setattr(torchvision.io, "decode_jpeg",
                        lambda data, *a, **k: (calls.append(len(data)), real(data, *a, **k))[1])
    ds.get_batch([5, 1, 8, 0, 11], generator=torch.Generator().manual_seed(1))
    assert calls == [5]                  # the whole batch in one call, not one call per record
    raw = ds.reader.raw
    good = raw.get_many
    monkeypatch.setattr(raw, "get_many", lambda idx: [r.reshape(-1)[: r.size // 3].reshape(1, 1, -1) if i == 8 else r
                                                      for r, i in zip(good(idx), idx)])
    with pytest.raises(StoreCorruptError, match=r"s\.shards sample 8: stored image bytes do not decode"):
        ds.get_batch([5, 1, 8, 0], generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    """A JPEG store of small records (16..31 px: scale 1 for a 16-px crop) and large ones (96..191 px:
    most boxes hold 2x or 4x the crop), interleaved."""
    root = tmp_path_factory.mktemp("mixed_jpeg")
    rng = np.random.default_rng(0)
    for c, (low, high) in enumerate([(16, 32), (96, 192)]):
        (root / "src" / f"class_{c:02d}").mkdir(parents=True)
        for i in range(8):
            hw = tuple(int(x) for x in rng.integers(low, high, 2))
            Image.fromarray(synthetic_image(c, i, hw)).save(root / "src" / f"class_{c:02d}" / f"img_{i:04d}.jpg",
                                                            quality=90)
    dlstore.convert(root / "src", root / "s.shards", encoding="jpeg", quality=90, workers=0, progress=False)
    return root / "s.shards"


MIXED_IDX = [0, 8, 1, 9, 15, 2, 10, 3, 3, 11, 7, 12]
REDUCED = v2.Compose([v2.RandomResizedCrop(16, scale=(0.05, 1.0)), v2.RandomHorizontalFlip()])


def _reduced_reference(ds, idx, seed):
    """``reduced_decode`` spelled out record by record: boxes on the headers' sizes, then flips; each record
    decoded by PIL at its box's DCT scale (whole at scale 1), its box mapped to that scale, cropped and flipped.
    Also the scales applied."""
    records = ds.reader.raw.get_many(idx)
    sizes = torch.tensor([image_size(r) for r in records])
    g = torch.Generator().manual_seed(seed)
    boxes = ds.decode_crop.sample_sizes(sizes[:, 0], sizes[:, 1], generator=g)
    flips = ds.batch_ops[0].sample((len(idx), 3, 16, 16), generator=g)["flip"]
    out, scales = [], []
    for j, record in enumerate(records):
        t, left, h, w = (int(boxes[k][j]) for k in BOX)
        image, s = decode_reduced(record, reduced_scale(h, w, (16, 16)))
        if s > 1:
            height, width = image.shape[1:]
            t, b = min(round(t / s), height - 1), min(round((t + h) / s), height)
            left, r = min(round(left / s), width - 1), min(round((left + w) / s), width)
            h, w = max(1, b - t), max(1, r - left)
        else:
            image = F.pil_to_tensor(Image.open(io.BytesIO(record.tobytes())))
        crop = F.resized_crop(torch.from_numpy(np.ascontiguousarray(image)), t, left, h, w, [16, 16], antialias=True)
        out.append(crop.flip(-1) if flips[j] else crop)
        scales.append(s)
    return torch.stack(out), scales


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_reduced_decode_is_the_per_record_decode_of_each_box(mixed_store, seed):
    ds = dlstore.open_dataset(mixed_store, transform=REDUCED, reduced_decode=True)
    got, _ = ds.get_batch(MIXED_IDX, generator=torch.Generator().manual_seed(seed))
    want, scales = _reduced_reference(ds, MIXED_IDX, seed)
    assert 1 in scales and max(scales) > 1          # both kinds of record in the batch
    assert torch.equal(got, want)


def test_reduced_decode_decodes_its_scale_1_records_in_one_call_and_checks_their_headers(mixed_store, monkeypatch):
    from dlstore.data import decode_crop
    from dlstore.errors import StoreCorruptError

    ds = dlstore.open_dataset(mixed_store, transform=REDUCED, reduced_decode=True)
    reader, batched, alone = ds.reader, [], []
    decode_records, decode_record = reader.decode_records, reader.decode_record
    monkeypatch.setattr(reader, "decode_records", lambda r, i: (batched.append(list(i)), decode_records(r, i))[1])
    monkeypatch.setattr(reader, "decode_record", lambda r, i, **k: (alone.append(i), decode_record(r, i, **k))[1])
    ds.get_batch(MIXED_IDX, generator=torch.Generator().manual_seed(4))
    _, scales = _reduced_reference(ds, MIXED_IDX, 4)
    assert batched == [[i for i, s in zip(MIXED_IDX, scales) if s == 1]]
    assert alone == [i for i, s in zip(MIXED_IDX, scales) if s > 1] and alone
    # a record that decodes to another size than its header's is named (a 20x20 header: its box is scale 1)
    header = decode_crop.image_size
    monkeypatch.setattr(decode_crop, "image_size", lambda r, where: (20, 20) if where.endswith(" 9") else header(r))
    with pytest.raises(StoreCorruptError, match=r"s\.shards sample 9: decodes to \(\d+, \d+\), its header says"):
        ds.get_batch(MIXED_IDX, generator=torch.Generator().manual_seed(4))
