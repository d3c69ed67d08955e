"""Retry backoff: the one function that says how long a job waits before running again.

The Retries middleware uses it for failed attempts; the reaper gets its delays for
interrupted attempts from it too (as numbers passed to SQL, never as a second formula).
"""

from __future__ import annotations

#: Doublings after which the delay is the maximum whatever the base (2**60 ms is plenty).
MAX_EXPONENT = 60


def backoff_ms(attempt: int, min_backoff: int, max_backoff: int) -> int:
    """The delay in milliseconds before the run that follows ``attempt`` (1-based) failed
    or was interrupted: ``min(min_backoff * 2 ** (attempt - 1), max_backoff)``."""
    exponent = min(max(attempt - 1, 0), MAX_EXPONENT)
    return int(min(min_backoff * 2**exponent, max_backoff))


def backoff_table(min_backoff: int, max_backoff: int) -> list[int]:
    """Delays for attempts 1, 2, ... up to the first one that reaches ``max_backoff``; the
    last entry holds for every later attempt."""
    delays = [backoff_ms(1, min_backoff, max_backoff)]
    while delays[-1] < max_backoff and len(delays) <= MAX_EXPONENT:
        delays.append(backoff_ms(len(delays) + 1, min_backoff, max_backoff))
    return delays
