"""The rule of a row's max_attempts, in one place: the default max_retries (the Retries
middleware's, else the setting's), then max_retries + 1, never below the attempt a retry
policy just granted."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.middleware import AgeLimit
from dramatiq.middleware import Retries as StockRetries

from dramatiq_pg_broker import Retries, Settings
from dramatiq_pg_broker.messages import (
    UNLIMITED_ATTEMPTS,
    default_max_retries,
    job_from_message,
    max_attempts_for,
)


def test_the_default_is_the_settings_without_a_retries_middleware():
    assert default_max_retries(Settings()) == Settings().max_attempts - 1 == 20
    assert default_max_retries(Settings(max_attempts=5), [AgeLimit()]) == 4


def test_the_default_is_the_retries_middlewares_when_there_is_one():
    ours = Retries()
    ours.configure(Settings(max_attempts=5))
    assert default_max_retries(Settings(max_attempts=9), [AgeLimit(), ours]) == 4
    assert default_max_retries(Settings(max_attempts=9), [StockRetries(max_retries=3)]) == 3
    given = Retries(max_retries=2)
    given.configure(Settings(max_attempts=5))
    assert given.max_retries == 2, "a value given to the constructor wins over the setting"
    assert default_max_retries(Settings(max_attempts=9), [StockRetries(max_retries=None)]) is None


@pytest.mark.parametrize(
    ("max_retries", "failures", "expected"),
    [
        (20, 0, 21),
        (0, 0, 1),
        (None, 0, UNLIMITED_ATTEMPTS),
        (2, 5, 6),  # a retry policy went past max_retries: the row allows the next attempt
        (2, 1, 3),
        (UNLIMITED_ATTEMPTS, 0, UNLIMITED_ATTEMPTS),
    ],
)
def test_max_attempts_is_max_retries_plus_one_and_allows_the_attempt_granted(
    max_retries, failures, expected
):
    assert max_attempts_for(max_retries, failures) == expected


def test_a_message_with_retries_behind_it_gets_a_limit_that_allows_the_next_attempt():
    message = dramatiq.Message("q", "a", (), {}, {"retries": 4, "max_retries": 1})
    job, _ = job_from_message(message, default_max_retries=20)
    assert job.max_attempts == 5
    fresh = dramatiq.Message("q", "a", (), {}, {"max_retries": 1})
    job, _ = job_from_message(fresh, default_max_retries=20)
    assert job.max_attempts == 2
