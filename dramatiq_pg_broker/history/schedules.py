"""A schedule: when an actor runs, on a cron expression or an interval (see
:mod:`.periodic`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import zoneinfo
from collections.abc import Mapping, Sequence
from typing import Any

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from ..errors import ConfigurationError

UTC = dt.timezone.utc

#: Interval ticks are whole multiples of the interval since this instant, so that every
#: process computes the same ticks (``every=60`` fires at each whole minute, UTC).
INTERVAL_ORIGIN = dt.datetime(2000, 1, 1, tzinfo=UTC)

#: The most ticks one firing (or one boot's catch-up count) walks through.
MAX_TICKS_PER_CALL = 100_000

MISSED_POLICIES = ("run_once", "skip")

_MICROSECOND = dt.timedelta(microseconds=1)


def _seconds(value: float | dt.timedelta) -> dt.timedelta:
    delta = value if isinstance(value, dt.timedelta) else dt.timedelta(seconds=float(value))
    if delta < dt.timedelta(seconds=1):
        raise ConfigurationError(f"a periodic interval must be at least 1 second, not {delta}")
    return delta


def _format_interval(delta: dt.timedelta) -> str:
    seconds = delta.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"every {int(seconds // size)}{unit}"
    return f"every {seconds:g}s"


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """When to enqueue an actor.

    Parameters:
      actor_name(str): the actor to send (declared on the same broker).
      cron(str): a five-field crontab expression (minute hour day month day-of-week).
      every(float|timedelta): or an interval, in seconds (at least 1).
      timezone(str): the IANA time zone a cron expression is read in (default UTC).
      missed(str): ``"run_once"`` (default) or ``"skip"``: what a booting worker does with
        ticks that came while every worker was down.
      name(str): the schedule's unique name; default the actor name.
      args(tuple), kwargs(dict): the arguments each tick's message carries.
    """

    actor_name: str
    cron: str | None = None
    every: float | dt.timedelta | None = None
    timezone: str = "UTC"
    missed: str = "run_once"
    name: str | None = None
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise ConfigurationError(
                f"schedule for {self.actor_name!r}: give exactly one of a cron expression or every="
            )
        if self.missed not in MISSED_POLICIES:
            raise ConfigurationError(
                f"schedule for {self.actor_name!r}: missed must be 'run_once' or 'skip', "
                f"not {self.missed!r}"
            )
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ConfigurationError(f"unknown time zone {self.timezone!r}") from None
        if self.every is not None:
            object.__setattr__(self, "every", _seconds(self.every))
        object.__setattr__(self, "name", self.name or self.actor_name)
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        self.trigger()  # a malformed cron expression fails here, at declaration

    @property
    def description(self) -> str:
        """How the schedule reads in listings: ``cron */5 * * * *`` or ``every 30s``."""
        if self.cron is not None:
            return f"cron {self.cron}"
        return _format_interval(self.every)

    def trigger(self):
        """The APScheduler trigger that fires this schedule."""
        if self.cron is not None:
            try:
                return CronTrigger.from_crontab(
                    self.cron, timezone=zoneinfo.ZoneInfo(self.timezone)
                )
            except ValueError as e:
                raise ConfigurationError(
                    f"schedule {self.name or self.actor_name!r}: bad cron expression "
                    f"{self.cron!r}: {e}"
                ) from None
        return IntervalTrigger(seconds=self.every.total_seconds(), start_date=INTERVAL_ORIGIN)

    def ticks(self, after: dt.datetime, until: dt.datetime) -> tuple[list[dt.datetime], int]:
        """The ticks ``t`` with ``after < t <= until`` (in UTC), at most
        :data:`MAX_TICKS_PER_CALL` of them (the latest kept), and how many there are."""
        if until <= after:
            return [], 0
        if self.every is not None:
            step = self.every
            first = (after - INTERVAL_ORIGIN) // step + 1
            last = (until - INTERVAL_ORIGIN) // step
            count = max(0, last - first + 1)
            start = max(first, last - MAX_TICKS_PER_CALL + 1)
            return [INTERVAL_ORIGIN + k * step for k in range(start, last + 1)], count
        trigger = self.trigger()
        found: list[dt.datetime] = []
        count = 0
        tick = trigger.get_next_fire_time(None, after + _MICROSECOND)
        while tick is not None and tick <= until:
            count += 1
            found.append(tick.astimezone(UTC))
            if len(found) > MAX_TICKS_PER_CALL:
                del found[0]
            if count >= 10 * MAX_TICKS_PER_CALL:
                break
            tick = trigger.get_next_fire_time(tick, tick + _MICROSECOND)
        return found, count

    def next_run(self, now: dt.datetime) -> dt.datetime | None:
        """The first tick after ``now``."""
        if self.every is not None:
            return INTERVAL_ORIGIN + ((now - INTERVAL_ORIGIN) // self.every + 1) * self.every
        tick = self.trigger().get_next_fire_time(None, now + _MICROSECOND)
        return tick.astimezone(UTC) if tick is not None else None

    def key(self, tick: dt.datetime) -> str:
        """The idempotency key of a tick's job."""
        return f"periodic:{self.name}:{tick.astimezone(UTC).isoformat()}"
