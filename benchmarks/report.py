"""Turning a run's JSON into the terminal table, the Markdown table and the PNG chart."""

from __future__ import annotations

import statistics
from pathlib import Path

# (target id, description, numerator, denominator, comparison, bound)
# A figure is (workload, broker, metric); ratios are taken between medians, on each server
# set-up (this broker's figures) against Redis and RabbitMQ measured in the same run.
TARGETS = (
    ("drain-vs-rabbitmq", "drain ≥ 2 × RabbitMQ (events on)",
     ("drain", "postgres", "rate"), ("drain", "rabbitmq", "rate"), ">=", 2.0),
    ("drain-vs-redis", "drain ≥ 2.5 × Redis (events on)",
     ("drain", "postgres", "rate"), ("drain", "redis", "rate"), ">=", 2.5),
    ("enqueue-vs-raw", "enqueue ≥ 0.9 × raw INSERT+COMMIT (created event included)",
     ("enqueue", "postgres", "rate"), ("enqueue", "raw-insert", "rate"), ">=", 0.9),
    ("bulk-vs-copy", "bulk enqueue ≥ 0.4 × raw COPY into a logged table (events on)",
     ("bulk", "postgres", "rate"), ("bulk", "raw-copy", "rate"), ">=", 0.4),
    ("enqueue-vs-raw-autocommit", "enqueue ≥ 0.9 × raw autocommit INSERT",
     ("enqueue", "postgres", "rate"), ("enqueue", "raw-insert-autocommit", "rate"), ">=", 0.9),
    ("enqueue8-vs-redis", "sends from 8 threads ≥ Redis from 8 threads",
     ("enqueue8", "postgres", "rate"), ("enqueue8", "redis", "rate"), ">=", 1.0),
    ("nondurable-vs-redis", "non-durable send (durable=False) ≥ Redis, one thread",
     ("enqueue", "postgres-nondurable", "rate"), ("enqueue", "redis", "rate"), ">=", 1.0),
    ("latency-p50-vs-floor", "latency p50 ≤ 1.25 × PostgreSQL's floor (no framework)",
     ("latency", "postgres", "p50_ms"), ("latency", "floor", "p50_ms"), "<=", 1.25),
    ("latency-p99-vs-floor", "latency p99 ≤ 2 × PostgreSQL's floor (no framework)",
     ("latency", "postgres", "p99_ms"), ("latency", "floor", "p99_ms"), "<=", 2.0),
    ("latency-p50-vs-rabbitmq", "latency p50 ≤ 1.5 × RabbitMQ's",
     ("latency", "postgres", "p50_ms"), ("latency", "rabbitmq", "p50_ms"), "<=", 1.5),
    ("latency-p99-vs-rabbitmq", "latency p99 ≤ 3 × RabbitMQ's",
     ("latency", "postgres", "p99_ms"), ("latency", "rabbitmq", "p99_ms"), "<=", 3.0),
    ("latency-p50-vs-redis", "latency p50 ≤ 0.5 × Redis's",
     ("latency", "postgres", "p50_ms"), ("latency", "redis", "p50_ms"), "<=", 0.5),
    ("latency-p99-vs-redis", "latency p99 < Redis's",
     ("latency", "postgres", "p99_ms"), ("latency", "redis", "p99_ms"), "<", 1.0),
    ("backlog-vs-empty", "backlog drain ≥ 0.8 × drain on an empty table",
     ("backlog", "postgres", "rate"), ("drain", "postgres", "rate"), ">=", 0.8),
    ("retention-drain", "drain while retention deletes a finished backlog ≥ 0.8 × without",
     ("retention", "postgres", "rate"), ("retention", "postgres", "baseline_rate"), ">=", 0.8),
    ("churn-size", "table+index size after churn ≤ 1.2 × at half time (bounded)",
     ("churn", "postgres", "end_mb"), ("churn", "postgres", "mid_mb"), "<=", 1.2),
    ("churn-hot", "hot jobs table at the churn's end ≤ 1.1 × at a third (soak)",
     ("churn", "postgres", "hot_end_mb"), ("churn", "postgres", "hot_third_mb"), "<=", 1.1),
    ("churn-hot-max", "hot jobs table's largest, churn's last third ≤ 1.1 × its 2nd (soak)",
     ("churn", "postgres", "hot_max_t3_mb"), ("churn", "postgres", "hot_max_t2_mb"), "<=", 1.1),
    ("churn-claim", "claim wait p99 in the churn's last third ≤ 1.25 × in its second",
     ("churn", "postgres", "claim_wait_p99_ms_t3"), ("churn", "postgres", "claim_wait_p99_ms_t2"),
     "<=", 1.25),
    ("delayed-memory", "worker memory with delayed messages ≤ 1.1 × idle",
     ("memory", "postgres", "delayed_mb"), ("memory", "postgres", "idle_mb"), "<=", 1.1),
    ("notify-vs-off", "sends, 4 processes × 8 threads, idle workers woken ≥ 0.9 × no NOTIFY",
     ("notify", "postgres", "rate"), ("notify", "postgres-notify-off", "rate"), ">=", 0.9),
    ("idle-statements", "idle worker: ≤ 1 statement per queue per poll interval",
     ("idle", "postgres", "per_queue_per_poll"), None, "<=", 1.0),
)  # fmt: skip

