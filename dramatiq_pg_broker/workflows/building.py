"""A workflow's steps as nodes: one node per message, each knowing which nodes it waits
for and how its piped input is made (see :mod:`dramatiq_pg_broker.workflows`)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from typing import Any

import dramatiq

from ..errors import InvalidMessage

#: The message options a workflow's message carries (encoded with it): its node, and
#: whether its actor takes the previous step's result as its last argument.
NODE_OPTION = "workflow_node"
INPUT_OPTION = "workflow_input"
#: Set on the message an attempt runs once its piped input is its last argument: a retry
#: stores that message on the job's row (Dramatiq's Retries re-enqueues it), and the next
#: attempt replaces that argument instead of appending a second one.
PIPED_OPTION = "workflow_piped"

#: Options of Dramatiq's pipeline that a workflow replaces with its own rows.
_PIPELINE_OPTIONS = ("pipe_target",)


@dataclasses.dataclass
class Node:
    """One message of a workflow, before it is stored.

    Attributes:
      id(str): the node's id (stable: a retried node keeps it, its job gets a new one).
      message(Message): the message its job runs (its id is the job's).
      step(int): the top-level step it belongs to, from 0.
      position(int): its place in the workflow's order (a group's members in order).
      waits_for(list[str]): the nodes it starts after.
      input(dict): how its piped input is made (None: it takes none).
      dependents(list[str]): the nodes that wait for it (filled in by :func:`compile_steps`).
    """

    id: str
    message: dramatiq.Message
    step: int
    position: int
    waits_for: list[str]
    input: dict | None
    dependents: list[str] = dataclasses.field(default_factory=list)


class Workflow:
    """Steps that run in order: see :func:`workflow`."""

    def __init__(self, steps: Iterable[Any], *, name: str | None = None) -> None:
        self.steps = list(steps)
        if not self.steps:
            raise InvalidMessage("a workflow needs at least one step")
        for step in self.steps:
            _check_step(step)
        self.name = name
        #: This object's last run (a WorkflowRun), on the broker that stored it.
        self._last_run: Any = None

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        return f"workflow({', '.join(map(repr, self.steps))})"

    def run(self, *, broker: dramatiq.Broker | None = None, created_by: str | None = None):
        """Store the workflow and send the jobs of its first step, in one transaction.

        Parameters:
          broker(PostgresBroker): the broker to run it on (default: the first message's
            actor's broker, else ``dramatiq.get_broker()``).
          created_by(str): who runs it, as the admin API's users are named (a member of
            the admin API sees only the workflows created by them).

        Returns:
          WorkflowRun: the running workflow's handle (``.id``, ``.status()``, ``.wait()``).

        Raises:
          InvalidMessage: a message is given more than once (each message is one job), or
            was sent already: this workflow run a second time (build its messages again),
            while its earlier run is stored (a run rolled back with the application's
            transaction may run again).
        """
        from ..errors import WorkflowNotFound
        from .runs import run_workflow
        from .store import SENT_ALREADY

        # In memory, so that a first run pays nothing: a second run looks up the first's
        # row on the broker that stored it (one key read). The run's own start refuses
        # what this does not see (two runs at once, the same messages in another object,
        # a run not committed yet).
        last = self._last_run
        if last is not None:
            try:
                last.status()
            except WorkflowNotFound:
                pass  # rolled back with the application's transaction: it may run again
            else:
                raise InvalidMessage(SENT_ALREADY)
        self._last_run = run_workflow(self, broker=broker, created_by=created_by)
        return self._last_run


def workflow(*steps: Any, name: str | None = None) -> Workflow:
    """Steps that run in order, each once the one before it has succeeded.

    Each step is a ``dramatiq.Message`` (``actor.message(...)``), a ``dramatiq.group``
    (its members run side by side; the next step starts once every one has succeeded), a
    ``dramatiq.pipeline`` (its messages in order) or another ``workflow``. Results pass on
    as a pipeline passes them: a step's actor gets the previous step's result as its last
    argument (a group's as a list, in member order), unless its message was built with
    ``pipe_ignore=True``.

    Parameters:
      steps: the steps, in order.
      name(str): a name to show beside the workflow's id.

    Returns:
      Workflow: run it with ``.run()``.

    Raises:
      InvalidMessage: a step is none of these.
    """
    return Workflow(steps, name=name)


def _check_step(step: Any) -> None:
    if isinstance(step, (dramatiq.Message, Workflow)):
        return
    if isinstance(step, dramatiq.pipeline):
        return
    if isinstance(step, dramatiq.group):
        for child in step.children:
            if isinstance(child, dramatiq.group):
                raise InvalidMessage("a group inside a group: put the inner group in a workflow")
            _check_step(child)
        return
    raise InvalidMessage(
        "a workflow's step is a dramatiq.Message, group, pipeline or workflow, "
        f"not {type(step).__name__}"
    )


class _Compiler:
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, message: dramatiq.Message, step: int, waits_for: list[str], piped) -> Node:
        pipe_ignore = message.options.get("pipe_ignore", False)
        node = Node(
            id=str(uuid.uuid4()),
            message=message,
            step=step,
            position=len(self.nodes),
            # Once each: a group whose members are empty pipelines names the step before
            # it once per member.
            waits_for=list(dict.fromkeys(waits_for)),
            input=None if pipe_ignore or piped is None else piped,
        )
        self.nodes.append(node)
        return node

    def compile(self, step: Any, index: int | None, waits_for: list[str], piped):
        """Add the nodes of ``step``; returns (the nodes the next step waits for, how
        this step's result is made for it)."""
        if isinstance(step, dramatiq.Message):
            node = self.add(step, index, waits_for, piped)
            return [node.id], {"one": node.id}
        if isinstance(step, dramatiq.pipeline):
            return self.sequence(step.messages, index, waits_for, piped)
        if isinstance(step, Workflow):
            return self.sequence(step.steps, index, waits_for, piped)
        if not step.children:
            # A group of no member (a fan-out over no items) is done when the step before
            # it is, and passes an empty list on.
            return waits_for, {"list": []}
        ends: list[str] = []
        results = []
        for child in step.children:
            child_ends, child_result = self.compile(child, index, waits_for, piped)
            ends.extend(child_ends)
            results.append(child_result)
        return ends, {"list": results}

    def sequence(self, steps, index, waits_for, piped):
        for position, step in enumerate(steps):
            waits_for, piped = self.compile(
                step, position if index is None else index, waits_for, piped
            )
        return waits_for, piped


def compile_steps(flow: Workflow) -> tuple[list[Node], int]:
    """The nodes of ``flow`` in order, each with its dependents, and how many of them
    nothing waits for (the workflow succeeds once those are done)."""
    compiler = _Compiler()
    compiler.sequence(flow.steps, None, [], None)
    nodes = compiler.nodes
    seen: set[str] = set()
    for node in nodes:
        # A message is one job: given twice, its two nodes' jobs would share an id, and
        # the end of the step before the second could never be written.
        if node.message.message_id in seen:
            raise InvalidMessage(
                f"message {node.message.message_id} ({node.message.actor_name}) is given more "
                "than once: a workflow runs each message once, build one per step"
            )
        seen.add(node.message.message_id)
    by_id = {node.id: node for node in nodes}
    for node in nodes:
        for before in node.waits_for:
            by_id[before].dependents.append(node.id)
    for node in nodes:
        options = {k: v for k, v in node.message.options.items() if k not in _PIPELINE_OPTIONS}
        options[NODE_OPTION] = node.id
        if node.input is not None:
            options[INPUT_OPTION] = True
        node.message = dramatiq.Message(
            queue_name=node.message.queue_name,
            actor_name=node.message.actor_name,
            args=tuple(node.message.args),
            kwargs=dict(node.message.kwargs),
            options=options,
            message_id=node.message.message_id,
            message_timestamp=node.message.message_timestamp,
        )
    return nodes, sum(1 for node in nodes if not node.dependents)


def input_sources(spec: Any) -> list[str]:
    """The nodes whose results an input ``spec`` is made of."""
    if spec is None:
        return []
    if "one" in spec:
        return [spec["one"]]
    return [source for part in spec["list"] for source in input_sources(part)]


def build_input(spec: Any, results: dict[str, Any]) -> Any:
    """The value an input ``spec`` stands for, from the results of its nodes."""
    if "one" in spec:
        return results.get(spec["one"])
    return [build_input(part, results) for part in spec["list"]]
