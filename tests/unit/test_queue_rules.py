"""A queue's name and a queue's limit have one definition (:mod:`dramatiq_pg_broker.queue_rules`):
the settings, the control functions, the command line and the admin API's request models
accept and refuse the same ones. A code limit out of range is refused when the broker is
built, not at every heartbeat after."""

from __future__ import annotations

import argparse

import pydantic
import pytest

from admin_api.resources.jobs import JobRequest
from admin_api.resources.queues import LimitRequest
from dramatiq_pg_broker import PostgresBroker, Settings
from dramatiq_pg_broker.cli.control import _limit
from dramatiq_pg_broker.control.queues import check_name
from dramatiq_pg_broker.errors import ConfigurationError, InvalidQueueLimit, InvalidQueueName
from dramatiq_pg_broker.queue_rules import MAX_LIMIT, MAX_QUEUE_NAME, check_limit

BAD_NAMES = ["a" * (MAX_QUEUE_NAME + 1), "a\n", "9lives", "", "a b", "naïve", "a/b"]
GOOD_NAMES = ["a" * MAX_QUEUE_NAME, "partner_api", "_x", "reports.v2-b"]
BAD_LIMITS = [0, -1, MAX_LIMIT + 1, 3_000_000_000]
GOOD_LIMITS = [1, 5, MAX_LIMIT]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_every_interface_refuses_a_name_no_queue_can_have(name):
    with pytest.raises(ConfigurationError, match="is not a queue name"):
        Settings(queue_limits={name: 1})
    with pytest.raises(InvalidQueueName, match="is not a queue name"):
        check_name(name)
    with pytest.raises(pydantic.ValidationError):
        JobRequest.model_validate({"actor_name": "a", "queue_name": name})


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_every_interface_accepts_a_queue_name(name):
    assert Settings(queue_limits={name: 1}).queue_limits == ((name, 1),)
    assert check_name(name) == name
    assert JobRequest.model_validate({"actor_name": "a", "queue_name": name}).queue_name == name


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_every_interface_refuses_a_limit_out_of_range(limit):
    bound = f"from 1 to {MAX_LIMIT}"
    with pytest.raises(ConfigurationError, match=bound):
        Settings(queue_limits={"partner_api": limit})
    with pytest.raises(ConfigurationError, match=bound):
        Settings.load(environ={"DRAMATIQ_PG_QUEUE_LIMITS": f"partner_api={limit}"})
    with pytest.raises(InvalidQueueLimit, match=bound):
        check_limit(limit)
    with pytest.raises(argparse.ArgumentTypeError, match=bound):
        _limit(str(limit))
    with pytest.raises(pydantic.ValidationError):
        LimitRequest.model_validate({"limit": limit})


@pytest.mark.parametrize("limit", GOOD_LIMITS)
def test_every_interface_accepts_a_limit_in_range(limit):
    assert Settings(queue_limits={"q": limit}).queue_limits == (("q", limit),)
    assert check_limit(limit) == _limit(str(limit)) == limit
    assert LimitRequest.model_validate({"limit": limit}).limit == limit


def test_a_code_limit_out_of_range_is_refused_when_the_broker_is_built():
    with pytest.raises(ConfigurationError, match=f"'big'.* from 1 to {MAX_LIMIT}, not 3000000000"):
        PostgresBroker(url="postgresql://localhost/none", queue_limits={"big": 3_000_000_000})
