"""The dashboard in a real headless Chromium, against the admin API under gunicorn and a
real dramatiq worker: what an operator, a viewer and a member see and can do.

Set ``DASHBOARD_SCREENSHOTS`` to a folder (``docs/images``) to save the docs' screenshots on
the way.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg import sql

from dramatiq_pg_broker.config import Settings
from tests.helpers import server_up_for
from tests.integration.admin_support import PASSWORD, AdminEnv

from .browser import api_stack, chromium, new_driver

pytestmark = pytest.mark.slow

QUEUE = "dash"


@pytest.fixture(scope="module")
def accounts(pg_url, schema):
    """One user and one API token per role (viewer@example.com ...), and a second member.
    The actors are declared as workers that ran before would have left them (the API
    creates jobs only for declared actors), so jobs can be created before a worker
    starts: ``dash.later`` and ``dash.missing`` are run by no worker of these tests."""
    env = AdminEnv(pg_url, schema)
    env.declare(
        {
            "dash.add": QUEUE,
            "dash.flaky": QUEUE,
            "dash.sleep": QUEUE,
            "dash.later": "dash_later",
            "dash.missing": "member_q",
        }
    )
    other = env.accounts.create_user("other-member@example.com", PASSWORD, "member")
    env.tokens["other"] = env.accounts.create_token(other.id, "tests").secret
    yield env
    env.close()


@pytest.fixture(scope="module")
def stack(pg_url, schema, accounts, tmp_path_factory):
    with api_stack(pg_url, schema, tmp_path_factory.mktemp("dashboard-e2e")) as stack:
        yield stack


@pytest.fixture
def browser(stack):
    with chromium() as driver:
        yield driver


def wait(driver, stack, what: str, condition, timeout: float = 60):
    """Poll ``condition(driver)`` until it is truthy; fail with what the page showed."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = condition(driver)
            if value:
                return value
        except Exception as error:  # the page is re-rendering under us: look again
            last_error = error
        time.sleep(0.1)
    body = driver.find_element("tag name", "body").text[:2000]
    pytest.fail(
        f"{what}: not within {timeout} s (last error: {last_error!r})\npage text:\n{body}\n"
        f"{stack.tails()}"
    )


def css(driver, selector: str):
    return driver.find_elements("css selector", selector)


def text_of(driver, selector: str) -> str | None:
    found = css(driver, selector)
    return found[0].text.strip() if found else None


def log_in(driver, stack, role: str, path: str = "/dashboard") -> None:
    driver.delete_all_cookies()
    driver.get(stack.base + path)
    email = wait(
        driver,
        stack,
        "the login form",
        lambda d: [e for e in css(d, "#login-email") if e.is_displayed()],
    )
    # By keyboard: type, then Enter submits the form.
    email[0].send_keys(f"{role}@example.com")
    css(driver, "#login-password")[0].send_keys(PASSWORD + "\n")
    wait(
        driver, stack, f"{role} logged in", lambda d: f"({role})" in (text_of(d, "#who-text") or "")
    )


def screenshot(driver, name: str) -> None:
    """Save a screenshot for the docs, in 64 colours (a tenth of the size)."""
    folder = os.environ.get("DASHBOARD_SCREENSHOTS")
    if not folder:
        return
    from PIL import Image

    Path(folder).mkdir(parents=True, exist_ok=True)
    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(
        Path(folder) / name, optimize=True
    )


def queue_cell(driver, field: str) -> str | None:
    return text_of(driver, f'#queues tr[data-queue="{QUEUE}"] td[data-field="{field}"]')


