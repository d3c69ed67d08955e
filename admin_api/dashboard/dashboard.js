// dramatiq-pg-broker dashboard: plain JavaScript, no library, nothing loaded from elsewhere.
// Every number comes from the admin API with the session cookie, so the page shows exactly
// what the caller's role may see; state changes send X-Requested-With like any browser
// client of the API must.
// Names, arguments and errors are written as text (never as HTML), with control and
// bidirectional characters shown as escapes (visible()): a name cannot pass for another.
"use strict";

const COUNTS_EVERY_MS = 3000; // the overview's counts
const CHARTS_EVERY_MS = 15000; // the overview's charts
const JOB_EVERY_MS = 2000; // a job page while its job is unfinished (a finished one stops)
const WORKERS_EVERY_MS = 15000; // the overview's worker list
const HEALTH_EVERY_MS = 15000; // the overview's health panel
const LIST_EVERY_MS = 5000; // the job list
const QUEUE_EVERY_MS = 5000; // a queue's page
// Where a job is: the API's states (dramatiq_pg_broker/jobs/states.py), the words the CLI
// and the metrics use too, each with its label and what it means.
const STATES = {
  ready: ["ready", "Waiting, runnable now: the next free worker thread of its queue takes it"],
  delayed: ["delayed", "Waiting for a later time: a delay, an eta or a retry's backoff"],
  paused: ["paused", "Runnable, but an operator paused its queue: no worker claims it until resumed"],
  running: ["running", "Claimed by a worker that keeps its lease"],
  lease_expired: ["lease expired", "Its worker stopped renewing its lease (it died, hung or lost the database): waiting for a worker to take it back"],
  succeeded: ["succeeded", "Finished: its actor returned"],
  failed: ["failed", "Finished: failed for good (a dead letter) until retried"],
  cancelled: ["cancelled", "Finished: cancelled, never to run"],
};
// A queue's counts, in that order.
const COUNT_STATES = ["ready", "delayed", "paused", "running", "lease_expired", "failed"];
// The list's filters: the states, and "queued" (every waiting job: ready, delayed, paused).
const FILTERS = [...Object.keys(STATES), "queued"];
const FINISHED = ["succeeded", "failed", "cancelled"];
const OPERATORS = ["operator", "admin"];
const OBSERVERS = ["viewer", "operator", "admin"];
const EVENT_COLOURS = {
  created: "#57606a", claimed: "#0969da", progress: "#1f883d", lease_renewed: "#8c959f",
  succeeded: "#1a7f37", retry_scheduled: "#9a6700", failed: "#b42318",
  timeout_requeued: "#bc4c00", released: "#6f42c1", manual_retry: "#1d4f91", cancelled: "#57606a",
  abort_requested: "#bc4c00", aborted: "#b42318",
};

let me = null;
let timer = null;

// -- small helpers -----------------------------------------------------------------------

// Characters that display as nothing, or change how the text around them displays:
// controls, format characters (bidirectional overrides and isolates, zero-width
// characters), line and paragraph separators, unassigned, private-use and lone surrogate
// code points. visible() writes each as its escape (\u202e), so "invoice\u202egnp.exe"
// shows as exactly that, not as "invoiceexe.png". Multi-line text keeps its line breaks
// and tabs.
const HIDDEN = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Co}\p{Cn}\p{Cs}]/gu;

function visible(text, multiline) {
  if (text === null || text === undefined) return "";
  return String(text).replace(HIDDEN, (char) => {
    if (multiline && (char === "\n" || char === "\t" || char === "\r")) return char;
    const code = char.codePointAt(0);
    return code <= 0xffff ? "\\u" + code.toString(16).padStart(4, "0") : "\\u{" + code.toString(16) + "}";
  });
}

// A name (queue, actor, worker) in a cell that keeps its width: cut with an ellipsis by
// the style sheet, the whole (escaped) name on hover.
function nameCell(text, extra) {
  const shown = visible(text);
  return el("span", { class: "name" + (extra ? " " + extra : ""), title: shown, text: shown });
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) if (child) node.append(child);
  return node;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body, extraHeaders) {
  const headers = { Accept: "application/json", "X-Requested-With": "dashboard", ...extraHeaders };
  const init = { method, headers, credentials: "same-origin" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    throw new ApiError(0, "The admin API cannot be reached: " + error.message);
  }
  if (response.status === 304) return NOT_MODIFIED;
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    throw new ApiError(response.status, (data && data.message) || response.statusText);
  }
  const etag = response.headers.get("ETag");
  if (etag && method === "GET") tagged.set(path, { etag, data });
  return data;
}

// Answers kept with their ETag, for the polls that send it back (If-None-Match): an
// unchanged job answers 304 with no body, so a job with a megabyte of arguments costs a few
// hundred bytes a poll, not the megabyte.
const NOT_MODIFIED = Symbol("not modified");
const tagged = new Map();

// GET path, answered from the kept copy when the API says it has not changed; `whole`
// asks for the whole answer, whatever is kept.
async function poll(path, whole = false) {
  const known = whole ? undefined : tagged.get(path);
  const data = await api("GET", path, undefined, known ? { "If-None-Match": known.etag } : {});
  return data === NOT_MODIFIED ? known.data : data;
}

function notice(message) {
  const box = document.getElementById("notice");
  box.textContent = visible(message || "");
  box.hidden = !message;
}

function failed(error) {
  if (error instanceof ApiError && error.status === 401) {
    showLogin();
    return;
  }
  notice(error.message);
}

// Run fn every ms while logged in; fn returning false stops it (a finished job's page).
function schedule(fn, ms) {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    if (document.hidden) return schedule(fn, ms); // no polling in a background tab
    let again = true;
    try {
      again = (await fn()) !== false;
      notice("");
    } catch (error) {
      failed(error);
    }
    if (me && again) schedule(fn, ms);
  }, ms);
}

function stopPolling() {
  clearTimeout(timer);
}

function formatTime(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  return date.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
}

function formatAge(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

// "in 5 min" for a time ahead (a delayed job's), "now" once it has come.
function until(iso) {
  if (!iso) return "—";
  const seconds = (new Date(iso).getTime() - Date.now()) / 1000;
  return seconds <= 0 ? "now" : "in " + formatAge(seconds);
}

function ago(iso) {
  if (!iso) return "—";
  return formatAge((Date.now() - new Date(iso).getTime()) / 1000) + " ago";
}

// A job's state as a badge (its stored status in data-status).
function badge(job) {
  const [label, help] = STATES[job.state] || [job.status, ""];
  return el("span", { class: "badge s-" + job.state, "data-status": job.status, "data-state": job.state, title: help, text: label });
}

function stateLabel(state) {
  return (STATES[state] || [state])[0];
}

// A time that never wraps inside itself.
function timeText(iso) {
  return el("span", { class: "time", title: iso || "", text: formatTime(iso) });
}

function json(value) {
  return JSON.stringify(value, null, 2);
}

function setView(title, ...children) {
  document.title = title + " · dramatiq-pg-broker";
  const view = document.getElementById("view");
  view.replaceChildren(...children);
}

// -- login, who am I, navigation ---------------------------------------------------------

function showLogin() {
  me = null;
  clearTimeout(timer);
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  document.getElementById("view").replaceChildren();
  document.getElementById("login-section").hidden = false;
  document.title = "Log in · dramatiq-pg-broker";
  document.getElementById("login-email").focus();
}

async function login(event) {
  event.preventDefault();
  const error = document.getElementById("login-error");
  error.textContent = "";
  try {
    await api("POST", "/api/auth/login", {
      email: document.getElementById("login-email").value,
      password: document.getElementById("login-password").value,
    });
  } catch (e) {
    error.textContent = e.message;
    return;
  }
  document.getElementById("login-password").value = "";
  document.getElementById("login-section").hidden = true;
  await start();
}

async function logout() {
  try {
    await api("POST", "/api/auth/logout");
  } finally {
    showLogin();
  }
}

async function start() {
  try {
    me = (await api("GET", "/api/auth/me")).user;
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) return showLogin();
    return notice(error.message);
  }
  document.getElementById("who-text").textContent = me.email + " (" + me.role + ")";
  document.getElementById("who").hidden = false;
  document.getElementById("nav").hidden = false;
  document.getElementById("nav-overview").hidden = !OBSERVERS.includes(me.role);
  route();
}

