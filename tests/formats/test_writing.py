"""``produced_ahead``: conversions are made one item ahead of the writer, in order."""

from __future__ import annotations

import threading

import pytest
import torch

from inspector.formats.writing import Item, produced_ahead


def test_produced_ahead_makes_the_next_conversion_while_the_caller_writes() -> None:
    made: list[str] = []
    started = {name: threading.Event() for name in "abcd"}

    def producer(name: str):
        def produce() -> torch.Tensor:
            started[name].set()
            made.append(name)
            return torch.full((2,), ord(name), dtype=torch.int32)

        return produce

    copied = Item("c", "int32", (2,), producer("c"), ranges=lambda: None)
    items = [Item(n, "int32", (2,), producer(n)) for n in "ab"] + [copied]
    items.append(Item("d", "int32", (2,), producer("d")))
    seen = []
    for item in produced_ahead(items):
        if item.name == "a":
            assert started["b"].wait(5)  # b is being made while a is in the caller's hands
        if item.name == "c":  # stored bytes: the caller copies them; d waits for that
            assert item is copied and not started["c"].is_set() and not started["d"].is_set()
        seen.append((item.name, item.produce().tolist()))
    assert seen == [(n, [ord(n)] * 2) for n in "abcd"]
    assert made == ["a", "b", "c", "d"]


def test_produced_ahead_hands_a_failure_to_the_item_that_failed() -> None:
    def fails() -> torch.Tensor:
        raise ValueError("unreadable")

    items = [Item("a", "int32", (1,), lambda: torch.zeros(1, dtype=torch.int32)),
             Item("b", "int32", (1,), fails)]
    walked = produced_ahead(items)
    assert next(walked).produce().tolist() == [0]
    with pytest.raises(ValueError, match="unreadable"):
        next(walked).produce()
