"""The worker's side of a workflow's steps: the piped input in, the result out, and
children spawned at run time."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from ..errors import InvalidMessage, NotAWorkflowStep, WorkflowResultNotEncodable
from .building import INPUT_OPTION, NODE_OPTION, PIPED_OPTION, Node, build_input
from .store import WorkflowStore, decode_result, encode_result

logger = logging.getLogger("dramatiq_pg_broker.workflows")

#: The namespace of the ids of spawned children: an attempt that runs again spawns the
#: same ids (the nth child of a node is always the same node), so that it adds nothing.
_SPAWN_NAMESPACE = uuid.UUID("0f7d1c34-5a0e-4e52-9d0c-6a3f1b8e2d71")


class WorkflowSteps(Middleware):
    """Installed by the broker. For a message of a workflow's step only (its options name
    its node; every other message passes through untouched, with no statement):

    - before its actor runs, the previous step's result is appended to its arguments
      (unless its message asked ``pipe_ignore``), read with the claim that brought it
      (:meth:`prepare`, one statement for every step's job of the claim), or on its own
      if that read failed;
    - after its actor returned, the result is stored on its node (one statement; none for
      None, which a node without a result passes on), before the worker writes the job's
      success (whose transaction moves the workflow on).
      A result the encoder cannot write fails the message when a step after it takes
      that result (:class:`~dramatiq_pg_broker.errors.WorkflowResultNotEncodable`).

    Parameters:
      store(WorkflowStore): the workflows of the broker's schema.
    """

    def __init__(self, store: WorkflowStore) -> None:
        self.store = store

    def prepare(self, proxies: list) -> None:
        """The consumer's hook after a claim: the piped inputs of the claimed messages
        that take one, read in one statement and kept on each message's proxy for
        :meth:`before_process_message` (a claim of plain messages costs a look at each
        one's options, no statement). A step's input is final once its job exists: the
        nodes it is made of ended before the job was sent, their results written before
        their successes."""
        wanted = {}
        for proxy in proxies:
            options = proxy.options
            if NODE_OPTION in options and options.get(INPUT_OPTION):
                wanted[options[NODE_OPTION]] = proxy
        if not wanted:
            return
        inputs = self.store.node_inputs(list(wanted))
        for node, proxy in wanted.items():
            if node in inputs:
                proxy.prepared = inputs[node]

    def before_process_message(self, broker, message) -> None:
        options = message.options
        if NODE_OPTION not in options or not options.get(INPUT_OPTION):
            return
        prepared = getattr(message, "prepared", None)
        if prepared is not None:
            spec, results = prepared
        else:
            spec, results = self.store.node_input(options[NODE_OPTION])
        if spec is None:
            return
        value = build_input(spec, {k: decode_result(v) for k, v in results.items()})
        inner = message._message
        # A retried attempt's message is the one the attempt before it ran (Dramatiq's
        # Retries stored it on the row): its last argument is that attempt's input.
        args = inner.args[:-1] if inner.options.get(PIPED_OPTION) else inner.args
        message._message = inner.copy(args=(*args, value), options={PIPED_OPTION: True})

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        node = message.options.get(NODE_OPTION)
        if node is None or exception is not None or result is None:
            # None is what a node without a stored result passes on: nothing to write.
            return
        data = encode_result(result)
        if data is None:
            if self.store.result_wanted(node):
                # The step fails for good (its result would be the same again), with this
                # error: the next step never runs with None in place of its input. An
                # exception raised here would only be logged (Dramatiq's emit_after).
                error = WorkflowResultNotEncodable(
                    f"the result of job {message.message_id} (workflow step {node}) cannot "
                    f"be encoded, and the next step takes it: {type(result).__name__}"
                )
                logger.error("%s", error)
                message.stuff_exception(error)
                message.fail()
                return
            logger.warning(
                "The result of job %s (workflow step %s) cannot be encoded; no step takes it.",
                message.message_id,
                node,
            )
            return
        self.store.store_result(node, message.message_id, data)


def spawn(current: Any, store: WorkflowStore, sender: Any, messages: tuple) -> list:
    """:meth:`CurrentJob.spawn <dramatiq_pg_broker.CurrentJob.spawn>`."""
    parent = current.message.options.get(NODE_OPTION)
    if parent is None:
        raise NotAWorkflowStep(
            f"job {current.id} is not a workflow's step: spawn() adds children to one"
        )
    children = []
    for message in messages:
        if not isinstance(message, dramatiq.Message):
            raise InvalidMessage(
                f"spawn() takes messages (actor.message(...)), not {type(message).__name__}"
            )
        current._spawned += 1
        name = f"{parent}/{current._spawned}"
        node_id = str(uuid.uuid5(_SPAWN_NAMESPACE, name))
        job_id = str(uuid.uuid5(_SPAWN_NAMESPACE, name + "/job"))
        options = {k: v for k, v in message.options.items() if k != "pipe_target"}
        options[NODE_OPTION] = node_id
        child = dramatiq.Message(
            queue_name=message.queue_name,
            actor_name=message.actor_name,
            args=tuple(message.args),
            kwargs=dict(message.kwargs),
            options=options,
            message_id=job_id,
            message_timestamp=message.message_timestamp,
        )
        node = Node(id=node_id, message=child, step=0, position=0, waits_for=[], input=None)
        children.append((node, sender.job_for(child)[0]))
    store.spawn(parent, children)
    return [node.message for node, _ in children]