function route() {
  const path = location.pathname.replace(/\/+$/, "");
  const jobMatch = path.match(/^\/dashboard\/jobs\/([^/]+)$/);
  const queueMatch = path.match(/^\/dashboard\/queues\/([^/]+)$/);
  const workflowMatch = path.match(/^\/dashboard\/workflows\/([^/]+)$/);
  let section = "overview";
  let run;
  const named = (match, what, page) => {
    try {
      const name = decodeURIComponent(match[1]);
      return () => page(name);
    } catch (error) {
      // A malformed percent-escape (/dashboard/jobs/%E0%A4%A): say so instead of a blank page.
      return async () => badAddress(`This address does not name a ${what}: its escaped characters are malformed.`);
    }
  };
  if (jobMatch) {
    section = "jobs";
    run = named(jobMatch, "job", jobPage);
  } else if (workflowMatch) {
    section = "workflows";
    run = named(workflowMatch, "workflow", workflowPage);
  } else if (path === "/dashboard/workflows") {
    section = "workflows";
    run = workflowsPage;
  } else if (queueMatch && OBSERVERS.includes(me.role)) {
    run = named(queueMatch, "queue", queuePage);
  } else if (path === "/dashboard/jobs" || !OBSERVERS.includes(me.role)) {
    // Members see their own jobs only; the overview counts everyone's.
    section = "jobs";
    run = jobsPage;
  } else if (path === "/dashboard" || path === "") {
    run = overviewPage;
  } else {
    run = async () => badAddress("There is no dashboard page at this address.");
  }
  for (const link of document.querySelectorAll("#nav a[data-section]")) {
    if (link.dataset.section === section) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  run().catch(failed);
}

// What a page shows, read from the API; null once the page said that the address names
// nothing (a 404 or 400: an unknown or malformed name or id in the address).
async function readShown(path) {
  try {
    return await api("GET", path);
  } catch (error) {
    if (error instanceof ApiError && (error.status === 404 || error.status === 400)) {
      notice("");
      badAddress(error.message);
      return null;
    }
    throw error;
  }
}

function badAddress(message) {
  stopPolling();
  setView("Not found",
    el("h1", { text: "Not found" }),
    el("p", { id: "bad-address", role: "alert", text: message }),
    el("p", { class: "actions" },
      OBSERVERS.includes(me.role) ? el("a", { href: "/dashboard", text: "← Overview" }) : null,
      el("a", { href: "/dashboard/jobs", text: "All jobs" })));
}

// -- overview ----------------------------------------------------------------------------

// The header cell of a state's count: its label, what it means on hover.
function countHeader(state) {
  const [label, help] = STATES[state];
  return el("th", { scope: "col", class: "num", title: help, text: label[0].toUpperCase() + label.slice(1) });
}

async function overviewPage() {
  const cards = el("div", { class: "cards", id: "totals", "aria-live": "polite" });
  const lost = el("div", { id: "lost", class: "lost", role: "status", hidden: true });
  const table = el("table", { class: "data", id: "queues", "aria-labelledby": "h-queues" },
    el("thead", {}, el("tr", {},
      el("th", { scope: "col", text: "Queue" }),
      COUNT_STATES.map(countHeader),
      el("th", { scope: "col", class: "num", title: "How long the oldest runnable job has waited", text: "Oldest waiting" }),
      el("th", { scope: "col", class: "num", title: "At most this many of its jobs run at once, across every worker", text: "Limit" }),
      el("th", { scope: "col", title: "A paused queue is claimed by no worker; sends are still accepted", text: "State" }))),
    el("tbody"));
  const workers = el("table", { class: "data", id: "workers", "aria-labelledby": "h-workers" },
    el("thead", {}, el("tr", {}, ["Host", "PID", "Queues", "In flight", "Started", "Last heartbeat", "Version"].map((h) =>
      el("th", { scope: "col", class: h === "PID" || h === "In flight" ? "num" : null, text: h })))),
    el("tbody"));
  const throughput = el("figure", { id: "chart-throughput" },
    el("figcaption", { text: "Succeeded per minute, last hour" }));
  const failures = el("figure", { id: "chart-failures" },
    el("figcaption", { text: "Failures and retries per minute, last hour" }));
  const updated = el("p", { class: "muted", id: "updated", "aria-live": "off" });
  const health = el("table", { class: "data", id: "health", "aria-labelledby": "h-health" },
    el("thead", {}, el("tr", {}, ["Level", "Check", "Finding"].map((h) => el("th", { scope: "col", text: h })))),
    el("tbody"));
  setView("Overview",
    el("h1", { text: "Overview" }),
    cards,
    lost,
    el("h2", { id: "h-queues", text: "Queues" }),
    table,
    updated,
    el("h2", { id: "h-health", title: "What dramatiq-pg-broker doctor finds in the database, with what to do", text: "Health" }),
    health,
    el("h2", { text: "Last hour" }),
    el("div", { class: "charts" }, throughput, failures),
    el("h2", { id: "h-workers", text: "Workers" }),
    workers);

  async function refreshCounts() {
    const { results } = await api("GET", "/api/queues");
    const totals = Object.fromEntries(COUNT_STATES.map((state) => [state, 0]));
    for (const queue of results) for (const state of COUNT_STATES) totals[state] += queue.jobs[state];
    // The queues the workers declared first, by name; then those that only have jobs (sent
    // to a queue no worker consumes), the most jobs first, at most UNDECLARED_SHOWN of them:
    // a typo'd queue name in an app must not crowd the real queues off the page.
    const declared = results.filter((queue) => queue.declared);
    const jobsOf = (queue) => COUNT_STATES.reduce((sum, state) => sum + queue.jobs[state], 0);
    const undeclared = results.filter((queue) => !queue.declared)
      .sort((a, b) => jobsOf(b) - jobsOf(a) || (a.queue_name < b.queue_name ? -1 : 1));
    const shown = [...declared, ...undeclared.slice(0, UNDECLARED_SHOWN)];
    const rows = shown.map((queue) => {
      // A name longer than the list's filter takes is not a link: the list could not show
      // it, and the address would be longer than a request line may be.
      const linkable = queue.queue_name.length <= MAX_FILTER_LENGTH;
      const link = (state, n) => n > 0 && linkable
        ? el("a", { href: jobsOf_(queue.queue_name, state), text: String(n) })
        : String(n);
      const name = nameCell(queue.queue_name);
      return el("tr", { "data-queue": queue.queue_name, "data-paused": queue.paused ? "true" : "false", "data-declared": queue.declared ? "true" : "false" },
        el("th", { scope: "row" }, linkable ? el("a", { href: queueAddress(queue.queue_name), title: "The queue's page" }, name) : name),
        COUNT_STATES.map((state) => el("td", { class: "num" + (state === "lease_expired" && queue.jobs[state] ? " stale" : ""), "data-field": state },
          link(state, queue.jobs[state]))),
        el("td", { class: "num" + (queue.oldest_waiting_seconds > 300 ? " stale" : ""), "data-field": "oldest_waiting_seconds" },
          queue.oldest_waiting_seconds ? formatAge(queue.oldest_waiting_seconds) : "—"),
        el("td", { class: "num", "data-field": "limit", title: limitText(queue) },
          queue.limit == null ? "—" : String(queue.limit)),
        el("td", { "data-field": "state" }, queueState(queue)));
    });
    const hidden = undeclared.slice(UNDECLARED_SHOWN);
    if (hidden.length) {
      const jobs = hidden.reduce((sum, queue) => sum + jobsOf(queue), 0);
      rows.push(el("tr", { id: "queues-more" }, el("td", { colspan: 10, class: "muted",
        text: `and ${hidden.length} more queue${hidden.length === 1 ? "" : "s"} no worker declared ` +
          `(${jobs} job${jobs === 1 ? "" : "s"}; counted in the totals above).` })));
    }
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted", text: "No queues: workers declare theirs when they boot." })));
    }
    table.tBodies[0].replaceChildren(...rows);
    cards.replaceChildren(...COUNT_STATES.map((state) =>
      el("div", { class: "card" + (state === "lease_expired" && totals[state] ? " alarm" : ""), title: STATES[state][1], "data-total": state },
        el("div", { class: "n", text: String(totals[state]) }),
        el("div", { class: "l", text: stateLabel(state)[0].toUpperCase() + stateLabel(state).slice(1) }))));
    // Jobs whose worker died: said in words, with the way to put them back at once.
    const expired = results.filter((queue) => queue.jobs.lease_expired > 0);
    lost.hidden = !expired.length;
    if (expired.length) {
      const n = totals.lease_expired;
      lost.replaceChildren(
        el("p", {}, `${n} job${n === 1 ? "" : "s"} lost ${n === 1 ? "its" : "their"} worker (lease expired), `,
          // Any live worker's reaper takes them back; with none running, nothing does.
          results.some((queue) => queue.live_workers > 0)
            ? "waiting for a worker to take them back: "
            : "and no worker process is running to take them back: ",
          ...expired.map((queue, i) => [i ? ", " : "", el("a", { href: queueAddress(queue.queue_name) }, nameCell(queue.queue_name)),
            ` (${queue.jobs.lease_expired})`]).flat(), "."),
        OPERATORS.includes(me.role)
          ? el("button", { type: "button", class: "small primary", id: "requeue-all-expired", text: "Requeue them now",
            onclick: () => requeueExpired(expired.map((queue) => queue.queue_name), n, refreshCounts) })
          : null);
    }
    updated.textContent = "Updated " + new Date().toLocaleTimeString() + "; refreshed every " + COUNTS_EVERY_MS / 1000 + " s.";
  }

  async function refreshCharts() {
    const data = await api("GET", "/api/throughput?minutes=60");
    drawBars(throughput, data, [["succeeded", "Succeeded", "#1a7f37"]]);
    drawBars(failures, data, [["failed", "Failed", "#b42318"], ["retried", "Retried", "#9a6700"]]);
  }

  async function refreshWorkers() {
    const { results } = await api("GET", "/api/workers");
    const rows = results.map((worker) => el("tr", { "data-worker": worker.id },
      el("td", {}, nameCell(worker.host)),
      el("td", { class: "num", text: String(worker.pid) }),
      el("td", { "data-field": "queues" }, worker.queues.map((queue) => el("div", {}, nameCell(queue)))),
      el("td", { class: "num", text: String(worker.in_flight) }),
      el("td", { title: formatTime(worker.started_at), text: ago(worker.started_at) }),
      el("td", { title: formatTime(worker.heartbeat_at), text: ago(worker.heartbeat_at) }),
      el("td", {}, nameCell(worker.version || "—"))));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7, class: "muted", text: "No worker process is running." })));
    workers.tBodies[0].replaceChildren(...rows);
  }

  // The doctor's findings: problems first, then warnings, then the rest in check order;
  // each with its details and what to do.
  async function refreshHealth() {
    let report;
    try {
      report = await api("GET", "/api/health/findings");
    } catch (error) {
      // The examination failed (its statements timed out, say): the panel says so, and
      // the rest of the overview goes on.
      health.tBodies[0].replaceChildren(el("tr", { "data-check": "", "data-level": "skipped" },
        el("td", { colspan: 3, class: "muted", text: "The health checks could not run: " + visible(error.message) })));
      return;
    }
    const order = { problem: 0, warning: 1, skipped: 3, ok: 2 };
    const findings = [...report.findings].sort((a, b) => order[a.level] - order[b.level]);
    health.tBodies[0].replaceChildren(...findings.map((finding) => el("tr", { "data-check": finding.check, "data-level": finding.level },
      el("td", {}, el("span", { class: "badge h-" + finding.level, text: finding.level })),
      el("th", { scope: "row", text: finding.check }),
      el("td", {},
        el("div", {}, visible(finding.title)),
        finding.details.map((detail) => el("div", { class: "muted" }, visible(detail))),
        finding.advice ? el("div", { class: "advice" }, visible("→ " + finding.advice)) : null))));
    health.dataset.level = report.level;
  }

  // Pause asks first (it stops work on every host); resume acts at once.
  refreshQueues = refreshCounts;
  await Promise.all([refreshCounts(), refreshCharts(), refreshWorkers(), refreshHealth()]);
  let ticks = 0;
  schedule(async function poll() {
    ticks += 1;
    await refreshCounts();
    if ((ticks * COUNTS_EVERY_MS) % CHARTS_EVERY_MS < COUNTS_EVERY_MS) await refreshCharts();
    if ((ticks * COUNTS_EVERY_MS) % WORKERS_EVERY_MS < COUNTS_EVERY_MS) await refreshWorkers();
    if ((ticks * COUNTS_EVERY_MS) % HEALTH_EVERY_MS < COUNTS_EVERY_MS) await refreshHealth();
  }, COUNTS_EVERY_MS);
}