def test_an_operator_sees_counts_change_and_retries_a_failed_job(
    stack, accounts, browser, tmp_path
):
    token = accounts.tokens["operator"]
    flag = tmp_path / "fixed"
    for i in range(5):
        stack.api(
            "POST",
            "/api/jobs",
            token,
            {"actor_name": "dash.add", "queue_name": QUEUE, "args": [i, 1]},
        )
    flaky = stack.api(
        "POST",
        "/api/jobs",
        token,
        {"actor_name": "dash.flaky", "queue_name": QUEUE, "args": [str(flag)]},
    )

    for i in range(4):
        stack.api(
            "POST",
            "/api/jobs",
            token,
            {
                "actor_name": "dash.later",
                "queue_name": "dash_later",
                "args": [i, 2],
                "delay": 3_600_000,
            },
        )

    log_in(browser, stack, "operator")
    wait(browser, stack, "6 ready jobs on the overview", lambda d: queue_cell(d, "ready") == "6")
    assert queue_cell(browser, "delayed") == "0"
    later = 'tr[data-queue="dash_later"] td[data-field="delayed"]'
    assert text_of(browser, f"#queues {later}") == "4"
    assert queue_cell(browser, "running") == "0" and queue_cell(browser, "failed") == "0"

    # The page is not reloaded from here on: the counts change as the worker runs the jobs.
    marker = browser.execute_script("return window.performance.timeOrigin")
    stack.start_worker()
    wait(
        browser,
        stack,
        "the queue drained and one job failed",
        lambda d: queue_cell(d, "ready") == "0" and queue_cell(d, "failed") == "1",
    )
    assert browser.execute_script("return window.performance.timeOrigin") == marker
    wait(
        browser,
        stack,
        "the throughput chart showing 5 succeeded",
        lambda d: "Succeeded: 5" in (text_of(d, "#chart-throughput .legend") or ""),
    )
    screenshot(browser, "dashboard-overview.png")

    # Filter the job list to the failed job and open it.
    css(browser, 'a[data-section="jobs"]')[0].click()
    wait(browser, stack, "the job list", lambda d: css(d, "#filter-status"))
    from selenium.webdriver.support.ui import Select

    Select(css(browser, "#filter-status")[0]).select_by_value("failed")
    css(browser, "#filter-queue")[0].send_keys(QUEUE)
    css(browser, "#filter-apply")[0].click()
    wait(
        browser,
        stack,
        "the list filtered to one failed job",
        lambda d: "status=failed" in d.current_url and len(css(d, "#jobs tr[data-job]")) == 1,
    )
    row = css(browser, "#jobs tr[data-job]")[0]
    assert row.get_attribute("data-job") == flaky["id"]
    row.find_element("css selector", "a").click()

    wait(
        browser,
        stack,
        "the job's timeline with its failure",
        lambda d: (
            [li.get_attribute("data-type") for li in css(d, "#events li")]
            == ["created", "claimed", "failed"]
        ),
    )
    assert "does not exist yet" in text_of(browser, "#job-error")
    assert css(browser, "#timeline svg circle[data-type=failed]")
    assert '"args"' in text_of(browser, "#job-args")

    # Retry asks first; going back changes nothing.
    css(browser, "#retry")[0].click()
    wait(
        browser,
        stack,
        "the confirmation",
        lambda d: css(d, "#confirm")[0].get_attribute("open") is not None,
    )
    css(browser, "#confirm-no")[0].click()
    time.sleep(0.5)
    assert stack.api("GET", f"/api/jobs/{flaky['id']}", token)["status"] == "failed"

    flag.touch()
    css(browser, "#retry")[0].click()
    wait(
        browser,
        stack,
        "the confirmation",
        lambda d: css(d, "#confirm")[0].get_attribute("open") is not None,
    )
    css(browser, "#confirm-yes")[0].click()
    wait(
        browser,
        stack,
        "the retried job running again and succeeding",
        lambda d: (
            [li.get_attribute("data-type") for li in css(d, "#events li")]
            == ["created", "claimed", "failed", "manual_retry", "claimed", "succeeded"]
        ),
    )
    wait(
        browser,
        stack,
        "the status badge saying succeeded",
        lambda d: css(d, 'h1 .badge[data-status="succeeded"]'),
    )
    assert not css(browser, "#retry")
    browser.execute_script("window.scrollTo(0, 0)")
    screenshot(browser, "dashboard-job.png")

    # Cancel a delayed job: it asks, then the job is cancelled and the button is gone.
    later_jobs = stack.api("GET", "/api/jobs?queue=dash_later", token)["results"]
    browser.get(f"{stack.base}/dashboard/jobs/{later_jobs[0]['id']}")
    wait(browser, stack, "the Cancel button of a queued job", lambda d: css(d, "#cancel"))
    css(browser, "#cancel")[0].click()
    wait(browser, stack, "the confirmation", dialog_open)
    css(browser, "#confirm-yes")[0].click()
    wait(
        browser,
        stack,
        "the job cancelled",
        lambda d: css(d, 'h1 .badge[data-status="cancelled"]') and not css(d, "#cancel"),
    )
    assert stack.api("GET", f"/api/jobs/{later_jobs[0]['id']}", token)["status"] == "cancelled"


def dialog_open(driver) -> bool:
    return css(driver, "#confirm")[0].get_attribute("open") is not None


def test_every_control_has_a_label_and_the_page_fits_a_laptop(stack, accounts, browser):
    log_in(browser, stack, "operator", "/dashboard/jobs")
    wait(browser, stack, "the job list", lambda d: css(d, "#filters"))
    unlabelled = browser.execute_script(
        """return [...document.querySelectorAll('input, select, textarea')]
             .filter((e) => e.offsetParent !== null)
             .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
             .map((e) => e.id || e.name);"""
    )
    assert unlabelled == []
    nameless = browser.execute_script(
        """return [...document.querySelectorAll('button, a')]
             .filter((e) => e.offsetParent !== null && !e.textContent.trim()
                     && !e.getAttribute('aria-label'))
             .map((e) => e.outerHTML);"""
    )
    assert nameless == []
    # 1366 pixels wide: nothing scrolls sideways.
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )


def test_a_viewer_sees_a_failed_job_but_no_retry_button(stack, accounts, browser, tmp_path):
    token = accounts.tokens["operator"]
    flag = tmp_path / "never"
    if not any(p.log.name.startswith("worker") for p in stack.processes):
        stack.start_worker()
    job = stack.api(
        "POST",
        "/api/jobs",
        token,
        {"actor_name": "dash.flaky", "queue_name": QUEUE, "args": [str(flag)]},
    )
    stack.wait_for(
        "the job failing",
        lambda: stack.api("GET", f"/api/jobs/{job['id']}", token)["status"] == "failed",
    )
    log_in(browser, stack, "viewer", f"/dashboard/jobs/{job['id']}")
    wait(
        browser, stack, "the failed job's page", lambda d: css(d, 'h1 .badge[data-status="failed"]')
    )
    wait(browser, stack, "its timeline", lambda d: css(d, '#events li[data-type="failed"]'))
    assert not css(browser, "#retry") and not css(browser, "#cancel")
    # The overview is there for a viewer.
    assert css(browser, "#nav-overview")[0].is_displayed()


