"""A LightningDataModule over dlstore stores: whole-batch loaders, one disjoint share per rank under DDP.

    dm = StoreDataModule("train.shards", val="val.shards", batch_size=64, transform=pipeline)
    trainer = L.Trainer(strategy="ddp", devices=2, use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)

``dlstore.loader(..., distributed=True)`` gives each rank its share of every epoch
(a ``DistributedSampler`` inside, padded so that all ranks run the same number of
steps), so Lightning must not add its own sampler: ``use_distributed_sampler=False``.
Lightning still calls ``loader.sampler.set_epoch(epoch)`` before each epoch, which
reshuffles the shares. ``transform`` is anything ``open_dataset`` takes (a torchvision
pipeline or ``dlstore.split_transforms(pipeline)``); random crops and flips run per
batch in the loader, and the model normalises on its device (``TinyClassifier``).

    python examples/lightning_datamodule.py STORE [--val STORE] [--devices 2] [--epochs 2] [--record DIR]

With ``--devices 2`` on a machine without GPUs this runs two CPU processes (DDP,
gloo); ``--record DIR`` writes the labels each rank saw, per epoch, to
``DIR/rank{R}.json`` (the tests use it to check that the shares are disjoint).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

import dlstore


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StoreDataModule(L.LightningDataModule):
    """Train and validation loaders over dlstore stores.

    Args:
        train: path of the training store.
        val: path of the validation store (None: no validation).
        batch_size: samples per batch, per rank.
        transform: training transforms for ``open_dataset`` (random crops, flips).
        num_workers: loader worker processes (0: threads in each rank's process).
        seed: the shuffle's seed; the same on every rank.
    """

    def __init__(self, train: str | Path, val: str | Path | None = None, *, batch_size: int = 64,
                 transform: Any = None, num_workers: int = 0, seed: int = 0):
        super().__init__()
        self.train_path, self.val_path = train, val
        self.batch_size, self.transform, self.num_workers, self.seed = batch_size, transform, num_workers, seed

    def setup(self, stage: str | None = None) -> None:
        # Runs on every rank, after Lightning has joined the process group. Opening is
        # cheap: stores are memory-mapped or opened lazily, never read whole.
        self.train_set = dlstore.open_dataset(self.train_path, transform=self.transform)
        self.val_set = dlstore.open_dataset(self.val_path) if self.val_path is not None else None
        self.classes = self.train_set.classes

    def train_dataloader(self) -> Any:
        return dlstore.loader(self.train_set, self.batch_size, shuffle=True, drop_last=True,
                              num_workers=self.num_workers, distributed=_distributed(), seed=self.seed)

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            return []
        return dlstore.loader(self.val_set, self.batch_size, num_workers=self.num_workers,
                              distributed=_distributed())


class TinyClassifier(L.LightningModule):
    """A linear classifier on uint8 batches, normalised on its device; records the labels it saw."""

    def __init__(self, classes: int, shape: tuple[int, int, int], lr: float = 0.1):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(torch.tensor(shape).prod()), classes))
        self.lr = lr
        self.seen: list[list[int]] = []       # training labels, one list per epoch
        self.seen_val: list[list[int]] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.float() / 255 - 0.5)

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.seen[-1] += labels.tolist()
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.seen_val.append([])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        if not self.trainer.sanity_checking:
            self.seen_val[-1] += labels.tolist()
        self.log("val_loss", F.cross_entropy(self(images), labels), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", help="a store made by dlstore convert")
    parser.add_argument("--val", default=None, help="a validation store")
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--record", default=None, help="write the labels each rank saw to DIR/rank{R}.json")
    args = parser.parse_args()

    dm = StoreDataModule(args.train, args.val, batch_size=args.batch_size)
    dm.setup()   # in this process only, to size the model; each rank runs setup() again
    model = TinyClassifier(len(dm.classes), dm.train_set.shape)
    on_gpus = args.accelerator != "cpu" and torch.cuda.is_available()
    strategy = DDPStrategy(process_group_backend="nccl" if on_gpus else "gloo") if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, max_epochs=args.epochs, strategy=strategy,
        use_distributed_sampler=False,   # dlstore.loader(distributed=True) shards by rank itself
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    rank, world = trainer.global_rank, trainer.world_size
    print(f"rank {rank}/{world}: " + ", ".join(
        f"epoch {e} {len(labels)} samples" for e, labels in enumerate(model.seen)), flush=True)
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)
        (Path(args.record) / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "world_size": world, "train": model.seen, "val": model.seen_val}))


if __name__ == "__main__":
    main()