let refreshQueues = async () => {};

// The queues the overview lists after the declared ones, at most; the rest are summed up.
const UNDECLARED_SHOWN = 10;
// The longest queue or actor filter the job list takes (the API's MAX_FILTER_LENGTH).
const MAX_FILTER_LENGTH = 255;

function queueAddress(name) {
  return "/dashboard/queues/" + encodeURIComponent(name);
}

// The job list of one queue, in one state (or all of its jobs).
function jobsOf_(queueName, state) {
  const filters = state ? { status: state, queue: queueName } : { queue: queueName };
  return "/dashboard/jobs?" + new URLSearchParams(filters);
}

function limitText(queue) {
  if (queue.limit == null) return "No limit";
  const who = queue.limit_source === "operator" ? `an operator (${visible(queue.limit_set_by)})` : "code (a worker's queue_limits)";
  return `At most ${queue.limit} running at once, across every worker; set by ${who} at ${formatTime(queue.limit_set_at)}`;
}

// Put back the jobs whose lease expired, of these queues, after asking.
async function requeueExpired(names, n, then) {
  if (!(await confirmed("Requeue jobs",
    `Put ${n} job${n === 1 ? "" : "s"} whose worker stopped renewing ${n === 1 ? "its" : "their"} lease back in ${n === 1 ? "its" : "their"} queue now? ` +
    "Only jobs whose lease has expired are taken: a worker that is alive keeps its jobs."))) return;
  try {
    for (const name of names) await api("POST", `/api/queues/${encodeURIComponent(name)}/requeue-expired`);
    notice("");
  } catch (error) {
    failed(error);
  }
  await then();
}