#: Which figure of the same server is PostgreSQL's own floor of a workload (the "vs floor"
#: column): the latency floor script, a one-thread autocommit INSERT, a COPY of the same
#: bytes into a logged table.
FLOOR_OF = {
    "latency": "floor", "enqueue": "raw-insert-autocommit", "bulk": "raw-copy", "life": "floor",
}  # fmt: skip

#: No collapse: a step of the scaling workload may fall at most this far below the best
#: drain measured with fewer processes.
SCALING_FLOOR = 0.8

LABELS = {
    "raw-insert": "raw INSERT+COMMIT",
    "raw-insert-autocommit": "raw INSERT, autocommit",
    "raw-copy": "raw COPY, logged table",
    "floor": "PostgreSQL floor (no framework)",
    "postgres": "postgres (this broker)",
    "postgres-noevents": "postgres, events off",
    "postgres-nondurable": "postgres, durable=False",
    "postgres-ref": "postgres, earlier release (--against)",
    "postgres-notify-statement": "postgres, NOTIFY in every send's statement",
    "postgres-notify-off": "postgres, no NOTIFY",
    "redis": "redis (dramatiq)",
    "rabbitmq": "rabbitmq (dramatiq)",
}
SERVER_LABELS = {"embedded": "embedded server", "tcp": "standalone server (TCP)"}
#: Figures that depend on the PostgreSQL server set-up (the rest are Redis and RabbitMQ).
PG_NAMES = (
    "floor", "raw-insert", "raw-insert-autocommit", "raw-copy", "postgres", "postgres-noevents",
    "postgres-nondurable", "postgres-ref", "postgres-notify-statement", "postgres-notify-off",
)  # fmt: skip


def _label(name: str) -> str:
    base, _, server = name.partition("@")
    label = LABELS.get(base, base)
    return f"{label} [{server}]" if server else label


def _chart_label(name: str) -> str:
    """A label short enough for a bar: one phrase a line."""
    label = _label(name)
    if label.startswith("raw "):
        return label.replace(" ", "\n").replace("+", "\n+")
    return label.replace(" (", "\n(").replace(", ", ",\n").replace(" [", "\n[")


# (title, workload, metric, unit, higher is better)
ROWS = (
    ("enqueue", "enqueue", "rate", "msg/s", True),
    ("enqueue, 8 threads", "enqueue8", "rate", "msg/s", True),
    ("bulk enqueue", "bulk", "rate", "msg/s", True),
    ("drain", "drain", "rate", "msg/s", True),
    ("latency p50", "latency", "p50_ms", "ms", False),
    ("latency p99", "latency", "p99_ms", "ms", False),
    ("WAL per job, whole life", "life", "wal_b", "B", False),
    ("WAL per job, send", "life", "wal_send_b", "B", False),
    ("WAL per job, drain", "life", "wal_drain_b", "B", False),
    ("WAL per job, without full-page images", "life", "wal_nofpi_b", "B", False),
    ("WAL per job, raw LSN delta", "life", "wal_raw_b", "B", False),
    ("server CPU per job, this database", "life", "cpu_db_us", "µs", False),
    ("server CPU per job, all processes", "life", "cpu_us", "µs", False),
    ("backlog drain", "backlog", "rate", "msg/s", True),
    ("drain, finished backlog", "retention", "baseline_rate", "msg/s", True),
    ("drain, retention deleting it", "retention", "rate", "msg/s", True),
    ("retention delete rate", "retention", "delete_rate", "jobs/s", True),
    ("job tables, churn 1/4 time", "churn", "q1_mb", "MiB", False),
    ("job tables, churn half time", "churn", "mid_mb", "MiB", False),
    ("job tables, churn 3/4 time", "churn", "q3_mb", "MiB", False),
    ("job tables, churn end", "churn", "end_mb", "MiB", False),
    ("hot jobs table, churn 1/3 time", "churn", "hot_third_mb", "MiB", False),
    ("hot jobs table, churn end", "churn", "hot_end_mb", "MiB", False),
    ("hot jobs table, churn 2nd third's largest", "churn", "hot_max_t2_mb", "MiB", False),
    ("hot jobs table, churn last third's largest", "churn", "hot_max_t3_mb", "MiB", False),
    ("churn finished/s, 2nd third", "churn", "finished_per_s_t2", "jobs/s", True),
    ("churn finished/s, last third", "churn", "finished_per_s_t3", "jobs/s", True),
    ("churn claim wait p99, 2nd third", "churn", "claim_wait_p99_ms_t2", "ms", False),
    ("churn claim wait p99, last third", "churn", "claim_wait_p99_ms_t3", "ms", False),
    ("worker RSS, idle", "memory", "idle_mb", "MiB", False),
    ("worker RSS, delayed msgs", "memory", "delayed_mb", "MiB", False),
    ("idle: statements per queue per poll interval", "idle", "per_queue_per_poll", "", False),
    ("sends, 4 processes × 8 threads", "notify", "rate", "msg/s", True),
    ("notify: notifications per 1,000 sends", "notify", "notifications_per_1000", "", False),
)


