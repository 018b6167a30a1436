"""The batches every loop driver hands the user's `train(model, batches)`: `check --train`'s recorded
run (loop.py) and the overfit probe (overfit.py) feed the loop through the same list."""

from __future__ import annotations

from typing import Callable, Optional


class FeedStopped(BaseException):
    """Raised out of the loop's iteration over a Feed once it is told to stop: a BaseException, so the
    user's `except Exception` lets it through."""


class Feed(list):
    """The batches as a list (len() works, epochs re-iterate). `before(index, handed)` runs before each
    batch is handed out, with its index in this pass and the count handed out in all passes; it stops
    the feed for good by returning False (FeedStopped is raised), and any other answer goes on."""

    def __init__(self, batches, before: Callable[[int, int], Optional[bool]]):
        super().__init__(batches)
        self.before = before
        self.handed = 0
        self.stopped = False

    def __iter__(self):
        for index, batch in enumerate(list.__iter__(self)):
            if self.stopped or self.before(index, self.handed) is False:
                self.stopped = True
                raise FeedStopped
            self.handed += 1
            yield batch

    def drive(self, train: Callable, model) -> None:
        """train(model, self), until it returns or the feed stops it."""
        try:
            train(model, self)
        except FeedStopped:
            pass
