"""``Snooze``: what a handler raises (or returns) to run its task again later, spending no retry.

Its own module, below the handler registry and the outcome rules, because both use it: a
handler raises it, and ``outcomes`` turns it into a SNOOZED attempt.
"""

from __future__ import annotations

import math

from ..validation import Limits


class Snooze(Exception):
    """Raised (or returned) by a handler: run this task again in ``seconds``, spending no retry.

    The task goes back to PENDING at the store's now + ``seconds``, its ``attempt_count`` (the
    retry budget) unchanged, with one SNOOZED entry in its history. ``seconds`` is a number in
    0..366 days, as an enqueue's ``delay_seconds``; anything else raises ``ValueError`` right
    here, in the handler, which makes the run an ordinary failed attempt.
    """

    def __init__(self, seconds: float) -> None:
        if type(seconds) not in (int, float) or not math.isfinite(seconds) or not 0 <= seconds <= Limits.delay_seconds:
            raise ValueError(f"Snooze seconds must be a number in 0..{Limits.delay_seconds}, got {seconds!r}")
        super().__init__(f"snoozed for {seconds:g}s")
        self.seconds = float(seconds)