def servers(data: dict) -> list[str]:
    return list(data.get("servers", {})) or ["tcp"]


def _fig(data: dict, workload: str, broker: str, metric: str, server: str | None = None):
    key = f"{broker}@{server}" if server and broker in PG_NAMES else broker
    return data.get("results", {}).get(workload, {}).get(key, {}).get(metric)


def _status(ratio: float, op: str, bound: float) -> str:
    met = {">=": ratio >= bound, "<=": ratio <= bound, "<": ratio < bound}[op]
    return "met" if met else "missed"


def targets(data: dict) -> list[dict]:
    out = []
    for server in servers(data):
        for tid, text, num, den, op, bound in TARGETS:
            a = _fig(data, *num, server=server)
            b = _fig(data, *den, server=server) if den else {"median": 1.0}
            base = {"id": tid, "target": text, "server": server, "required": f"{op} {bound:g}"}
            if a is None or b is None or not b["median"]:
                out.append({**base, "ratio": None, "status": "not measured"})
                continue
            ratio = a["median"] / b["median"]
            out.append({**base, "ratio": ratio, "status": _status(ratio, op, bound)})
        out.append(_every_round(data, server))
        out.extend(_group_targets(data, server))
    return out


def _every_round(data: dict, server: str) -> dict:
    """Drain ≥ 2 × RabbitMQ in every round: the worst ratio of the two drains measured in
    the same round (the samples are in round order)."""
    base = {"id": "drain-vs-rabbitmq-every-round", "server": server, "required": ">= 2",
            "target": "drain ≥ 2 × RabbitMQ in every round (worst round)"}  # fmt: skip
    ours = _fig(data, "drain", "postgres", "rate", server)
    theirs = _fig(data, "drain", "rabbitmq", "rate")
    if not ours or not theirs or len(ours["samples"]) != len(theirs["samples"]):
        return {**base, "ratio": None, "status": "not measured"}
    worst = min(a / b for a, b in zip(ours["samples"], theirs["samples"]))
    return {**base, "ratio": worst, "status": _status(worst, ">=", 2.0)}


def _steps(data: dict, workload: str, server: str) -> list[tuple[int, dict]]:
    per = data.get("results", {}).get(workload, {})
    steps = []
    for key, figs in per.items():
        name, _, where = key.partition("@")
        if where == server and name.endswith("p") and name[:-1].isdigit():
            steps.append((int(name[:-1]), figs))
    return sorted(steps, key=lambda step: step[0])


def _med(figs: dict, metric: str) -> float | None:
    fig = figs.get(metric)
    return None if fig is None else fig["median"]


def _group_targets(data: dict, server: str) -> list[dict]:
    out = []
    steps = _steps(data, "scaling", server)
    if steps:
        worst, best = None, 0.0
        for _, figs in steps:
            rate = _med(figs, "rate") or 0.0
            if best:
                ratio = rate / best
                worst = ratio if worst is None else min(worst, ratio)
            best = max(best, rate)
        deadlocks = sum(max(f["deadlocks_logged"]["max"], 0) for _, f in steps)
        out.append({"id": "scaling-no-collapse", "server": server,
                    "target": f"scaling: no step below {SCALING_FLOOR:g} × the best drain "
                              "with fewer processes",
                    "ratio": worst, "required": f">= {SCALING_FLOOR:g}",
                    "status": "not measured" if worst is None
                    else _status(worst, ">=", SCALING_FLOOR)})  # fmt: skip
        out.append({"id": "scaling-no-deadlock", "server": server,
                    "target": "scaling: no deadlock in the worker logs",
                    "ratio": float(deadlocks), "required": "= 0",
                    "status": "met" if deadlocks == 0 else "missed"})  # fmt: skip
    steps = _steps(data, "pgbouncer", server)
    if steps:
        lost = sum(f["lost"]["max"] for _, f in steps)
        errors = sum(f["log_errors"]["max"] for _, f in steps)
        over = max(f["max_server_connections"]["max"] - f["pool_size"]["max"] for _, f in steps)
        ok = lost == 0 and errors == 0 and over <= 0
        out.append({"id": "pgbouncer", "server": server,
                    "target": "through PgBouncer: no lost job, no error, server connections ≤ "
                              "pool size",
                    "ratio": None, "required": "all", "status": "met" if ok else "missed",
                    "detail": f"lost {lost:g}, error lines {errors:g}, "
                              f"connections over the pool size {max(over, 0):g}"})  # fmt: skip
    return out


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _cell(fig: dict | None, unit: str) -> str:
    if fig is None:
        return ""
    n = len(fig["samples"])
    spread = f" ({_num(fig['min'])}–{_num(fig['max'])}, n={n})" if n > 1 else ""
    return f"{_num(fig['median'])} {unit}".strip() + spread