function queueState(queue, withButton = true) {
  // Active (green) only with a live worker process consuming it: a queue no worker consumes
  // now, declared before or never, is red, since its jobs wait.
  const idle = queue.state === "no_worker" || queue.state === "undeclared";
  const label = queue.paused ? "paused" : idle ? "no worker" : "active";
  const workers = `${queue.live_workers} live worker process${queue.live_workers === 1 ? "" : "es"}`;
  const state = el("span", {
    class: "state" + (queue.paused ? " paused" : idle ? " idle" : ""),
    "data-state": label,
    title: queue.paused ? `Paused by ${visible(queue.paused_by)} at ${formatTime(queue.paused_at)}`
      : !queue.declared ? "No worker declared this queue: its jobs wait"
      : idle ? "Declared, but no live worker process consumes it now: its jobs wait"
      : `${workers} claim its jobs`,
    text: label,
  });
  if (!withButton || !queue.declared || !OPERATORS.includes(me.role)) return state;
  const verb = queue.paused ? "resume" : "pause";
  const button = el("button", {
    type: "button", class: "small" + (queue.paused ? " primary" : ""), "data-action": verb,
    "aria-label": (queue.paused ? "Resume queue " : "Pause queue ") + visible(queue.queue_name),
    text: queue.paused ? "Resume" : "Pause",
    onclick: async () => {
      if (verb === "pause" && !(await confirmed("Pause queue",
        `Pause queue ${visible(queue.queue_name)}? No worker on any host claims its jobs until it is resumed; ` +
        "messages already prefetched go back to the queue, running jobs finish, sends are still accepted."))) return;
      button.disabled = true;
      try {
        await api("POST", `/api/queues/${encodeURIComponent(queue.queue_name)}/${verb}`);
        notice("");
        await refreshQueues();
      } catch (error) {
        failed(error);
        button.disabled = false;
      }
    },
  });
  return el("span", { class: "toggle" }, state, button);
}

// -- one queue ---------------------------------------------------------------------------

async function queuePage(name) {
  const path = "/api/queues/" + encodeURIComponent(name);
  let queue = await readShown(path);
  if (queue === null) return;
  const heading = el("h1", {});
  const why = el("section", { id: "why", "aria-labelledby": "h-why" });
  const actions = el("div", { class: "actions", id: "queue-actions" });
  const fields = el("dl", { class: "fields", id: "queue-fields" });
  const cards = el("div", { class: "cards", id: "queue-counts", "aria-live": "polite" });
  const chart = el("figure", { id: "chart-queue" }, el("figcaption", { text: "Finished per minute, last hour" }));
  setView("Queue " + visible(name),
    el("p", {}, el("a", { href: "/dashboard", text: "← Overview" })),
    heading, cards, why, actions,
    el("div", { class: "columns" },
      el("section", { "aria-labelledby": "h-queue-fields" }, el("h2", { id: "h-queue-fields", text: "Settings" }), fields),
      el("section", { "aria-labelledby": "h-queue-chart" }, el("h2", { id: "h-queue-chart", text: "Last hour" }), chart)));

  // The limit form keeps what the operator is typing across refreshes.
  const limitInput = el("input", { id: "limit-value", type: "number", min: 1, max: 1000000, step: 1, size: 8,
    "aria-label": "Limit: the most jobs of the queue running at once" });

  function render(queue) {
    heading.replaceChildren("Queue ", el("span", { class: "mono", text: visible(queue.queue_name) }), " ", queueState(queue, false));
    cards.replaceChildren(...COUNT_STATES.map((state) => {
      const n = queue.jobs[state];
      const label = stateLabel(state)[0].toUpperCase() + stateLabel(state).slice(1);
      return el("div", { class: "card" + (state === "lease_expired" && n ? " alarm" : ""), title: STATES[state][1], "data-total": state },
        el("div", { class: "n" }, n ? el("a", { href: jobsOf_(queue.queue_name, state), text: String(n) }) : "0"),
        el("div", { class: "l", text: label }));
    }));
    const reasons = queue.waiting_because;
    why.replaceChildren(el("h2", { id: "h-why", text: "Why its jobs wait" }),
      reasons.length
        ? el("ul", { id: "why-list" }, reasons.map((reason) => el("li", { "data-reason": reason.reason, text: visible(reason.text) })))
        : el("p", { class: "muted", id: "why-none", text: "Nothing holds its jobs back but the work ahead of them." }));
    const field = (label, value) => [el("dt", { text: label }), el("dd", { "data-field": label }, value ?? "—")];
    fields.replaceChildren(...[
      field("state", queue.paused
        ? el("span", {}, `paused by ${visible(queue.paused_by)} since `, timeText(queue.paused_at))
        : queue.resumed_at ? el("span", {}, `active; resumed by ${visible(queue.resumed_by)} at `, timeText(queue.resumed_at)) : queue.state.replace("_", " ")),
      field("limit", queue.limit == null ? "none: workers claim its jobs as they can run them"
        : el("span", { id: "limit-shown" }, `${queue.limit} running at once, set by `,
          el("strong", { "data-source": queue.limit_source, text: queue.limit_source === "operator" ? "an operator" : "code" }),
          queue.limit_source === "operator" ? ` (${visible(queue.limit_set_by)})` : ` (${visible(queue.limit_set_by)}: its queue_limits setting)`,
          " at ", timeText(queue.limit_set_at))),
      field("live workers", String(queue.live_workers)),
      field("oldest waiting", queue.oldest_waiting_seconds ? formatAge(queue.oldest_waiting_seconds) : "—"),
      field("next delayed", queue.next_delayed_at ? timeText(queue.next_delayed_at) : "—"),
      field("declared", queue.declared ? "yes" : "no: no worker declared it")].flat());
    const flow = queue.throughput;
    drawBars(chart, flow, [["succeeded", "Succeeded", "#1a7f37"], ["failed", "Failed", "#b42318"]]);

    if (!OPERATORS.includes(me.role)) return;
    const act = (id, label, classes, onclick) => el("button", { type: "button", id, class: classes, text: label, onclick });
    const run = async (button, method, suffix, body) => {
      button.disabled = true;
      try {
        await api(method, path + suffix, body);
        notice("");
      } catch (error) {
        failed(error);
      }
      await refresh();
    };
    const buttons = [];
    if (queue.declared) {
      const pause = act(queue.paused ? "resume" : "pause", queue.paused ? "Resume" : "Pause", queue.paused ? "primary" : "", async () => {
        if (!queue.paused && !(await confirmed("Pause queue",
          `Pause queue ${visible(queue.queue_name)}? No worker on any host claims its jobs until it is resumed; ` +
          "messages already prefetched go back to the queue, running jobs finish, sends are still accepted."))) return;
        await run(pause, "POST", queue.paused ? "/resume" : "/pause");
      });
      buttons.push(pause);
      const form = el("form", { class: "toggle", id: "limit-form", onsubmit: async (event) => {
        event.preventDefault();
        const value = Number(limitInput.value);
        if (!Number.isInteger(value) || value < 1) return notice("A limit is a whole number of at least 1 (Clear lifts it).");
        await run(form.querySelector("button"), "PUT", "/limit", { limit: value });
        limitInput.value = "";
      } }, el("label", { for: "limit-value", text: "Limit" }), limitInput,
      el("button", { type: "submit", id: "limit-set", text: queue.limit == null ? "Set limit" : "Change limit" }));
      buttons.push(form);
      if (queue.limit != null) {
        const clear = act("limit-clear", "Clear limit", "", async () => {
          if (!(await confirmed("Clear the limit", `Lift the limit of queue ${visible(queue.queue_name)}? Workers claim its jobs as they can run them.`))) return;
          await run(clear, "PUT", "/limit", { limit: null });
        });
        buttons.push(clear);
      }
    }
    if (queue.jobs.lease_expired) {
      const n = queue.jobs.lease_expired;
      buttons.push(act("requeue-expired", `Requeue ${n} lease-expired job${n === 1 ? "" : "s"}`, "primary",
        () => requeueExpired([queue.queue_name], n, refresh)));
    }
    // Leave the form alone while its field is being typed in.
    if (!actions.contains(document.activeElement)) actions.replaceChildren(...buttons);
  }

  async function refresh() {
    render(await api("GET", path));
  }

  render(queue);
  schedule(refresh, QUEUE_EVERY_MS);
}