def test_a_member_sees_only_its_own_jobs(stack, accounts, browser):
    mine = [
        stack.api(
            "POST",
            "/api/jobs",
            accounts.tokens["member"],
            {"actor_name": "dash.missing", "queue_name": "member_q", "args": [i]},
        )["id"]
        for i in range(3)
    ]
    theirs = stack.api(
        "POST",
        "/api/jobs",
        accounts.tokens["other"],
        {"actor_name": "dash.missing", "queue_name": "member_q", "args": ["x"]},
    )["id"]

    log_in(browser, stack, "member")
    # A member lands on its own job list: the overview counts everyone's jobs.
    wait(
        browser,
        stack,
        "the member's job list",
        lambda d: {r.get_attribute("data-job") for r in css(d, "#jobs tr[data-job]")} == set(mine),
    )
    assert "3 of 3" in text_of(browser, "#jobs-count")
    assert not css(browser, "#nav-overview")[0].is_displayed()

    browser.get(f"{stack.base}/dashboard/jobs/{theirs}")
    wait(
        browser,
        stack,
        "someone else's job not found, on a page of its own",
        lambda d: "No job has the id" in (text_of(d, "#bad-address") or ""),
    )
    assert not css(browser, "#job-fields")
    assert css(browser, 'a[href="/dashboard/jobs"]'), "a way back"

    browser.get(f"{stack.base}/dashboard/jobs/{mine[0]}")
    wait(browser, stack, "its own job's page", lambda d: css(d, "#job-fields"))
    assert not css(browser, "#retry") and not css(browser, "#cancel")


def ensure_worker(stack) -> None:
    if not stack.workers():
        stack.start_worker()


def test_an_operator_aborts_a_running_job_and_pauses_a_queue(stack, accounts, browser):
    token = accounts.tokens["operator"]
    ensure_worker(stack)
    job = stack.api("POST", "/api/jobs", token, {"actor_name": "dash.sleep", "args": [60]})
    stack.wait_for(
        "the job running",
        lambda: stack.api("GET", f"/api/jobs/{job['id']}", token)["status"] == "running",
    )
    log_in(browser, stack, "operator", f"/dashboard/jobs/{job['id']}")
    wait(browser, stack, "the Abort button of a running job", lambda d: css(d, "#abort"))
    css(browser, "#abort")[0].click()
    wait(browser, stack, "the confirmation", dialog_open)
    assert "Abort job" in text_of(browser, "#confirm-title")
    css(browser, "#confirm-yes")[0].click()
    wait(
        browser,
        stack,
        "the job cancelled, its timeline ending with the abort",
        lambda d: (
            css(d, 'h1 .badge[data-status="cancelled"]')
            and [li.get_attribute("data-type") for li in css(d, "#events li")][-2:]
            == ["abort_requested", "aborted"]
        ),
        timeout=15,
    )
    assert not css(browser, "#abort")
    assert "operator@example.com" in text_of(browser, "#abort-requested")
    # The time of the abort is never cut in two by a line break.
    assert (
        browser.execute_script(
            "return document.querySelector('#abort-requested .time').getClientRects().length"
        )
        == 1
    )
    assert stack.api("GET", f"/api/jobs/{job['id']}", token)["status"] == "cancelled"

    # The overview: the queue's state, its toggle, and the live worker.
    browser.get(stack.base + "/dashboard")
    row = f'#queues tr[data-queue="{QUEUE}"]'
    wait(
        browser,
        stack,
        "the queue's Pause button",
        lambda d: css(d, f'{row} button[data-action="pause"]'),
    )
    wait(browser, stack, "the worker listed", lambda d: css(d, "#workers tr[data-worker]"))
    css(browser, f'{row} button[data-action="pause"]')[0].click()
    wait(browser, stack, "the confirmation", dialog_open)
    css(browser, "#confirm-yes")[0].click()
    wait(
        browser,
        stack,
        "the queue shown paused",
        lambda d: css(d, f'{row}[data-paused="true"] button[data-action="resume"]'),
    )
    paused = {q["queue_name"]: q for q in stack.api("GET", "/api/queues", token)["results"]}
    assert paused[QUEUE]["paused"] and paused[QUEUE]["paused_by"] == "operator@example.com"
    css(browser, f'{row} button[data-action="resume"]')[0].click()
    wait(browser, stack, "the queue active again", lambda d: css(d, f'{row}[data-paused="false"]'))