def _rows(data: dict) -> list[list[str]]:
    rows = []
    results = data.get("results", {})
    where = servers(data)
    brokers = ["floor", "raw-insert", "raw-insert-autocommit", "raw-copy", *data.get("brokers", {})]
    skipped = data.get("skipped", {})
    for title, workload, metric, unit, _ in ROWS:
        if workload not in results and workload not in data.get("errors", {}):
            continue
        for broker in brokers:
            if broker in skipped:
                if (
                    broker in {"redis", "rabbitmq"}
                    and workload in results
                    and (workload not in {"backlog", "idle", "retention", "churn"})
                ):
                    rows.append([title, _label(broker), *["skipped: not reachable"] * len(where),
                                 *[""] * 3])  # fmt: skip
                continue
            cells, ratios = [], {"redis": [], "rabbitmq": [], "floor": []}
            seen = False
            for server in where:
                fig = _fig(data, workload, broker, metric, server=server)
                key = f"{broker}@{server}" if broker in PG_NAMES else broker
                err = data.get("errors", {}).get(workload, {}).get(key)
                if fig is None:
                    cells.append(f"failed: {err[:60]}" if err else "")
                    seen = seen or bool(err)
                    for other in ratios:
                        ratios[other].append("–")
                    continue
                seen = True
                cells.append(_cell(fig, unit))
                for other in ratios:
                    if other == "floor":
                        ref = _fig(data, workload, FLOOR_OF.get(workload, ""), metric, server)
                    else:
                        ref = _fig(data, workload, other, metric)
                    if broker.startswith("postgres") and ref and ref["median"]:
                        ratios[other].append(f"{fig['median'] / ref['median']:.2f}×")
                    else:
                        ratios[other].append("")
            if not seen:
                continue
            ratio_cells = [" / ".join(r) if any(r) else "" for r in ratios.values()]
            rows.append([title, _label(broker), *cells, *ratio_cells])
    return rows


# -- ratios within the run, a job's whole life, the earlier release ------------------------

# (what, workload, numerator, denominator, metric): this broker against a reference
# measured in the same rounds, each round's ratio and their median.
RATIOS = (
    ("WAL per job, this database's records: broker / floor", "life", "postgres", "floor",
     "wal_b"),
    ("WAL per job, without full-page images: broker / floor", "life", "postgres", "floor",
     "wal_nofpi_b"),
    ("WAL per job, raw LSN delta: broker / floor", "life", "postgres", "floor", "wal_raw_b"),
    ("server CPU per job, this database's backends: broker / floor", "life", "postgres",
     "floor", "cpu_db_us"),
    ("server CPU per job, all server processes: broker / floor", "life", "postgres", "floor",
     "cpu_us"),
    ("latency p50: broker / floor", "latency", "postgres", "floor", "p50_ms"),
    ("latency p99: broker / floor", "latency", "postgres", "floor", "p99_ms"),
    ("one-thread sends / raw autocommit INSERT", "enqueue", "postgres", "raw-insert-autocommit",
     "rate"),
    ("bulk enqueue / raw COPY", "bulk", "postgres", "raw-copy", "rate"),
    ("drain / RabbitMQ", "drain", "postgres", "rabbitmq", "rate"),
    ("sends 4×8, notifier / no NOTIFY", "notify", "postgres", "postgres-notify-off", "rate"),
    ("sends 4×8, NOTIFY in each statement / no NOTIFY", "notify",
     "postgres-notify-statement", "postgres-notify-off", "rate"),
    ("sends 4×8, notifier / NOTIFY in each statement", "notify", "postgres",
     "postgres-notify-statement", "rate"),
)  # fmt: skip
# (figure, workload, metric, unit, higher is better): this checkout against the release of
# --against, measured in turns in the same rounds.
REF_FIGURES = (
    ("one-thread sends", "enqueue", "rate", "msg/s", True),
    ("sends from 8 threads", "enqueue8", "rate", "msg/s", True),
    ("sends from 4 processes × 8 threads", "notify", "rate", "msg/s", True),
    ("bulk enqueue", "bulk", "rate", "msg/s", True),
    ("drain", "drain", "rate", "msg/s", True),
    ("latency p50", "latency", "p50_ms", "ms", False),
    ("latency p99", "latency", "p99_ms", "ms", False),
    ("worker RSS, idle", "memory", "idle_mb", "MiB", False),
    ("worker RSS, delayed msgs", "memory", "delayed_mb", "MiB", False),
    ("WAL per job, whole life", "life", "wal_b", "B", False),
    ("WAL per job, send", "life", "wal_send_b", "B", False),
    ("WAL per job, drain", "life", "wal_drain_b", "B", False),
    ("WAL per job, without full-page images", "life", "wal_nofpi_b", "B", False),
    ("WAL per job, raw LSN delta", "life", "wal_raw_b", "B", False),
    ("server CPU per job, this database", "life", "cpu_db_us", "µs", False),
    ("server CPU per job, all processes", "life", "cpu_us", "µs", False),
)
#: The broker variants shown in the breakdown of a job's life, and its floor last.
LIFE_NAMES = ("postgres", "postgres-noevents", "postgres-ref", "floor")
#: Rows of a breakdown before the rest is summed up as "other".
LIFE_TOP = 14

RATIO_HEADER = ["ratio", "server", "per round", "median of the rounds' ratios",
                "ratio of the medians"]  # fmt: skip
REF_HEADER = ["figure", "server", "this checkout", "release", "this checkout / release, per "
              "round", "median of the rounds' ratios"]  # fmt: skip


def _by_round(fig: dict) -> dict[int, float]:
    rounds = fig.get("rounds") or list(range(1, len(fig["samples"]) + 1))
    return dict(zip(rounds, fig["samples"]))