// A stacked bar per minute, drawn as SVG; the figure's caption and an aria-label carry the
// totals for readers that do not see the bars.
function drawBars(figure, data, series) {
  const width = 600, height = 170, left = 34, bottom = 20, top = 8;
  const buckets = data.buckets;
  const max = Math.max(1, ...buckets.map((b) => series.reduce((sum, [key]) => sum + b[key], 0)));
  const step = (width - left) / buckets.length;
  const scale = (height - bottom - top) / max;
  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img" });
  const totals = series.map(([key, label]) => `${buckets.reduce((s, b) => s + b[key], 0)} ${label.toLowerCase()}`);
  chart.setAttribute("aria-label", `${totals.join(", ")} in the last ${buckets.length} minutes; at most ${max} in one minute.`);
  for (const tick of new Set([0, Math.round(max / 2), max])) {
    const y = height - bottom - tick * scale;
    chart.append(svg("line", { x1: left, x2: width, y1: y, y2: y, stroke: "#d0d7de" }));
    chart.append(svg("text", { x: left - 4, y: y + 4, "text-anchor": "end", text: String(tick) }));
  }
  buckets.forEach((bucket, i) => {
    let y = height - bottom;
    for (const [key, label, colour] of series) {
      const h = bucket[key] * scale;
      if (h <= 0) continue;
      y -= h;
      const bar = svg("rect", { x: left + i * step + 0.5, y, width: Math.max(1, step - 1), height: h, fill: colour });
      bar.append(svg("title", { text: `${new Date(bucket.at).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })}: ${bucket[key]} ${label.toLowerCase()}` }));
      chart.append(bar);
    }
    if (i % 15 === 0) {
      chart.append(svg("text", { x: left + i * step, y: height - 5, text: new Date(bucket.at).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) }));
    }
  });
  chart.append(svg("text", { x: width, y: height - 5, "text-anchor": "end", text: "now" }));
  const legend = el("div", { class: "legend" }, series.map(([key, label], i) =>
    el("span", { "data-series": key }, el("span", { class: "swatch" }), label + ": " + totals[i].split(" ")[0])));
  // Colours set from script: the page's CSP refuses inline style attributes.
  legend.querySelectorAll(".swatch").forEach((swatch, i) => { swatch.style.background = series[i][2]; });
  const caption = figure.querySelector("figcaption");
  figure.replaceChildren(caption, chart, legend);
  if (data.truncated) figure.append(el("p", { class: "muted", text: "A busy hour: only the most recent events were counted." }));
}

// -- job list ----------------------------------------------------------------------------

const PAGE_SIZE = 25;

async function jobsPage() {
  const params = new URLSearchParams(location.search);
  const form = el("form", { class: "filters", id: "filters", method: "get", action: "/dashboard/jobs", role: "search", "aria-label": "Filter jobs" },
    el("div", {}, el("label", { for: "filter-status", text: "State" }),
      el("select", { id: "filter-status", name: "status" },
        el("option", { value: "", text: "any" }),
        FILTERS.map((s) => el("option", { value: s, selected: params.get("status") === s, title: s === "queued" ? "Every waiting job: ready, delayed or paused" : STATES[s][1],
          text: s === "queued" ? "waiting (ready, delayed, paused)" : stateLabel(s) })))),
    el("div", {}, el("label", { for: "filter-queue", text: "Queue" }),
      el("input", { id: "filter-queue", name: "queue", value: params.get("queue") || "", size: 14 })),
    el("div", {}, el("label", { for: "filter-actor", text: "Actor contains" }),
      el("input", { id: "filter-actor", name: "actor", value: params.get("actor") || "", size: 16 })),
    el("div", {}, el("label", { for: "filter-after", text: "Created after" }),
      el("input", { id: "filter-after", name: "created_after", type: "datetime-local", step: 1, value: params.get("created_after") || "" })),
    el("div", {}, el("label", { for: "filter-before", text: "Created before" }),
      el("input", { id: "filter-before", name: "created_before", type: "datetime-local", step: 1, value: params.get("created_before") || "" })),
    el("div", {}, el("button", { type: "submit", class: "primary", id: "filter-apply", text: "Apply" })),
    el("div", {}, el("a", { href: "/dashboard/jobs", text: "Clear" })));
  // Empty fields stay out of the address (disabled fields are not submitted); enabled
  // again if the browser restores this page from its back-forward cache.
  form.addEventListener("submit", () => {
    for (const input of form.querySelectorAll("input, select")) input.disabled = !input.value;
  });
  window.addEventListener("pageshow", () => {
    for (const input of form.querySelectorAll("input, select")) input.disabled = false;
  });
  // Delayed jobs are listed with when they run.
  const delayedList = params.get("status") === "delayed";
  const columns = [["job", "Job"], ["status", "State"], ["queue", "Queue"], ["actor", "Actor"], ["args", "Arguments"],
    ["attempts", "Attempts"], ...(delayedList ? [["runs", "Runs at"]] : []), ["created", "Created"], ["error", "Last error"]];
  const table = el("table", { class: "data", id: "jobs" },
    el("colgroup", {}, columns.map(([name]) => el("col", { class: "c-" + name }))),
    el("thead", {}, el("tr", {}, columns.map(([, h]) => el("th", { scope: "col", text: h })))),
    el("tbody"));
  const summary = el("p", { class: "muted", id: "jobs-count", "aria-live": "polite" });
  const pager = el("nav", { class: "pager", "aria-label": "Pages" });
  setView("Jobs", el("h1", { text: me.role === "member" ? "My jobs" : "Jobs" }), form, summary, table, pager);

  const query = new URLSearchParams();
  for (const field of ["status", "queue", "actor"]) if (params.get(field)) query.set(field, params.get(field));
  for (const field of ["created_after", "created_before"]) {
    const value = params.get(field);
    if (!value) continue;
    const when = new Date(value); // the browser's local time
    if (Number.isNaN(when.getTime())) {
      const label = field === "created_after" ? "Created after" : "Created before";
      summary.textContent = "";
      notice(`${label}: ${JSON.stringify(visible(value))} is not a date and time; use the date picker or the form 2030-01-31T12:00.`);
      return;
    }
    query.set(field, when.toISOString());
  }
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  query.set("limit", PAGE_SIZE);
  if (offset) query.set("offset", offset);

  async function refresh() {
    const page = await api("GET", "/api/jobs?" + query);
    const rows = page.results.map((job) => el("tr", { "data-job": job.id, "data-status": job.status, "data-state": job.state },
      el("td", { class: "mono" }, el("a", { href: "/dashboard/jobs/" + job.id, text: job.id.slice(0, 8), "aria-label": "Job " + job.id })),
      el("td", { "data-field": "status" }, badge(job)),
      el("td", {}, nameCell(job.queue_name)),
      el("td", {}, nameCell(job.actor_name, "mono")),
      el("td", { "data-field": "args" }, job.message_encoding === "binary"
        ? el("span", { class: "muted", text: "(binary)" }) : nameCell(job.args_preview, "mono preview")),
      el("td", { class: "num", text: job.attempts + " / " + job.max_attempts }),
      delayedList ? el("td", { class: "created", "data-field": "runs-at" },
        el("span", { title: formatTime(job.available_at), text: until(job.available_at) })) : null,
      el("td", { class: "created", "data-field": "created" }, el("span", { title: formatTime(job.created_at), text: ago(job.created_at) })),
      el("td", { "data-field": "error" }, nameCell((job.error_preview || "").split("\n")[0], "mono preview"))));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: columns.length, class: "muted", text: "No job matches." })));
    table.tBodies[0].replaceChildren(...rows);
    // Above 10,000 matches the API stops counting (count_exact is false).
    const total = page.count_exact === false ? `more than ${page.count.toLocaleString("en")}` : page.count;
    summary.textContent = !page.results.length
      ? (page.count ? `No job on this page: ${total} match, on the pages before it.` : "No job matches.")
      : `${offset + 1}–${offset + page.results.length} of ${total} job${page.count === 1 ? "" : "s"}`;
    const pageLink = (label, to, rel) => {
      const next = new URLSearchParams(params);
      if (to > 0) next.set("offset", to); else next.delete("offset");
      return el("a", { href: "/dashboard/jobs?" + next, rel, id: "page-" + rel, text: label });
    };
    pager.replaceChildren(
      page.previous ? pageLink("← Newer", Math.max(0, offset - PAGE_SIZE), "prev") : el("span", { class: "muted", text: "← Newer" }),
      page.next ? pageLink("Older →", offset + PAGE_SIZE, "next") : el("span", { class: "muted", text: "Older →" }));
  }

  await refresh();
  schedule(refresh, LIST_EVERY_MS);
}