def test_names_arguments_and_errors_cannot_pass_for_others(stack, accounts, browser):
    spoof = "invoice\u202egnp.exe"
    long_name = "reports." + "x" * 240
    # The failed job first: a claim takes a queue's first runnable job.
    failed = accounts.failed(actor=spoof, queue="names_q")
    for actor in (spoof, long_name):
        accounts.enqueue(actor=actor, queue="names_q")
    with accounts.pool.connection() as conn:
        conn.execute(
            f'UPDATE "{accounts.settings.schema}".jobs_history SET last_error = %s, message = %s'
            " WHERE id = %s",
            ("boom \u202eevil\nsecond line", '{"args": ["a\u200bb"], "kwargs": {}}', failed),
        )
    log_in(browser, stack, "operator", "/dashboard/jobs?queue=names_q")
    wait(browser, stack, "the three jobs listed", lambda d: len(css(d, "#jobs tr[data-job]")) == 3)
    body = browser.find_element("tag name", "body").text
    assert "\u202e" not in body and "invoice\\u202egnp.exe" in body
    assert "boom \\u202eevil" in body
    # A long name is cut, in one line, with the whole of it on hover; nothing scrolls sideways.
    cell = next(
        c
        for c in css(browser, "#jobs td .name")
        if (c.get_attribute("title") or "").startswith("reports.xxx")
    )
    assert cell.get_attribute("title") == long_name
    assert cell.size["width"] < 400
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )

    browser.get(f"{stack.base}/dashboard/jobs/{failed}")
    wait(browser, stack, "the failed job's page", lambda d: css(d, "#job-error"))
    assert text_of(browser, "#job-error").startswith("boom \\u202eevil")
    assert "second line" in text_of(browser, "#job-error"), "line breaks are kept"
    assert "a\\u200bb" in text_of(browser, "#job-args")
    assert "\u202e" not in browser.find_element("tag name", "body").text


def test_a_malformed_address_or_date_says_so(stack, accounts, browser):
    log_in(browser, stack, "operator", "/dashboard/jobs/%E0%A4%A")
    wait(
        browser,
        stack,
        "the malformed address explained",
        lambda d: "escaped characters are malformed" in (text_of(d, "#bad-address") or ""),
    )
    browser.get(stack.base + "/dashboard/jobs?created_after=yesterday-ish")
    wait(
        browser,
        stack,
        "the malformed date explained",
        lambda d: "is not a date and time" in (text_of(d, "#notice") or ""),
    )


def test_a_finished_jobs_page_stops_polling(stack, accounts, browser):
    job_id = accounts.succeeded(queue="done_q")
    log_in(browser, stack, "viewer", f"/dashboard/jobs/{job_id}")
    wait(browser, stack, "the job's page", lambda d: css(d, 'h1 .badge[data-status="succeeded"]'))
    count = (
        "return performance.getEntriesByType('resource')"
        f".filter((e) => e.name.endsWith('/api/jobs/{job_id}')).length"
    )
    before = browser.execute_script(count)
    time.sleep(2.5)  # a polling period of an unfinished job's page (2 s), and a margin
    assert browser.execute_script(count) == before == 1


def test_an_open_job_page_polls_kilobytes_not_its_megabyte_of_arguments(stack, accounts, browser):
    """A waiting job with 1 MiB of arguments, its page left open for ten polls (20 s):
    after the first load, each poll is two 304s without a body."""
    token = accounts.tokens["operator"]
    job = stack.api(
        "POST",
        "/api/jobs",
        token,
        {
            "actor_name": "dash.later",
            "queue_name": "dash_later",
            "args": ["x" * (1024 * 1024 - 200)],
            "delay": 3_600_000,
        },
    )
    log_in(browser, stack, "viewer", f"/dashboard/jobs/{job['id']}")
    wait(browser, stack, "the job's page", lambda d: css(d, "#job-args"))
    entries = f"""return performance.getEntriesByType('resource')
        .filter((e) => e.name.endsWith('/api/jobs/{job["id"]}')
                    || e.name.endsWith('/api/jobs/{job["id"]}/events'))
        .map((e) => [e.name.endsWith('/events'), e.transferSize, e.encodedBodySize]);"""
    found = wait(
        browser,
        stack,
        "ten polls of the job and its timeline after the first load",
        lambda d: (lambda e: e if len(e) >= 22 else None)(d.execute_script(entries)),
        timeout=45,
    )
    first_job = next(entry for entry in found if not entry[0])
    assert first_job[2] > 1024 * 1024, found[:2]
    polled = found[2:]
    moved = sum(transfer for _, transfer, _ in polled)
    assert all(body == 0 for _, _, body in polled), polled
    assert moved < 20_000, f"{moved} bytes in {len(polled)} polls after the first load"


def undeclared_job(accounts, queue: str) -> str:
    """A queued job on a queue no worker declared (as an app's send with a typo makes)."""
    from dramatiq_pg_broker.jobs import NewJob

    job_id = str(uuid.uuid4())
    message = {
        "queue_name": queue,
        "actor_name": "dash.typo",
        "args": [],
        "kwargs": {},
        "options": {},
        "message_id": job_id,
        "message_timestamp": 0,
    }
    job = NewJob(
        id=job_id, queue_name=queue, actor_name="dash.typo", message=message, max_attempts=1
    )
    assert accounts.store.enqueue(job).created
    return job_id


@contextlib.contextmanager
def worker_row(accounts, worker_id: str, queues: list[str]) -> Iterator[None]:
    """A live worker process consuming ``queues``, as the registry holds one, for the
    block: a later test of the module looks for "no worker process is running"."""

    schema = sql.Identifier(accounts.settings.schema)
    with accounts.pool.connection() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, queues, actors, version, expires_at,"
                " in_flight) VALUES (%s, 'far-host', 4242, %s, '{{}}', '0',"
                " now() + interval '10 minutes', 0)"
            ).format(schema),
            (worker_id, queues),
        )
    try:
        yield
    finally:
        with accounts.pool.connection() as conn:
            conn.execute(
                sql.SQL("DELETE FROM {}.workers WHERE id = %s").format(schema), (worker_id,)
            )