def _per_round(data: dict, workload: str, a: str, b: str, metric: str, server: str) -> list:
    """The ratio ``a / b`` of each round in which both were measured."""
    fa, fb = _fig(data, workload, a, metric, server), _fig(data, workload, b, metric, server)
    if not fa or not fb:
        return []
    ra, rb = _by_round(fa), _by_round(fb)
    return [ra[r] / rb[r] for r in sorted(set(ra) & set(rb)) if rb[r]]


def _ratio_rows(data: dict) -> list[list[str]]:
    rows = []
    for server in servers(data):
        for what, workload, a, b, metric in RATIOS:
            per = _per_round(data, workload, a, b, metric, server)
            if not per:
                continue
            fa = _fig(data, workload, a, metric, server)
            fb = _fig(data, workload, b, metric, server)
            of_medians = f"{fa['median'] / fb['median']:.2f}×" if fb["median"] else ""
            rows.append([what, server, ", ".join(f"{r:.2f}" for r in per),
                         f"{statistics.median(per):.2f}×", of_medians])  # fmt: skip
    return rows


def _ref_rows(data: dict) -> list[list[str]]:
    rows = []
    for server in servers(data):
        for what, workload, metric, unit, higher in REF_FIGURES:
            per = _per_round(data, workload, "postgres", "postgres-ref", metric, server)
            if not per:
                continue
            better = "higher" if higher else "lower"
            rows.append([f"{what} ({better} is better)", server,
                         _cell(_fig(data, workload, "postgres", metric, server), unit),
                         _cell(_fig(data, workload, "postgres-ref", metric, server), unit),
                         ", ".join(f"{r:.2f}" for r in per),
                         f"{statistics.median(per):.2f}×"])  # fmt: skip
    return rows


def _against_lines(data: dict) -> list[str]:
    against = data.get("against")
    if not against:
        return []
    lines = [
        f"against {against['ref']}: release {against['version']} (commit "
        f"{against['commit'][:12]}), built into its own virtualenv and run with this "
        "checkout's harness, in turns with this checkout in every round"
    ]
    if against.get("not_run"):
        lines.append(
            "not run against the release: "
            + ", ".join(against["not_run"])
            + " (they load or read this checkout's schema or settings)"
        )
    failed = [
        f"{workload} [{key.partition('@')[2]}]: {err[:160]}"
        for workload, per in data.get("errors", {}).items()
        for key, err in per.items()
        if key.startswith("postgres-ref@")
    ]
    if failed:
        lines.append("could not run against the release: " + "; ".join(failed))
    return lines


def _table_group(key: str) -> str:
    """A relation's row of the by-table breakdown: ``jobs heap``, ``jobs indexes``..."""
    name, _, kind = key.partition(" ")
    return f"{name} indexes" if kind.startswith("index ") else key


def _life_table(
    data: dict, server: str, prefix: str, *, by_table: bool = False, top: int = LIFE_TOP
) -> tuple[list[str], list[list[str]]]:
    """Bytes of WAL per job by relation (``rel:``) or record type (``rec:``): medians of
    the rounds, one column per broker variant and the floor. ``by_table``: a table's
    indexes summed in one row (round by round, then the median)."""
    per = data.get("results", {}).get("life", {})
    names = [n for n in LIFE_NAMES if f"{n}@{server}" in per]
    figs: dict[str, dict[str, dict]] = {}
    for n in names:
        figs[n] = {}
        groups: dict[str, dict[int, float]] = {}
        for key, fig in per[f"{n}@{server}"].items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            group = _table_group(name) if by_table else name
            for r, v in _by_round(fig).items():
                groups.setdefault(group, {})[r] = groups.get(group, {}).get(r, 0.0) + v
        for group, values in groups.items():
            figs[n][group] = {"median": statistics.median(values.values())}
    keys = {k for f in figs.values() for k in f}
    if not keys:
        return [], []

    def size(name: str, key: str) -> float:
        return figs[name].get(key, {}).get("median", 0.0)

    def cell(name: str, key: str) -> str:
        return f"{size(name, key):,.0f}" if key in figs[name] else ""

    # The largest in any column, shown the broker's largest first, then the floor's own.
    ordered = sorted(keys, key=lambda k: max(size(n, k) for n in names), reverse=True)
    shown = sorted(ordered[:top], key=lambda k: [size(n, k) for n in names], reverse=True)
    rows = [[k, *[cell(n, k) for n in names]] for k in shown]
    rest = ordered[top:]
    if rest:
        rows.append([f"other ({len(rest)})",
                     *[f"{sum(size(n, k) for k in rest):,.0f}" for n in names]])  # fmt: skip
    wholes = {n: per[f"{n}@{server}"] for n in names}
    rows.append(["total, this database's records",
                 *[f"{_med(wholes[n], 'wal_b') or 0:,.0f}" for n in names]])  # fmt: skip
    if prefix == "rec:":
        rows.append(["of which full-page images",
                     *[f"{_med(wholes[n], 'wal_fpi_b') or 0:,.0f}" for n in names]])  # fmt: skip
    what = "table" if by_table else "relation" if prefix == "rel:" else "record type"
    return [what, *[_label(n) for n in names]], rows