// -- one job -----------------------------------------------------------------------------

async function jobPage(jobId) {
  const jobPath = "/api/jobs/" + encodeURIComponent(jobId);
  tagged.clear();
  let job, events;
  try {
    // The job, then its timeline: read after the job, the timeline holds every event
    // committed with the state shown (read side by side, a finished job could be drawn
    // without its last event, and a finished job's page is not read again).
    job = await poll(jobPath);
    events = await poll(jobPath + "/events");
  } catch (error) {
    // An unknown id, someone else's job (for a member), or no job id at all: a page that
    // says so, with the way back, instead of an empty page under a notice.
    if (error instanceof ApiError && (error.status === 404 || error.status === 400)) {
      notice("");
      return badAddress(error.message);
    }
    throw error;
  }
  renderJob(job, events.results);
  workflowField(job).catch(failed);
  // A finished job changes only by an operator's action here (Retry reloads the page).
  if (FINISHED.includes(job.status)) return stopPolling();
  schedule(async function pollJob() {
    // Conditional requests: an unchanged job and timeline are two 304s without a body. The
    // job's tag leaves out its lease, so a heartbeat's renewal alone is a 304 too; the kept
    // lease is asked for again only once it has passed, so that a job whose worker renews
    // it never shows an expired lease (one whole answer a lease, not one a renewal).
    const leasePassed = job.locked_until && Date.parse(job.locked_until) <= Date.now();
    const fresh = await poll(jobPath, leasePassed);
    const freshEvents = await poll(jobPath + "/events");
    job = fresh;
    // Leave the page alone while a confirmation is open.
    if (document.getElementById("confirm").open) return true;
    renderJob(fresh, freshEvents.results);
    workflowField(fresh).catch(failed);
    return !FINISHED.includes(fresh.status);
  }, JOB_EVERY_MS);
}

function renderJob(job, events) {
  const message = job.message || {};
  const field = (label, value) => [el("dt", { text: label }), el("dd", { "data-field": label }, value ?? "—")];
  const fields = el("dl", { class: "fields", id: "job-fields" },
    field("id", el("span", { class: "mono", text: job.id })),
    field("state", el("span", { id: "job-status" }, badge(job), " ", stateNote(job))),
    field("queue", OBSERVERS.includes(me.role)
      ? el("a", { href: queueAddress(job.queue_name) }, nameCell(job.queue_name)) : visible(job.queue_name)),
    field("actor", el("span", { class: "mono", text: visible(job.actor_name) })),
    field("attempts", job.attempts + " of " + job.max_attempts),
    field("priority", String(job.priority)),
    field("available at", formatTime(job.available_at)),
    field("created", formatTime(job.created_at)),
    field("started", formatTime(job.started_at)),
    field("finished", formatTime(job.finished_at)),
    job.locked_by ? field("worker", el("span", { class: "mono", text: visible(job.locked_by) })) : null,
    job.locked_until ? field("lease until", formatTime(job.locked_until)) : null,
    job.idempotency_key ? field("idempotency key", visible(job.idempotency_key)) : null,
    job.owner ? field("created by", visible(job.owner)) : null,
    job.abort_requested_by ? field("abort requested",
      el("span", { id: "abort-requested" }, `by ${visible(job.abort_requested_by)} at `, timeText(job.abort_requested_at))) : null);

  const actions = el("div", { class: "actions", id: "job-actions" });
  if (OPERATORS.includes(me.role)) {
    if (job.status === "failed") {
      actions.append(el("button", { type: "button", class: "primary", id: "retry", text: "Retry",
        onclick: () => transition(job, "retry", "Retry this job? It goes back to its queue with its attempts reset to zero.") }));
    }
    if (job.status === "queued") {
      actions.append(el("button", { type: "button", class: "danger", id: "cancel", text: "Cancel job",
        onclick: () => transition(job, "cancel", "Cancel this job? It will not run; a cancelled job cannot be retried.") }));
    }
    if (job.state === "lease_expired") {
      actions.append(el("button", { type: "button", class: "primary", id: "requeue", text: "Requeue now",
        onclick: () => transition(job, "requeue", "Put this job back in its queue now? Its worker stopped renewing its lease; " +
          "it is taken only if its lease has still expired, as a worker's reaper would take it (an interrupted attempt counts as one).") }));
    }
    if (job.status === "running" && !job.abort_requested_at) {
      actions.append(el("button", { type: "button", class: "danger", id: "abort", text: "Abort",
        onclick: () => transition(job, "abort", "Abort this running job? Its worker interrupts the actor within about a second; the job ends cancelled and is never retried.") }));
    }
  }
  if (job.status === "running" && job.abort_requested_at) {
    actions.append(el("span", { class: "muted", id: "aborting", text: "Abort requested: its worker is stopping it." }));
  }

  const payload = [];
  if (job.message_encoding === "binary") {
    payload.push(el("p", { class: "muted", text: "The message was encoded by a non-JSON encoder; its arguments cannot be shown." }));
  } else {
    payload.push(el("h2", { text: "Arguments" }),
      el("pre", { id: "job-args", tabindex: 0, "aria-label": "Arguments" }, visible(json({ args: message.args || [], kwargs: message.kwargs || {} }), true)));
    if (message.options && Object.keys(message.options).length) {
      payload.push(el("h2", { text: "Options" }), el("pre", { tabindex: 0 }, visible(json(message.options), true)));
    }
  }
  if (job.last_error) payload.push(el("h2", { text: "Last error" }), el("pre", { id: "job-error", tabindex: 0, class: "error-text" }, visible(job.last_error, true)));
  if (job.result !== null && job.result !== undefined) payload.push(el("h2", { text: "Result" }), el("pre", { id: "job-result", tabindex: 0 }, visible(json(job.result), true)));

  const back = el("p", {}, el("a", { href: "/dashboard/jobs", text: "← All jobs" }));
  setView("Job " + job.id.slice(0, 8),
    back,
    el("h1", {}, "Job ", el("span", { class: "mono", text: job.id.slice(0, 8) }), " ", badge(job)),
    actions,
    el("div", { class: "columns" },
      el("section", { "aria-labelledby": "h-fields" }, el("h2", { id: "h-fields", text: "Fields" }), fields, payload),
      el("section", { "aria-labelledby": "h-timeline" }, el("h2", { id: "h-timeline", text: "Timeline" }), timeline(job, events))));
}

