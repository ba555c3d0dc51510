"""time_epochs on a fake clock: the cold first epoch apart, rounds interleaved, the median of them."""

from __future__ import annotations

import pytest

from dlstore.tools.epochs import EpochRates, load_note, time_epochs


def test_cold_epoch_apart_rounds_interleaved_median_over_rounds():
    order = []
    seconds = {"slow": iter([10.0, 1.0, 1.0, 5.0]),                  # cold, then one epoch a round
               "fast": iter([1.0] + [0.1] * 3 + [0.1] * 3 + [9.0])}

    def clock(loader, count):
        order.append(loader)
        return 100, next(seconds[loader])

    rates = time_epochs({"slow": "slow", "fast": "fast"}, rounds=3, min_seconds=0.25, clock=clock)
    assert rates["slow"].first == 10.0 and rates["fast"].first == 100.0   # the cold epochs, apart
    assert rates["slow"].rounds == [100.0, 100.0, 20.0] and rates["slow"].median == 100.0
    # the fast loader repeats its 0.1 s epoch until a round lasts 0.25 s; one stalled epoch
    # (9 s) sinks one round, and the median over rounds ignores it
    assert rates["fast"].rounds == pytest.approx([1000.0, 1000.0, 100 / 9.0])
    assert rates["fast"].median == pytest.approx(1000.0)
    assert rates["fast"].spread == pytest.approx((100 / 9.0, 1000.0))
    # cold epochs first, then every round visits both loaders in turn
    assert order[:2] == ["slow", "fast"] and order[2:6] == ["slow", "fast", "fast", "fast"]


def test_epoch_rates_without_rounds_is_the_first_epoch():
    assert EpochRates(first=5.0).median == 5.0 and EpochRates(first=5.0).spread == (5.0, 5.0)


def test_load_note_only_above_the_usable_cpus():
    assert load_note(1.9, 2) is None
    note = load_note(6.5, 2)
    assert "6.5 on 2 usable CPU(s)" in note and "loaded" in note