def _life_notes(data: dict) -> list[str]:
    lines = []
    for server, info in data.get("servers", {}).items():
        reason = info.get("walinspect")
        if reason and reason != "available":
            lines.append(f"{server}: no WAL breakdown by relation: {reason}. The raw LSN "
                         "delta stands alone: exact on a server of the benchmark's own (the "
                         "embedded one), every session's work on a shared one")  # fmt: skip
    for key, notes in data.get("notes", {}).get("life", {}).items():
        for note in notes:
            lines.append(f"{key}: {note}")
    return lines


LIFE_TEXT = (
    "A job's whole life (`life`): sent with actor.send() from one thread, then drained by one "
    "worker; the floor is one autocommit INSERT per job into a table with a primary key and "
    "a claim index, then an UPDATE to running and a DELETE 8 rows at a time. Bytes per job: "
    "this database's WAL records (pg_walinspect; commits of its transactions included), "
    "medians of the rounds. On a shared server the raw LSN delta and the CPU of all server "
    "processes count other sessions' work too; this database's records and backends do not."
)


def _life_sections(data: dict, md: bool) -> list[str]:
    """The breakdowns: by table and by record type; in Markdown also every relation."""
    out = []
    parts = [("rel:", True, "by table", LIFE_TOP), ("rec:", False, "by record type", LIFE_TOP)]
    if md:
        parts.insert(1, ("rel:", False, "by relation", 1000))
    for server in servers(data):
        for prefix, by_table, what, top in parts:
            head, rows = _life_table(data, server, prefix, by_table=by_table, top=top)
            if rows:
                title = f"WAL bytes per job {what} [{server}]"
                out += [f"### {title}", ""] if md else [f"{title}:"]
                out += [_md_table(head, rows) if md else _table(head, rows), ""]
    return out


def header(data: dict) -> list[str]:
    where = servers(data)
    per = " / ".join(where)
    return ["workload", "broker", *[SERVER_LABELS.get(s, s) for s in where],
            f"vs redis ({per})", f"vs rabbitmq ({per})",
            f"vs PostgreSQL floor, same server ({per})"]  # fmt: skip


GROUP_HEADER = ["processes × 2 threads", "server", "drain msg/s", "lock waits (share of "
                "samples, most waiters)", "deadlocks (server / logs)", "server connections",
                "lost / extra claims / error lines"]  # fmt: skip
POOL_HEADER = ["processes × 2 threads", "server", "direct drain msg/s", "via PgBouncer msg/s",
               "server connections via PgBouncer (pool size)", "client connections",
               "lost / extra claims / error lines"]  # fmt: skip


def _group_rows(data: dict) -> list[list[str]]:
    rows = []
    for server in servers(data):
        for p, f in _steps(data, "scaling", server):
            rows.append([str(p), server, _cell(f.get("rate"), ""),
                         f"{_med(f, 'lock_wait_share') * 100:.0f} %, "
                         f"{_med(f, 'max_lock_waiters'):g}",
                         f"{_med(f, 'deadlocks'):g} / {_med(f, 'deadlocks_logged'):g}",
                         f"{_med(f, 'max_server_connections'):g}",
                         f"{_med(f, 'lost'):g} / {_med(f, 'extra_claims'):g} / "
                         f"{_med(f, 'log_errors'):g}"])  # fmt: skip
    return rows


def _pool_rows(data: dict) -> list[list[str]]:
    rows = []
    for server in servers(data):
        direct = dict(_steps(data, "scaling", server))
        for p, f in _steps(data, "pgbouncer", server):
            d = direct.get(p, {})
            rows.append([str(p), server, _cell(d.get("rate"), ""), _cell(f.get("rate"), ""),
                         f"{_med(f, 'max_server_connections'):g} ({_med(f, 'pool_size'):g})",
                         f"{_med(f, 'max_client_connections'):g}",
                         f"{_med(f, 'lost'):g} / {_med(f, 'extra_claims'):g} / "
                         f"{_med(f, 'log_errors'):g}"])  # fmt: skip
    return rows


def _group_errors(data: dict) -> list[str]:
    lines = []
    for workload in ("scaling", "pgbouncer"):
        for key, err in data.get("errors", {}).get(workload, {}).items():
            lines.append(f"{workload} {key}: {err}")
    return lines


TARGET_HEADER_BASE = ["target", "required"]


def _target_table(data: dict) -> tuple[list[str], list[list[str]]]:
    where = servers(data)
    by_id: dict[str, dict] = {}
    for t in data.get("targets", []):
        row = by_id.setdefault(t["id"], {"target": t["target"], "required": t["required"]})
        if t["ratio"] is None and t["status"] == "not measured":
            row[t["server"]] = "not measured"
        else:
            value = "" if t["ratio"] is None else f"{t['ratio']:.2f} "
            detail = f" ({t['detail']})" if t.get("detail") else ""
            row[t["server"]] = f"{value}{t['status']}{detail}"
    head = [*TARGET_HEADER_BASE, *[SERVER_LABELS.get(s, s) for s in where]]
    rows = [[r["target"], r["required"], *[r.get(s, "") for s in where]] for r in by_id.values()]
    return head, rows