def test_the_overview_shows_idle_queues_red_and_declared_queues_first(stack, accounts, browser):
    idle, busy = "dash_idle", "dash_busy"
    accounts.declare(queues=[idle, busy])
    with worker_row(accounts, "far-host:4242:abc", [busy, "dash_other", "dash_third"]):
        undeclared = [f"a_typo_{i:02d}" for i in range(12)]
        for i, queue in enumerate(undeclared):
            for _ in range(1 + i % 2):
                undeclared_job(accounts, queue)
        long_queue = "z" + "q" * 9_999
        undeclared_job(accounts, long_queue)

        log_in(browser, stack, "operator")
        rows = wait(
            browser,
            stack,
            "the overview with the idle queue",
            lambda d: (
                css(d, f'#queues tr[data-queue="{idle}"]') and css(d, "#queues tr[data-queue]")
            ),
        )
        flags = [row.get_attribute("data-declared") for row in rows]
        first_undeclared = flags.index("false")
        assert set(flags[:first_undeclared]) == {"true"}
        assert set(flags[first_undeclared:]) == {"false"}
        assert len(flags) - first_undeclared == 10, "undeclared queues are capped at ten"
        listed = stack.api("GET", "/api/queues", accounts.tokens["viewer"])["results"]
        hidden = sum(not queue["declared"] for queue in listed) - 10
        assert hidden >= 3
        assert f"and {hidden} more queues no worker declared" in text_of(browser, "#queues-more")

        def state(queue):
            cell = f'#queues tr[data-queue="{queue}"] td[data-field="state"] .state'
            return css(browser, cell)[0]

        assert state(idle).text == "no worker"
        assert state(idle).value_of_css_property("color") == "rgba(180, 35, 24, 1)", "red"
        assert state(busy).text == "active"
        assert state(busy).value_of_css_property("color") == "rgba(26, 127, 55, 1)", "green"
        # The three queues of the worker, one per line.
        cells = css(
            browser, '#workers tr[data-worker="far-host:4242:abc"] td[data-field="queues"] div'
        )
        assert [c.text for c in cells] == [busy, "dash_other", "dash_third"]
        assert len({c.location["y"] for c in cells}) == 3
        assert browser.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth"
        )


def test_the_overview_lists_the_doctor_s_findings_problems_first(
    stack, accounts, browser, pg_url, schema
):
    """The health panel: every check of ``dramatiq-pg-broker doctor``, a warning before the
    ok ones, with its details and what to do; a viewer sees it too."""
    import psycopg

    events = sql.SQL("{}.job_events").format(sql.Identifier(schema))
    # No worker: its maintenance moves a DEFAULT partition's rows into their days, or
    # prunes old ones, and could take the planted row before the panel reads it.
    stack.stop_workers()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # An event of a day without its partition: in the DEFAULT partition.
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (job_id, type, created_at) VALUES (%s, 'created', '2001-02-03')"
            ).format(events),
            (str(uuid.uuid4()),),
        )
        try:
            log_in(browser, stack, "viewer")
            row = wait(
                browser,
                stack,
                "the DEFAULT partition's warning in the health panel",
                lambda d: css(
                    d, '#health tr[data-check="default_partitions"][data-level="warning"]'
                ),
            )[0]
            assert "job_events_default 1" in row.text and "dramatiq-pg-broker prune" in row.text
            levels = [r.get_attribute("data-level") for r in css(browser, "#health tr[data-check]")]
            assert levels[0] in ("problem", "warning") and "ok" in levels
            order = {"problem": 0, "warning": 1, "ok": 2, "skipped": 3}
            assert levels == sorted(levels, key=order.get), levels
            checks = {r.get_attribute("data-check") for r in css(browser, "#health tr[data-check]")}
            assert {"schema", "snapshot", "hot_table", "connections"} <= checks
        finally:
            conn.execute(
                sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "job_events_default"))
            )


def test_a_very_long_queue_name_is_no_link(stack, accounts, browser):
    long_queue = "y" + "q" * 9_999
    undeclared_job(accounts, long_queue)
    # Enough jobs on it to be among the ten undeclared queues shown.
    for _ in range(5):
        undeclared_job(accounts, long_queue)
    log_in(browser, stack, "operator")
    row = wait(
        browser,
        stack,
        "the long queue's row",
        lambda d: css(d, f'#queues tr[data-queue="{long_queue}"]'),
    )[0]
    assert not row.find_elements("css selector", "a"), "no link to an address too long to serve"
    assert row.find_element("css selector", "th .name").get_attribute("title") == long_queue


