"""A workflow's dashboard page in a real headless Chromium, against the admin API under
gunicorn: the graph of its steps coloured by state, each step a link to its job's page,
the link back from a job's page, an operator's abort, and a member who cannot open a
workflow they did not create."""

from __future__ import annotations

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, workflow
from dramatiq_pg_broker.jobs import Attempt
from tests.integration.admin_support import AdminEnv

from .browser import api_stack, chromium
from .test_dashboard_browser import css, log_in, screenshot, text_of, wait

pytestmark = pytest.mark.slow

QUEUE = "wf_dash"


@pytest.fixture(scope="module")
def accounts(pg_url, schema):
    env = AdminEnv(pg_url, schema)
    yield env
    env.close()


@pytest.fixture(scope="module")
def stack(pg_url, schema, accounts, tmp_path_factory):
    with api_stack(pg_url, schema, tmp_path_factory.mktemp("workflows-e2e")) as stack:
        yield stack


@pytest.fixture
def browser(stack):
    with chromium() as driver:
        yield driver


@pytest.fixture
def flow(pg_url, schema, conn):
    """A workflow of three steps (a, a group of two, c) whose first step succeeded and whose
    group runs: its nodes are succeeded, running, running and pending."""
    conn.execute(
        sql.SQL("TRUNCATE {0}.jobs, {0}.jobs_history, {0}.workflows CASCADE").format(
            sql.Identifier(schema)
        )
    )
    broker = PostgresBroker(url=pg_url, schema=schema)

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="wf_dash.step")
    def step(*args):
        return None

    run = workflow(
        step.message("a"),
        dramatiq.group([step.message("b1"), step.message("b2")]),
        step.message("c"),
        name="nightly report",
    ).run(broker=broker)
    (claimed,) = broker.store.claim(QUEUE, 10, "w", 60)
    broker.store.complete([Attempt(claimed.id, "w", claimed.attempts)])
    yield run
    broker.close()


def graph_view(driver) -> dict | None:
    """The workflow page's graph and status, read at once (None until four steps show)."""
    steps = css(driver, "#workflow-graph a.step")
    if len(steps) != 4:
        return None
    rects = [s.find_element("css selector", "rect") for s in steps]
    return {
        "status": [s.get_attribute("data-status") for s in steps],
        "jobs": [s.get_attribute("data-job") for s in steps],
        "fills": [r.get_attribute("stroke") for r in rects],
        "xs": [float(r.get_attribute("x")) for r in rects],
        "state": text_of(driver, "#workflow-status"),
        "title": text_of(driver, "#view h1") or "",
    }


def test_the_graph_of_a_workflow_s_steps_coloured_by_state(stack, accounts, browser, flow):
    log_in(browser, stack, "operator", f"/dashboard/workflows/{flow.id}")
    # The page redraws itself every few seconds: what it shows is read in one go, again
    # if a redraw replaced the elements meanwhile.
    view = wait(browser, stack, "the workflow's graph", graph_view)
    assert view["status"] == ["succeeded", "running", "running", "pending"]
    # Each box is drawn in its state's colour.
    fills = view["fills"]
    assert fills[0] == "#1a7f37" and fills[1] == fills[2] == "#0969da" and fills[3] == "#8c959f"
    assert view["state"] == "running"
    assert "nightly report" in view["title"]
    # Three columns: the group's members stand side by side in the middle one.
    xs = view["xs"]
    assert xs[0] < xs[1] == xs[2] < xs[3]
    screenshot(browser, "dashboard-workflow.png")

    # A step is a link to its job's page, which links back to the workflow.
    job_id = view["jobs"][1]
    browser.get(stack.base + f"/dashboard/jobs/{job_id}")
    link = wait(browser, stack, "the job's workflow link", lambda d: css(d, "#job-workflow"))
    assert flow.id[:8] in link[0].text
    link[0].click()
    wait(browser, stack, "back on the workflow's page", lambda d: css(d, "#workflow-abort"))

    # The operator aborts it: the page shows it cancelled, its steps cancelled.
    css(browser, "#workflow-abort")[0].click()
    wait(browser, stack, "the confirmation", lambda d: css(d, "#confirm-yes")[0].is_displayed())
    css(browser, "#confirm-yes")[0].click()
    wait(
        browser,
        stack,
        "the workflow cancelled",
        lambda d: (
            text_of(d, "#workflow-status") == "cancelled"
            and [s.get_attribute("data-status") for s in css(d, "#workflow-graph a.step")]
            == ["succeeded", "cancelled", "cancelled", "cancelled"]
        ),
    )
    assert css(browser, "#workflow-retry")
    assert flow.status() == "cancelled"

    # The list links to it.
    browser.get(stack.base + "/dashboard/workflows")
    row = wait(
        browser, stack, "the workflow list", lambda d: css(d, f'tr[data-workflow="{flow.id}"]')
    )
    assert "cancelled" in row[0].text and "1 of 4" in row[0].text


def test_a_viewer_sees_the_graph_without_buttons(stack, accounts, browser, flow):
    log_in(browser, stack, "viewer", f"/dashboard/workflows/{flow.id}")
    wait(
        browser, stack, "the workflow's graph", lambda d: len(css(d, "#workflow-graph a.step")) == 4
    )
    assert not css(browser, "#workflow-abort") and not css(browser, "#workflow-retry")


def test_a_member_cannot_open_a_workflow_they_did_not_create(stack, accounts, browser, flow):
    log_in(browser, stack, "member", f"/dashboard/workflows/{flow.id}")
    wait(browser, stack, "a not-found page", lambda d: "No workflow" in (text_of(d, "main") or ""))
    assert not css(browser, "#workflow-graph")
