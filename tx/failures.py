"""`FailureLog`: how a background loop that retries reports failing, without a traceback per try.

A database outage made the engine loop log a traceback every half second and each LISTEN relay one every
second: 82 tracebacks for a 40 s outage, burying what else happened. A loop now logs the traceback of the
first failure and of each one that differs from the one before, a line a minute while the same failure
repeats, and a line when it succeeds again. A leaf module: the engine and the database layers both use it.
"""

from __future__ import annotations

import logging
import time


class FailureLog:
    def __init__(self, logger: logging.Logger, what: str, remind_s: float = 60.0) -> None:
        self.logger, self.what, self.remind_s = logger, what, remind_s
        self.in_a_row, self._last, self._said_at = 0, "", 0.0

    def failed(self, err: BaseException) -> None:
        """Call from the `except` block that caught `err` (its traceback is the one logged)."""
        self.in_a_row += 1
        key, now = f"{type(err).__name__}: {err}", time.monotonic()
        if key != self._last:
            self._last, self._said_at = key, now
            self.logger.exception("%s failed", self.what)
        elif now - self._said_at >= self.remind_s:
            self._said_at = now
            self.logger.warning("%s still failing (%d times in a row): %s", self.what, self.in_a_row, key[:300])

    def succeeded(self) -> None:
        if self.in_a_row:
            self.logger.warning("%s works again after %d failures in a row", self.what, self.in_a_row)
        self.in_a_row, self._last = 0, ""