const TRANSITION_TITLES = { retry: "Retry job", cancel: "Cancel job", abort: "Abort job", requeue: "Requeue job" };

// What a job's state means for it now, in words: when a delayed job runs, since when a
// job whose worker died waits.
function stateNote(job) {
  if (job.state === "delayed") return el("span", { id: "delayed-until" }, "until ", timeText(job.available_at));
  if (job.state === "lease_expired") {
    return el("span", { id: "lease-expired" }, "at ", timeText(job.locked_until), ", waiting for a worker to take it back");
  }
  if (job.state === "paused") return el("span", { id: "queue-paused" }, "its queue is paused");
  return el("span", { class: "muted", text: (STATES[job.state] || ["", ""])[1] });
}

// The confirmation dialog: resolves true when the operator confirms.
async function confirmed(title, question) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = question;
  dialog.returnValue = "";
  const answer = await new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue), { once: true });
    dialog.showModal();
  });
  return answer === "ok";
}

async function transition(job, verb, question) {
  if (!(await confirmed(TRANSITION_TITLES[verb], question))) return;
  try {
    await api("POST", `/api/jobs/${encodeURIComponent(job.id)}/${verb}`);
    notice("");
  } catch (error) {
    return failed(error);
  }
  await jobPage(job.id);
  document.getElementById("main").focus();
}

// The timeline: a lane for the job's own events (created, manual retry, cancelled) and one
// per run (from a claim to the event that ended the run), a bar over each lane's span, a
// dot per event (hover for its details); the list under it says the same in words.
const RUN_ENDS = ["succeeded", "failed", "retry_scheduled", "timeout_requeued", "released", "aborted"];

function lanesOf(events) {
  const queue = { label: "queue", events: [] };
  const lanes = [queue];
  let run = null;
  let runs = 0;
  for (const event of events) {
    if (event.type === "claimed") {
      runs += 1;
      run = { label: `run ${runs} · attempt ${event.attempt}`, events: [] };
      lanes.push(run);
    }
    const inRun = ["claimed", "progress", "lease_renewed", "abort_requested"].includes(event.type) || RUN_ENDS.includes(event.type);
    if (run && inRun) {
      run.events.push(event);
      if (RUN_ENDS.includes(event.type)) run = null;
    } else {
      queue.events.push(event);
    }
  }
  return lanes.filter((lane) => lane.events.length);
}

function timeline(job, events) {
  const wrap = el("div", { id: "timeline" });
  if (!events.length) {
    wrap.append(el("p", { class: "muted", text: "No events (they are off: DRAMATIQ_PG_EVENTS)." }));
    return wrap;
  }
  const at = (event) => new Date(event.created_at).getTime();
  const times = events.map(at);
  const start = Math.min(...times);
  const unfinished = job.status === "queued" || job.status === "running";
  const end = Math.max(...times, unfinished ? Date.now() : 0, start + 1000);
  const lanes = lanesOf(events);
  const width = 620, left = 112, right = 12, laneHeight = 30, top = 8, axis = 22;
  const height = top + lanes.length * laneHeight + axis;
  const x = (t) => left + ((t - start) / (end - start)) * (width - left - right);
  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `Timeline of ${events.length} events over ${formatAge((end - start) / 1000)}: ${lanes.length - 1} runs.` });
  lanes.forEach((lane, i) => {
    const y = top + i * laneHeight + laneHeight / 2;
    const first = Math.min(...lane.events.map(at));
    const last = Math.max(...lane.events.map(at));
    chart.append(svg("text", { x: 4, y: y + 4, text: lane.label }));
    chart.append(svg("line", { x1: left, x2: width - right, y1: y, y2: y, stroke: "#eaeef2" }));
    if (lane.label !== "queue") {
      chart.append(svg("rect", { x: x(first), y: y - 4, width: Math.max(2, x(last) - x(first)), height: 8, rx: 4, fill: "#d0d7de" }));
    }
    for (const event of lane.events) {
      const dot = svg("circle", { cx: x(at(event)), cy: y, r: 6,
        fill: EVENT_COLOURS[event.type] || "#57606a", stroke: "#fff", "stroke-width": 2, "data-type": event.type });
      dot.append(svg("title", { text: `${event.type} · ${formatTime(event.created_at)}${event.actor ? " · " + visible(event.actor) : ""}` }));
      chart.append(dot);
    }
  });
  const axisY = height - 6;
  chart.append(svg("text", { x: left, y: axisY, text: new Date(start).toLocaleTimeString() }));
  chart.append(svg("text", { x: width - right, y: axisY, "text-anchor": "end", text: unfinished ? "now" : new Date(end).toLocaleTimeString() }));
  wrap.append(chart);

  const list = el("ol", { class: "events", id: "events", "aria-label": "Events, oldest first" });
  for (const event of events) {
    const item = el("li", { "data-type": event.type },
      el("span", { class: "t", text: event.type.replace(/_/g, " ") }),
      el("span", { class: "when", title: formatTime(event.created_at), text: formatTime(event.created_at) }),
      event.attempt ? el("span", { class: "when", text: "attempt " + event.attempt }) : null,
      event.actor ? el("div", { class: "muted mono", text: visible(event.actor) }) : null,
      event.data && Object.keys(event.data).length ? el("pre", {}, visible(json(event.data), true)) : null);
    item.style.setProperty("--c", EVENT_COLOURS[event.type] || "#57606a");
    list.append(item);
  }
  wrap.append(list);
  return wrap;
}

// -- start -------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").addEventListener("submit", login);
  document.getElementById("logout").addEventListener("click", logout);
  document.getElementById("loading").remove();
  start();
});

// -- workflows ---------------------------------------------------------------------------

const WORKFLOW_EVERY_MS = 2000; // a workflow's page while it runs
// The colours of a workflow's steps by status (a step's job has its own state on its page).
const STEP_COLOURS = {
  pending: "#8c959f", running: "#0969da", succeeded: "#1a7f37", failed: "#b42318", cancelled: "#57606a",
};

function workflowAddress(id) {
  return "/dashboard/workflows/" + encodeURIComponent(id);
}

function workflowBadge(status) {
  return el("span", { class: "badge s-" + status, id: "workflow-status", "data-status": status, text: status });
}