def test_delayed_jobs_are_listed_by_the_delayed_filter_and_said_so(stack, accounts, browser):
    queue = "dash_delay"
    accounts.declare(queues=[queue])
    delayed = [
        accounts.create_job(actor_name="dash.delayed", queue_name=queue, delay=3_600_000)["id"]
        for _ in range(3)
    ]
    accounts.create_job(actor_name="dash.delayed", queue_name=queue)
    log_in(browser, stack, "operator")
    cell = f'#queues tr[data-queue="{queue}"] td[data-field="delayed"] a'
    wait(browser, stack, "the queue's Delayed count", lambda d: css(d, cell))
    assert css(browser, cell)[0].text == "3"
    css(browser, cell)[0].click()
    wait(
        browser,
        stack,
        "the list of the delayed jobs",
        lambda d: (
            {r.get_attribute("data-job") for r in css(d, "#jobs tr[data-job]")} == set(delayed)
        ),
    )
    assert "status=delayed" in browser.current_url
    assert "3 of 3" in text_of(browser, "#jobs-count")
    selected = css(browser, "#filter-status option:checked")[0]
    assert selected.get_attribute("value") == "delayed"
    assert all(
        text_of(browser, f'#jobs tr[data-job="{job_id}"] .badge') == "delayed" for job_id in delayed
    )
    # The list of delayed jobs says when each runs.
    assert [th.text for th in css(browser, "#jobs thead th")][6] == "Runs at"
    runs_at = [
        text_of(browser, f'#jobs tr[data-job="{job_id}"] td[data-field="runs-at"]')
        for job_id in delayed
    ]
    assert all(text.startswith("in 59 min") for text in runs_at), runs_at

    browser.get(f"{stack.base}/dashboard/jobs/{delayed[0]}")
    wait(browser, stack, "the delayed job's page", lambda d: css(d, "#delayed-until"))
    words = text_of(browser, '#job-fields dd[data-field="state"]')
    assert words.startswith("delayed until "), words


def test_the_job_list_fits_a_laptop_without_wrapping_created(stack, accounts, browser):
    queue = "dash_wide"
    accounts.declare(queues=[queue])
    args = ["an argument long enough to need the whole column " * 4]
    for _ in range(3):
        accounts.create_job(actor_name="dash.wide." + "n" * 200, queue_name=queue, args=args)
    log_in(browser, stack, "operator", f"/dashboard/jobs?queue={queue}")
    wait(browser, stack, "the list", lambda d: len(css(d, "#jobs tr[data-job]")) == 3)
    assert browser.execute_script("return window.innerWidth") >= 1350
    lines = browser.execute_script(
        """return [...document.querySelectorAll('#jobs td[data-field="created"] span')]
             .map((e) => e.getClientRects().length);"""
    )
    assert lines == [1, 1, 1], "Created on one line"
    shown = browser.execute_script(
        """const cell = document.querySelector('#jobs td[data-field="args"] .name');
           return cell.getBoundingClientRect().width;"""
    )
    assert shown >= 330, f"the arguments get {shown} px"
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )


def test_an_unknown_or_malformed_job_id_gives_a_not_found_page(stack, accounts, browser):
    log_in(browser, stack, "viewer", f"/dashboard/jobs/{uuid.uuid4()}")
    wait(
        browser,
        stack,
        "the not-found page",
        lambda d: "No job has the id" in (text_of(d, "#bad-address") or ""),
    )
    assert text_of(browser, "#view h1") == "Not found"
    back = css(browser, '#view a[href="/dashboard/jobs"]')
    assert back and back[0].is_displayed()
    assert not (text_of(browser, "#notice") or "")

    # An Arabic-Indic digit in an id: not the ASCII job, and said so.
    job_id = accounts.enqueue(queue="dash_ids")
    digit = next(i for i, c in enumerate(job_id) if c.isdigit())
    other = job_id[:digit] + chr(0x0660 + int(job_id[digit])) + job_id[digit + 1 :]
    browser.get(f"{stack.base}/dashboard/jobs/{other}")
    wait(
        browser,
        stack,
        "the malformed id explained",
        lambda d: "must be a UUID" in (text_of(d, "#bad-address") or ""),
    )
    css(browser, '#view a[href="/dashboard/jobs"]')[0].click()
    wait(browser, stack, "back on the list", lambda d: css(d, "#filters"))


# -- jobs whose worker died, a queue's page, the details --------------------------------


#: The actors of these tests, apart from the other tests' worker.
OPS_ACTORS = "tests.e2e.dashboard_ops_actors"


def confirm(driver, stack) -> None:
    wait(driver, stack, "the confirmation", dialog_open)
    css(driver, "#confirm-yes")[0].click()


def api_state(stack, token: str, job_id: str) -> str:
    return stack.api("GET", f"/api/jobs/{job_id}", token)["state"]