def _extra_lines(data: dict) -> list[str]:
    lines = []
    for server in servers(data):
        for base in ("raw-insert", "raw-insert-autocommit"):
            raw = _fig(data, "enqueue", base, "rate", server)
            if not raw:
                continue
            for b in ("postgres", "postgres-noevents"):
                fig = _fig(data, "enqueue", b, "rate", server)
                if fig:
                    lines.append(
                        f"{server}: enqueue, {LABELS[b]}: "
                        f"{fig['median'] / raw['median']:.2f} × the {LABELS[base]} rate"
                    )
        on = _fig(data, "drain", "postgres", "rate", server)
        off = _fig(data, "drain", "postgres-noevents", "rate", server)
        if on and off:
            lines.append(
                f"{server}: drain, events on / events off: "
                f"{on['median'] / off['median']:.2f} (what the audit trail costs)"
            )
        on, off = (
            _fig(data, "memory", "postgres", "idle_mb", server),
            _fig(data, "memory", "postgres", "delayed_mb", server),
        )
        if on and off:
            lines.append(
                f"{server}: memory: {off['median'] / on['median'] * 100 - 100:+.0f} % with "
                f"{data['config']['delayed']:,} delayed messages"
            )
    for b in ("redis", "rabbitmq"):
        on, off = _fig(data, "memory", b, "idle_mb"), _fig(data, "memory", b, "delayed_mb")
        if on and off:
            lines.append(
                f"memory, {LABELS[b]}: {off['median'] / on['median'] * 100 - 100:+.0f} % "
                f"with {data['config']['delayed']:,} delayed messages"
            )
    return lines


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _server_lines(data: dict) -> list[str]:
    lines = []
    for server, info in data.get("servers", {}).items():
        settings = ", ".join(f"{k} {v}" for k, v in info.get("settings", {}).items())
        lines.append(f"{SERVER_LABELS.get(server, server)} ({server}): {info.get('url')}; "
                     f"{settings}")  # fmt: skip
    return lines


def terminal(data: dict) -> str:
    parts = [*_server_lines(data), ""]
    parts += _against_lines(data)
    if _rows(data):
        parts += [_table(header(data), _rows(data)), "", *_extra_lines(data)]
    life = _life_sections(data, md=False)
    if life:
        parts += ["", LIFE_TEXT, "", *life, *_life_notes(data)]
    if _ratio_rows(data):
        parts += ["", "Ratios within this run (each round's, and their median):",
                  _table(RATIO_HEADER, _ratio_rows(data))]  # fmt: skip
    if _ref_rows(data):
        parts += ["", "This checkout against the earlier release (--against):",
                  _table(REF_HEADER, _ref_rows(data))]  # fmt: skip
    if _group_rows(data):
        parts += ["", "Scaling (drain by N worker processes):", _table(GROUP_HEADER,
                  _group_rows(data))]  # fmt: skip
    if _pool_rows(data):
        parts += ["", "Through PgBouncer in transaction mode:", _table(POOL_HEADER,
                  _pool_rows(data))]  # fmt: skip
    parts += _group_errors(data)
    head, rows = _target_table(data)
    parts += ["", _table(head, rows)]
    return "\n".join(parts)