async function workflowsPage() {
  const body = el("tbody", {});
  setView("Workflows",
    el("h1", { text: "Workflows" }),
    el("table", { id: "workflows" },
      el("thead", {}, el("tr", {}, ["Workflow", "Name", "Status", "Steps done", "Created", "Finished"].map((h) => el("th", { text: h })))),
      body));
  async function refresh() {
    const page = await api("GET", "/api/workflows?limit=100");
    body.replaceChildren(...page.results.map((w) => el("tr", { "data-workflow": w.id },
      el("td", {}, el("a", { class: "mono", href: workflowAddress(w.id), text: w.id.slice(0, 8) })),
      el("td", {}, nameCell(w.name || "")),
      el("td", {}, workflowBadge(w.status)),
      el("td", { text: `${w.steps.succeeded} of ${w.nodes}` }),
      el("td", {}, timeText(w.created_at)),
      el("td", {}, timeText(w.finished_at)))));
    if (!page.results.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No workflow yet." })));
  }
  await refresh();
  schedule(refresh, LIST_EVERY_MS);
}

// Each node's column: one after the deepest node it waits for; a spawned child sits in its
// parent's column, below the steps.
function workflowColumns(nodes) {
  const before = new Map(nodes.map((n) => [n.id, []]));
  for (const node of nodes) for (const next of node.dependents) before.get(next)?.push(node.id);
  const column = new Map();
  for (const node of nodes) { // nodes come in order: every node after those it waits for
    if (node.parent) continue;
    const waits = before.get(node.id);
    column.set(node.id, waits.length ? Math.max(...waits.map((id) => column.get(id) ?? 0)) + 1 : 0);
  }
  for (const node of nodes) if (node.parent) column.set(node.id, column.get(node.parent) ?? 0);
  return column;
}

function drawWorkflow(flow) {
  const nodes = flow.nodes;
  const column = workflowColumns(nodes);
  const rows = new Map();
  const place = new Map();
  const boxW = 150, boxH = 38, gapX = 60, gapY = 14, pad = 10;
  for (const node of nodes) {
    const c = column.get(node.id);
    const r = rows.get(c) || 0;
    rows.set(c, r + 1);
    place.set(node.id, { x: pad + c * (boxW + gapX), y: pad + r * (boxH + gapY) });
  }
  const columns = Math.max(0, ...column.values()) + 1;
  const height = pad * 2 + Math.max(1, ...rows.values()) * (boxH + gapY);
  const width = pad * 2 + columns * (boxW + gapX) - gapX;
  const graph = svg("svg", { id: "workflow-graph", class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${nodes.length} steps: ` + Object.keys(STEP_COLOURS).map((s) => `${nodes.filter((n) => n.status === s).length} ${s}`).join(", ") });
  const edge = (from, to, dashed) => {
    const a = place.get(from), b = place.get(to);
    if (!a || !b) return;
    const same = a.x === b.x;
    const x1 = same ? a.x + boxW / 2 : a.x + boxW, y1 = same ? a.y + boxH : a.y + boxH / 2;
    const x2 = same ? b.x + boxW / 2 : b.x, y2 = same ? b.y : b.y + boxH / 2;
    graph.append(svg("path", { d: `M${x1},${y1} C${(x1 + x2) / 2},${y1} ${(x1 + x2) / 2},${y2} ${x2},${y2}`,
      fill: "none", stroke: "#8c959f", "stroke-width": 1.5, "stroke-dasharray": dashed ? "4 3" : "none" }));
  };
  for (const node of nodes) {
    for (const next of node.dependents) edge(node.id, next, false);
    if (node.parent) edge(node.parent, node.id, true);
  }
  for (const node of nodes) {
    const { x, y } = place.get(node.id);
    const colour = STEP_COLOURS[node.status] || "#8c959f";
    const link = svg("a", { href: "/dashboard/jobs/" + encodeURIComponent(node.job_id), class: "step",
      "data-node": node.id, "data-status": node.status, "data-job": node.job_id });
    link.append(
      svg("title", { text: `${visible(node.actor_name)}: ${node.status}` + (node.job_status ? ` (job ${node.job_status})` : " (no job yet)") }),
      svg("rect", { x, y, width: boxW, height: boxH, rx: 6, fill: colour, "fill-opacity": 0.15, stroke: colour, "stroke-width": 2 }),
      svg("text", { x: x + 8, y: y + 16, "font-size": 12, "font-weight": 600, fill: "#24292f", text: visible(node.actor_name).slice(0, 20) }),
      svg("text", { x: x + 8, y: y + 31, "font-size": 11, fill: colour, text: node.status + (node.parent ? " · spawned" : "") }));
    graph.append(link);
  }
  return graph;
}

async function workflowPage(id) {
  const path = "/api/workflows/" + encodeURIComponent(id);
  let flow = await readShown(path);
  if (flow === null) return;
  const heading = el("h1", {});
  const actions = el("div", { class: "actions", id: "workflow-actions" });
  const fields = el("dl", { class: "fields", id: "workflow-fields" });
  const figure = el("figure", { id: "workflow-figure" });
  const legend = el("p", { class: "muted", id: "workflow-legend" },
    Object.entries(STEP_COLOURS).map(([status, colour]) => el("span", { style: `color:${colour};margin-right:1rem`, text: "■ " + status })));
  setView("Workflow " + flow.id.slice(0, 8),
    el("p", {}, el("a", { href: "/dashboard/workflows", text: "← All workflows" })),
    heading, actions, fields, el("h2", { text: "Steps" }), legend, figure);

  function render(flow) {
    heading.replaceChildren("Workflow ", el("span", { class: "mono", text: flow.id.slice(0, 8) }), " ",
      flow.name ? el("span", { text: visible(flow.name) + " " }) : "", workflowBadge(flow.status));
    const field = (label, value) => [el("dt", { text: label }), el("dd", { "data-field": label }, value ?? "—")];
    fields.replaceChildren(...[
      field("id", el("span", { class: "mono", text: flow.id })),
      field("created", timeText(flow.created_at)),
      field("finished", timeText(flow.finished_at)),
      flow.cancelled_by ? field("cancelled by", visible(flow.cancelled_by)) : [],
      flow.error ? field("failed", el("span", {}, el("a", { href: "/dashboard/jobs/" + encodeURIComponent(flow.ended_by_job), text: "job " + flow.ended_by_job.slice(0, 8) }),
        ": ", el("span", { class: "error-text", text: visible(flow.error.trim().split("\n").pop()) }))) : []].flat());
    figure.replaceChildren(drawWorkflow(flow));
    if (!OPERATORS.includes(me.role)) return;
    const act = (verb, label, classes, question) => el("button", { type: "button", id: "workflow-" + verb, class: classes, text: label,
      onclick: async (event) => {
        if (!(await confirmed(label, question))) return;
        event.target.disabled = true;
        try {
          await api("POST", `${path}/${verb}`);
          notice("");
        } catch (error) {
          failed(error);
        }
        await refresh();
      } });
    const buttons = [];
    if (flow.status === "running") {
      buttons.push(act("abort", "Abort workflow", "danger",
        "Abort this workflow? Its steps that have not started never will, its queued jobs are cancelled and its running ones interrupted."));
    }
    if (flow.status === "failed" || flow.status === "cancelled") {
      buttons.push(act("retry", "Retry workflow", "primary",
        "Run this workflow again from its failed and cancelled steps? What succeeded is kept."));
    }
    actions.replaceChildren(...buttons);
  }

  async function refresh() {
    flow = await api("GET", path);
    render(flow);
    return flow.status === "running";
  }

  render(flow);
  schedule(refresh, WORKFLOW_EVERY_MS);
}

// The link from a job's page to its workflow's.
// Its workflow is looked up once per job page (the page's refreshes draw it again).
let jobWorkflow = { job: null, flow: null };
async function workflowField(job) {
  if (!job.workflow_node) return;
  if (jobWorkflow.job !== job.id) {
    const found = await api("GET", "/api/workflows?job=" + encodeURIComponent(job.id));
    jobWorkflow = { job: job.id, flow: found.results[0] || null };
  }
  const flow = jobWorkflow.flow;
  const fields = document.getElementById("job-fields");
  if (!flow || !fields || fields.querySelector('[data-field="workflow"]')) return;
  fields.append(el("dt", { text: "workflow" }), el("dd", { "data-field": "workflow" },
    el("a", { id: "job-workflow", href: workflowAddress(flow.id), text: (flow.name ? visible(flow.name) + " " : "") + flow.id.slice(0, 8) }),
    " ", workflowBadge(flow.status)));
}