def test_a_dead_workers_jobs_say_lease_expired_and_an_operator_requeues_them(
    stack, accounts, browser, pg_url
):
    """A real worker is killed (SIGKILL) while two jobs run: once their lease runs out the
    overview counts them as lease expired, not running, beside "No worker process is
    running"; the job's page says since when it waits for a worker; Requeue puts it back
    in its queue, and the overview's button puts back the other."""
    token = accounts.tokens["operator"]
    # No other worker: its reaper would take the jobs back before the test looks.
    stack.stop_workers()
    accounts.declare({"dash.doomed": "dash_dead"})
    jobs = [
        stack.api("POST", "/api/jobs", token, {"actor_name": "dash.doomed", "args": [600]})["id"]
        for _ in range(2)
    ]
    # A short lease, so that the test waits seconds, not the default half-minute.
    worker = stack.start_worker(
        OPS_ACTORS, queues=["dash_dead"], env={"DRAMATIQ_PG_LEASE_SECONDS": "3"}
    )

    def started(job_id: str) -> bool:
        # The row's own flag: started_at is the claim's time, and the worker records that
        # the actor began a moment after it does (a kill before that is an unstarted
        # claim, released uncharged rather than requeued as an interruption).
        with accounts.pool.connection() as conn:
            row = conn.execute(
                sql.SQL("SELECT status, started FROM {}.jobs WHERE id = %s").format(
                    sql.Identifier(accounts.settings.schema)
                ),
                (job_id,),
            ).fetchone()
        return row == ("running", True)

    stack.wait_for("both jobs started", lambda: all(started(job_id) for job_id in jobs))
    worker.kill()
    stack.wait_for(
        "both leases expired",
        lambda: all(api_state(stack, token, job_id) == "lease_expired" for job_id in jobs),
        timeout=30,
    )

    log_in(browser, stack, "operator")
    cell = '#queues tr[data-queue="dash_dead"] td[data-field="{}"]'
    wait(
        browser,
        stack,
        "the overview counting two jobs as lease expired",
        lambda d: text_of(d, cell.format("lease_expired")) == "2",
    )
    assert text_of(browser, cell.format("running")) == "0"
    assert text_of(browser, '#totals [data-total="lease_expired"] .n') == "2"
    # (A worker of an earlier test that was stopped by force keeps its row for its lease.)
    wait(
        browser,
        stack,
        "no live worker",
        lambda d: "No worker process is running." in (text_of(d, "#workers") or ""),
        timeout=90,
    )
    lost = text_of(browser, "#lost")
    assert lost.startswith(
        "2 jobs lost their worker (lease expired), and no worker process is running to take "
        "them back: dash_dead (2)."
    ), lost
    browser.execute_script("window.scrollTo(0, 0)")
    screenshot(browser, "dashboard-dead-worker.png")

    # The job's page: since when, and Requeue (the API's requeue takes a lease that ran
    # out once the server has been up a whole lease: the run may have just started it).
    server_up_for(pg_url, Settings().lease_seconds)
    browser.get(f"{stack.base}/dashboard/jobs/{jobs[0]}")
    wait(browser, stack, "the job's Requeue button", lambda d: css(d, "#requeue"))
    assert text_of(browser, 'h1 .badge[data-state="lease_expired"]') == "lease expired"
    words = text_of(browser, '#job-fields dd[data-field="state"]')
    assert words.startswith("lease expired at ") and words.endswith(
        ", waiting for a worker to take it back"
    ), words
    css(browser, "#requeue")[0].click()
    confirm(browser, stack)
    wait(
        browser,
        stack,
        "the job back in its queue, its timeline saying who",
        lambda d: (
            css(d, 'h1 .badge[data-state="ready"]')
            and css(d, '#events li[data-type="timeout_requeued"]')
        ),
    )
    event = stack.api("GET", f"/api/jobs/{jobs[0]}/events", token)["results"][-1]
    assert event["type"] == "timeout_requeued" and event["actor"] == "operator@example.com"
    assert event["data"]["worker"] and event["data"]["requeued_by"] == "operator@example.com"

    # The overview's button takes the other.
    browser.get(f"{stack.base}/dashboard")
    wait(browser, stack, "the overview's Requeue button", lambda d: css(d, "#requeue-all-expired"))
    css(browser, "#requeue-all-expired")[0].click()
    confirm(browser, stack)
    wait(
        browser,
        stack,
        "no job left with an expired lease",
        lambda d: (
            text_of(d, cell.format("lease_expired")) == "0"
            and text_of(d, cell.format("ready")) == "2"
        ),
    )
    assert not css(browser, "#lost")[0].is_displayed()
    # Nobody runs them now: cancel them, so that no later worker of the module does.
    for job_id in jobs:
        stack.api("POST", f"/api/jobs/{job_id}/cancel", token)


