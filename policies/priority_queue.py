"""A two-class FIFO queue in which the lower class gets a guaranteed share.

``INTERACTIVE`` is served before ``BATCH``, except that while both classes are
waiting, at least ``batch_share`` of the items served are ``BATCH`` (a credit
counter: each contended service adds ``batch_share``; a full credit serves the
batch head). Credit accrues only while batch items wait, so an idle batch class
cannot bank it and later starve interactive traffic. ``batch_share = 0`` is strict
priority; ``1`` serves batch first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from enum import IntEnum
from typing import Generic, TypeVar

W = TypeVar("W")


class Priority(IntEnum):
    INTERACTIVE = 0
    BATCH = 1


class PriorityQueue(Generic[W]):
    def __init__(self, batch_share: float) -> None:
        self._queues: dict[Priority, deque[W]] = {p: deque() for p in Priority}
        self._credit = 0.0
        self.batch_share = batch_share

    @property
    def batch_share(self) -> float:
        return self._batch_share

    @batch_share.setter
    def batch_share(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"batch_share must be within [0, 1], got {value}")
        self._batch_share = value

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[W]:
        for priority in Priority:
            yield from self._queues[priority]

    def depth(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def push(self, item: W, priority: Priority) -> None:
        self._queues[priority].append(item)

    def remove(self, item: W, priority: Priority) -> bool:
        """Take ``item`` out wherever it stands; False if it is not queued."""
        try:
            self._queues[priority].remove(item)
        except ValueError:
            return False
        if not self._queues[Priority.BATCH]:
            self._credit = 0.0
        return True

    def remove_if(self, doomed: Callable[[W], bool]) -> list[W]:
        removed: list[W] = []
        for queue in self._queues.values():
            keep: list[W] = []
            for item in queue:
                (removed if doomed(item) else keep).append(item)
            if len(keep) != len(queue):
                queue.clear()
                queue.extend(keep)
        if not self._queues[Priority.BATCH]:
            self._credit = 0.0
        return removed

    def peek(self) -> W | None:
        """The item ``pop`` would return, without serving it."""
        priority = self._next_class()
        return None if priority is None else self._queues[priority][0]

    def pop(self) -> W:
        priority = self._next_class()
        if priority is None:
            raise IndexError("pop from an empty PriorityQueue")
        if self._contended():
            self._credit += self._batch_share
            if priority is Priority.BATCH:
                self._credit -= 1.0
        item = self._queues[priority].popleft()
        if not self._queues[Priority.BATCH]:
            self._credit = 0.0
        return item

    def clear(self) -> list[W]:
        items = list(self)
        for queue in self._queues.values():
            queue.clear()
        self._credit = 0.0
        return items

    def _contended(self) -> bool:
        return all(self._queues.values())

    def _next_class(self) -> Priority | None:
        interactive = self._queues[Priority.INTERACTIVE]
        batch = self._queues[Priority.BATCH]
        if interactive and batch:
            # The epsilon absorbs float drift: ten credits of 0.1 must make a whole one.
            due = self._credit + self._batch_share >= 1.0 - 1e-9
            return Priority.BATCH if due else Priority.INTERACTIVE
        if interactive:
            return Priority.INTERACTIVE
        return Priority.BATCH if batch else None
