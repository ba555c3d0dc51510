"""Datasets shared by the tools tests: ``from _datasets import SleepyDataset`` (pytest puts
this folder on ``sys.path`` for its test modules)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SleepyDataset(Dataset):
    """Every ``__getitem__`` sleeps ``delay`` seconds; sample i is filled with i."""

    def __init__(self, n: int = 24, delay: float = 0.0):
        self.n, self.delay = n, delay
        self.classes = ["a", "b"]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return torch.full((2, 4, 4), i, dtype=torch.int32), i % 2