def markdown(data: dict) -> str:
    m = data["machine"]
    cfg = data["config"]
    lines = [
        "# Benchmark results",
        "",
        f"- date: {data['date']}",
        f"- machine: {m['cores']} CPU cores, {m['platform']}, Python {m['python']}",
        *[f"- {line}" for line in _server_lines(data)],
        f"- command: `{data['command']}` ({data['elapsed_s'] / 60:.1f} min)",
        f"- repetitions: {cfg['repeat']}; median and spread (min–max) over them; ratios are "
        "between medians. Redis and RabbitMQ do not depend on the PostgreSQL set-up: "
        "measured once a round, they are the reference for both columns",
        f"- workloads: enqueue {cfg['enqueue']:,} sends from one thread, and "
        f"{cfg.get('enqueue8', 0):,} from 8 threads at once; drain "
        f"{cfg['drain']:,} queued messages by one worker process with 8 threads; latency "
        f"{cfg['latency']:,} sends {cfg['latency_gap'] * 1000:g} ms apart to an idle worker "
        f"(send() to actor start); backlog: the drain with {cfg['backlog_finished']:,} "
        f"finished and {cfg['backlog_queued']:,} queued rows in the table; memory: worker "
        f"RSS {cfg['settle']:g} s after boot, idle and with {cfg['delayed']:,} messages "
        f"delayed by an hour; scaling: {cfg.get('scaling', 0):,} messages drained by "
        f"{', '.join(str(p) for p in cfg.get('processes', ()))} worker processes × 2 "
        f"threads, directly and through PgBouncer (pool size {cfg.get('pool_size')}); idle: "
        f"a worker with {cfg.get('idle_queues')} queues left idle {cfg.get('idle_seconds')} s"
        + (
            f"; life: {cfg['life']:,} jobs sent from one thread, then drained by one worker, "
            "WAL bytes and server CPU per job against the floor"
            if "life" in cfg
            else ""
        )
        + (
            f"; retention: the drain with {cfg['retention_finished']:,} finished jobs past "
            "their retention age in the table, without and then with retention deleting them; "
            f"churn: {cfg['churn_seconds']:,} s of {cfg['churn_rate']:,} jobs/s with retention "
            "every 5 s keeping succeeded jobs 30 s, job tables' size at half time and at the end"
            if "retention_finished" in cfg
            else ""
        ),
        "",
    ]
    lines[-1:-1] = [f"- {line}" for line in _against_lines(data)]
    if _rows(data):
        lines += [_md_table(header(data), _rows(data)), ""]
        lines += [*[f"- {line}" for line in _extra_lines(data)], ""]
    life = _life_sections(data, md=True)
    if life:
        lines += ["## A job's whole life", "", LIFE_TEXT, "", *life]
        lines += [*[f"- {line}" for line in _life_notes(data)], ""]
    if _ratio_rows(data):
        lines += ["## Ratios within this run", "", _md_table(RATIO_HEADER, _ratio_rows(data)), ""]
    if _ref_rows(data):
        lines += [f"## Against {data['against']['ref']} (release {data['against']['version']})",
                  "", _md_table(REF_HEADER, _ref_rows(data)), ""]  # fmt: skip
    if _group_rows(data):
        lines += ["## Scaling", "", _md_table(GROUP_HEADER, _group_rows(data)), ""]
    if _pool_rows(data):
        lines += ["## Through PgBouncer (transaction mode)", "",
                  _md_table(POOL_HEADER, _pool_rows(data)), ""]  # fmt: skip
    lines += [f"- {line}" for line in _group_errors(data)]
    head, rows = _target_table(data)
    lines += ["", "## Targets", "", _md_table(head, rows), ""]
    return "\n".join(lines)


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("enqueue, one thread (msg/s)", "enqueue", ["rate"]),
        ("enqueue, 8 threads (msg/s)", "enqueue8", ["rate"]),
        ("drain (msg/s)", "drain", ["rate"]),
        ("latency (ms)", "latency", ["p50_ms", "p99_ms"]),
        ("drain, empty vs backlog table (msg/s)", None, None),
        ("worker RSS (MiB)", "memory", ["idle_mb", "delayed_mb"]),
        ("drain by N processes × 2 threads (msg/s)", "scaling", None),
        ("idle: statements per queue per poll interval", "idle", ["per_queue_per_poll"]),
    ]
    fig, grid = plt.subplots(3, 3, figsize=(18, 15))
    axes = list(grid.flat)
    for ax, (title, workload, metrics) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        if workload == "latency":
            ax.set_yscale("log")
        if workload == "scaling":
            for server in servers(data):
                for wl, style in (("scaling", "-o"), ("pgbouncer", "--s")):
                    steps = _steps(data, wl, server)
                    if steps:
                        label = f"{server}{', via PgBouncer' if wl == 'pgbouncer' else ''}"
                        ax.plot([p for p, _ in steps], [_med(f, "rate") for _, f in steps],
                                style, label=label)  # fmt: skip
            ax.set_xscale("log", base=2)
            counts = sorted(
                {p for server in servers(data) for p, _ in _steps(data, "scaling", server)}
            )
            ax.set_xticks(counts, [str(p) for p in counts])
            ax.set_xlabel("worker processes", fontsize=8)
            ax.legend(fontsize=7)
            continue
        if workload is None:
            bars = [
                (f"{label}\n[{server}]", _fig(data, wl, "postgres", "rate", server))
                for server in servers(data)
                for label, wl in (("empty", "drain"), ("backlog", "backlog"))
            ]
            _bars(ax, [(n, [f]) for n, f in bars if f is not None], [""])
            continue
        per = data.get("results", {}).get(workload, {})
        groups = [(_chart_label(key), [figs.get(m) for m in metrics]) for key, figs in per.items()]
        _bars(ax, groups, metrics)
    axes[-1].axis("off")
    lines = [
        f"{t['status']:>12}  [{t['server']}] {t['target']}"
        + ("" if t["ratio"] is None else f": {t['ratio']:.2f}")
        for t in data.get("targets", [])
    ]
    axes[-1].text(0, 1, "Targets\n\n" + "\n".join(lines), va="top", fontsize=6, family="monospace")
    fig.suptitle(f"dramatiq-pg-broker benchmarks, {data['date']} ({data['command']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, groups, metrics) -> None:
    width = 0.8 / max(1, len(metrics))
    for i, metric in enumerate(metrics):
        xs, ys, lo, hi = [], [], [], []
        for x, (_, figs) in enumerate(groups):
            f = figs[i] if i < len(figs) else None
            if f is None:
                continue
            xs.append(x + i * width)
            ys.append(f["median"])
            lo.append(f["median"] - f["min"])
            hi.append(f["max"] - f["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=metric if len(metrics) > 1 else None)
    ax.set_xticks([x + width * (len(metrics) - 1) / 2 for x in range(len(groups))])
    crowded = len(groups) > 6
    ax.set_xticklabels([name.replace("\n", " ") if crowded else name for name, _ in groups],
                       fontsize=6 if crowded else 7, rotation=35 if crowded else 0,
                       ha="right" if crowded else "center")  # fmt: skip
    if len(metrics) > 1:
        ax.legend(fontsize=7)