def test_a_queue_page_shows_who_set_its_limit_and_why_its_jobs_wait(stack, accounts, browser):
    token = accounts.tokens["operator"]
    queue = "dash_page"
    accounts.declare(
        {"dash.page_quick": queue, "dash.page_fail": queue, "dash.hang": queue}, queues=[queue]
    )

    def send(actor: str, *args, **options) -> str:
        body = {"actor_name": actor, "args": list(args), **options}
        return stack.api("POST", "/api/jobs", token, body)["id"]

    for _ in range(3):
        send("dash.page_quick")
    send("dash.page_fail")
    # Code limits the queue to 3: the page says so.
    worker = stack.start_worker(
        OPS_ACTORS, queues=[queue], env={"DRAMATIQ_PG_QUEUE_LIMITS": f"{queue}=3"}
    )
    log_in(browser, stack, "operator", f"/dashboard/queues/{queue}")
    limit = '#queue-fields dd[data-field="limit"]'
    wait(
        browser,
        stack,
        "the limit code set",
        lambda d: (text_of(d, limit) or "").startswith("3 running at once, set by code"),
    )
    wait(
        browser,
        stack,
        "the finished jobs counted",
        lambda d: (
            "Succeeded: 3" in (text_of(d, "#chart-queue .legend") or "")
            and "Failed: 1" in (text_of(d, "#chart-queue .legend") or "")
        ),
    )
    assert text_of(browser, '#queue-counts [data-total="failed"] .n') == "1"

    # An operator lowers it to 2, on the page.
    css(browser, "#limit-value")[0].send_keys("2")
    css(browser, "#limit-set")[0].click()
    wait(
        browser,
        stack,
        "the operator's limit",
        lambda d: (text_of(d, limit) or "").startswith(
            "2 running at once, set by an operator (operator@example.com) at "
        ),
    )
    hanging = [send("dash.hang", 600) for _ in range(4)]
    for _ in range(2):
        send("dash.page_quick", delay=3_600_000)
    wait(
        browser,
        stack,
        "the queue at its limit, saying so",
        lambda d: (
            text_of(d, '#queue-counts [data-total="running"] .n') == "2"
            and text_of(d, '#queue-counts [data-total="ready"] .n') == "2"
            and "at its limit: 2 of 2 running" in (text_of(d, "#why") or "")
        ),
    )
    assert "2 job(s) delayed, the next runnable at " in text_of(browser, "#why")
    browser.execute_script("window.scrollTo(0, 0)")
    screenshot(browser, "dashboard-queue.png")

    # Pause, from the page: who and since when, and its ready jobs are paused ones.
    css(browser, "#pause")[0].click()
    confirm(browser, stack)
    wait(
        browser,
        stack,
        "the queue paused",
        lambda d: (
            (text_of(d, '#why li[data-reason="paused"]') or "").startswith(
                "paused by operator@example.com since "
            )
            and text_of(d, '#queue-counts [data-total="paused"] .n') == "2"
        ),
    )
    assert text_of(browser, '#queue-fields dd[data-field="state"]').startswith(
        "paused by operator@example.com since "
    )
    css(browser, "#resume")[0].click()
    wait(browser, stack, "the queue active again", lambda d: css(d, "#pause"))
    css(browser, "#limit-clear")[0].click()
    confirm(browser, stack)
    wait(
        browser,
        stack,
        "no limit",
        lambda d: (text_of(d, limit) or "").startswith("none"),
    )
    # The hanging jobs are aborted, so that the worker stops at once.
    for job_id in hanging:
        stack.api("POST", f"/api/jobs/{job_id}/abort", token)
    stack.wait_for(
        "the hanging jobs cancelled",
        lambda: all(api_state(stack, token, job_id) == "cancelled" for job_id in hanging),
    )
    worker.stop()


def test_the_details_an_operator_meets(stack, accounts, browser):
    # The login page shows no navigation.
    browser.delete_all_cookies()
    browser.get(stack.base + "/dashboard")
    wait(browser, stack, "the login form", lambda d: css(d, "#login-email")[0].is_displayed())
    assert not css(browser, "#nav")[0].is_displayed()
    # The icon is where tools look for it.
    status, body = stack.get("/favicon.ico")
    assert status == 200 and body.startswith(b"<svg")

    # A mistyped address is a page that says so (and a 404), not the API's JSON.
    log_in(browser, stack, "operator", "/dashboard/jobz")
    wait(browser, stack, "the not-found page", lambda d: text_of(d, "#view h1") == "Not found")
    assert "no dashboard page at this address" in text_of(browser, "#bad-address")
    assert stack.get("/dashboard/jobz")[0] == 404
    browser.get(f"{stack.base}/dashboard/queues/no_such_queue")
    wait(browser, stack, "the unknown queue's page", lambda d: css(d, "#bad-address"))
    assert "no worker has declared queue 'no_such_queue'" in text_of(browser, "#bad-address")

    # An empty list says so in words.
    browser.get(f"{stack.base}/dashboard/jobs?queue=no_such_queue")
    wait(browser, stack, "the empty list", lambda d: text_of(d, "#jobs-count") == "No job matches.")


def test_a_wide_screen_gives_the_room_to_errors(stack, accounts, tmp_path):
    queue = "dash_wide_error"
    job_id = accounts.failed(queue=queue)
    error = "RuntimeError: " + "a long error message that goes on " * 12

    with accounts.store.pool.connection() as conn:
        conn.execute(
            sql.SQL("UPDATE {}.jobs_history SET last_error = %s WHERE id = %s").format(
                sql.Identifier(accounts.settings.schema)
            ),
            (error, job_id),
        )
    with tempfile.TemporaryDirectory(prefix="dpb-chromium-") as temp:
        driver = new_driver(Path(temp), width=1920, height=1000)
        try:
            log_in(driver, stack, "operator", f"/dashboard/jobs?queue={queue}")
            wait(driver, stack, "the list", lambda d: css(d, f'#jobs tr[data-job="{job_id}"]'))
            main, error_cell = driver.execute_script(
                """const main = document.getElementById('main').getBoundingClientRect();
                   const cell = document.querySelector('#jobs td[data-field="error"]');
                   return [main.right - main.left, cell.getBoundingClientRect().width];"""
            )
            assert main >= 1750, f"the content is {main} px wide on a 1920 px screen"
            assert error_cell > 450, f"the last error gets {error_cell} px"
        finally:
            driver.quit()
