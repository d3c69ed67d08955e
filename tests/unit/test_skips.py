"""Who skipped a message: the middleware (or actor) whose code raised ``SkipMessage``,
found from the exception's traceback, whatever helper raised it."""

from __future__ import annotations

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AgeLimit, Middleware, SkipMessage

from dramatiq_pg_broker.attempt.skips import describe_skip


def refuse(text: str) -> None:
    raise SkipMessage(text)


class Gate(Middleware):
    def before_process_message(self, broker, message):
        refuse("closed")  # raised by a helper: the middleware is still the skipper


def caught(call) -> SkipMessage:
    try:
        call()
    except SkipMessage as e:
        return e
    raise AssertionError("no skip")


def test_a_middleware_is_named_even_when_a_helper_raised():
    skip = describe_skip(caught(lambda: Gate().before_process_message(None, None)))
    assert skip == {
        "reason": "middleware",
        "skipped_by": f"{__name__}.Gate",
        "message": "closed",
    }


def test_the_age_limit_and_an_actor_have_their_own_reasons():
    broker = StubBroker()
    try:

        @dramatiq.actor(broker=broker, max_age=1)
        def old():
            raise SkipMessage()

        message = old.message()
        message = MessageProxy(message.copy(message_timestamp=0))
        by_age = caught(lambda: AgeLimit().before_process_message(broker, message))
        assert describe_skip(by_age) == {
            "reason": "age_limit",
            "skipped_by": "dramatiq.middleware.age_limit.AgeLimit",
            "message": "Message age limit exceeded",
        }
        by_actor = caught(old)
        assert describe_skip(by_actor) == {"reason": "actor", "skipped_by": "old", "message": None}
    finally:
        broker.close()


def test_a_skip_with_no_known_author_says_so():
    assert describe_skip(SkipMessage("?"))["skipped_by"] == "unknown"
    assert describe_skip(None) == {"reason": "middleware", "skipped_by": "unknown", "message": None}
