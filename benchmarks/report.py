"""Turning a run's JSON into the terminal table, the Markdown table and the PNG chart."""

from __future__ import annotations

from pathlib import Path

# (target id, description, numerator, denominator, comparison, bound)
# A figure is (workload, broker, metric); ratios are taken between medians.
TARGETS = (
    ("drain-vs-rabbitmq", "drain ≥ 2 × RabbitMQ (events on)",
     ("drain", "postgres", "rate"), ("drain", "rabbitmq", "rate"), ">=", 2.0),
    ("drain-vs-redis", "drain ≥ 2.5 × Redis (events on)",
     ("drain", "postgres", "rate"), ("drain", "redis", "rate"), ">=", 2.5),
    ("enqueue-vs-raw", "enqueue ≥ 0.9 × raw INSERT+COMMIT (created event included)",
     ("enqueue", "postgres", "rate"), ("enqueue", "raw-insert", "rate"), ">=", 0.9),
    ("bulk-vs-copy", "bulk enqueue ≥ 0.4 × raw COPY into a plain table (events on)",
     ("bulk", "postgres", "rate"), ("bulk", "raw-copy", "rate"), ">=", 0.4),
    ("latency-p50-vs-rabbitmq", "latency p50 ≤ 1.5 × RabbitMQ's",
     ("latency", "postgres", "p50_ms"), ("latency", "rabbitmq", "p50_ms"), "<=", 1.5),
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
    ("delayed-memory", "worker memory with delayed messages ≤ 1.1 × idle",
     ("memory", "postgres", "delayed_mb"), ("memory", "postgres", "idle_mb"), "<=", 1.1),
)  # fmt: skip

LABELS = {
    "raw-insert": "raw INSERT+COMMIT",
    "raw-insert-autocommit": "raw INSERT, autocommit",
    "raw-copy": "raw COPY, plain table",
    "postgres": "postgres (this broker)",
    "postgres-noevents": "postgres, events off",
    "redis": "redis (dramatiq)",
    "rabbitmq": "rabbitmq (dramatiq)",
}


def _chart_label(name: str) -> str:
    """A label short enough for a bar: one phrase a line."""
    label = LABELS.get(name, name)
    if label.startswith("raw "):
        return label.replace(" ", "\n").replace("+", "\n+")
    return label.replace(" (", "\n(").replace(", ", ",\n")


# (title, workload, metric, unit, higher is better)
ROWS = (
    ("enqueue", "enqueue", "rate", "msg/s", True),
    ("bulk enqueue", "bulk", "rate", "msg/s", True),
    ("drain", "drain", "rate", "msg/s", True),
    ("latency p50", "latency", "p50_ms", "ms", False),
    ("latency p99", "latency", "p99_ms", "ms", False),
    ("backlog drain", "backlog", "rate", "msg/s", True),
    ("drain, finished backlog", "retention", "baseline_rate", "msg/s", True),
    ("drain, retention deleting it", "retention", "rate", "msg/s", True),
    ("retention delete rate", "retention", "delete_rate", "jobs/s", True),
    ("job tables, churn 1/4 time", "churn", "q1_mb", "MiB", False),
    ("job tables, churn half time", "churn", "mid_mb", "MiB", False),
    ("job tables, churn 3/4 time", "churn", "q3_mb", "MiB", False),
    ("job tables, churn end", "churn", "end_mb", "MiB", False),
    ("worker RSS, idle", "memory", "idle_mb", "MiB", False),
    ("worker RSS, delayed msgs", "memory", "delayed_mb", "MiB", False),
)


def _fig(data: dict, workload: str, broker: str, metric: str) -> dict | None:
    return data.get("results", {}).get(workload, {}).get(broker, {}).get(metric)


def targets(data: dict) -> list[dict]:
    out = []
    for tid, text, num, den, op, bound in TARGETS:
        a, b = _fig(data, *num), _fig(data, *den)
        if a is None or b is None or not b["median"]:
            out.append({"id": tid, "target": text, "ratio": None, "status": "not measured"})
            continue
        ratio = a["median"] / b["median"]
        met = {">=": ratio >= bound, "<=": ratio <= bound, "<": ratio < bound}[op]
        out.append(
            {
                "id": tid,
                "target": text,
                "ratio": ratio,
                "required": f"{op} {bound:g}",
                "status": "met" if met else "missed",
            }
        )
    return out


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _rows(data: dict) -> list[list[str]]:
    rows = []
    results = data.get("results", {})
    brokers = ["raw-insert", "raw-insert-autocommit", "raw-copy", *data.get("brokers", {})]
    for title, workload, metric, unit, _ in ROWS:
        for broker in brokers:
            if broker in data.get("skipped", {}) and workload in results:
                if broker in {"redis", "rabbitmq"} and not (
                    workload in ("backlog", "retention", "churn")
                    or (workload == "memory" and "noevents" in broker)
                ):
                    rows.append([title, LABELS.get(broker, broker), "skipped: not reachable",
                                 "", "", ""])  # fmt: skip
                continue
            fig = _fig(data, workload, broker, metric)
            err = data.get("errors", {}).get(workload, {}).get(broker)
            if fig is None:
                if err:
                    rows.append([title, LABELS.get(broker, broker), f"failed: {err[:60]}",
                                 "", "", ""])  # fmt: skip
                continue
            n = len(fig["samples"])
            spread = f"{_num(fig['min'])}–{_num(fig['max'])} (n={n})"
            ratios = []
            for other in ("redis", "rabbitmq"):
                ref = _fig(data, workload, other, metric)
                if broker.startswith("postgres") and ref and ref["median"]:
                    ratios.append(f"{fig['median'] / ref['median']:.2f}×")
                else:
                    ratios.append("")
            rows.append([title, LABELS.get(broker, broker), f"{_num(fig['median'])} {unit}",
                         spread, *ratios])  # fmt: skip
    return rows


HEADER = ["workload", "broker", "median", "spread (min–max)", "vs redis", "vs rabbitmq"]


def _target_rows(data: dict) -> list[list[str]]:
    rows = []
    for t in data.get("targets", []):
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.2f}"
        rows.append([t["target"], ratio, t.get("required", ""), t["status"]])
    return rows


def _extra_lines(data: dict) -> list[str]:
    lines = []
    enq = data.get("results", {}).get("enqueue", {})
    for base in ("raw-insert", "raw-insert-autocommit"):
        raw = enq.get(base, {}).get("rate")
        if not raw:
            continue
        for b in ("postgres", "postgres-noevents"):
            fig = enq.get(b, {}).get("rate")
            if fig:
                lines.append(
                    f"enqueue, {LABELS[b]}: {fig['median'] / raw['median']:.2f} × the "
                    f"{LABELS[base]} rate"
                )
    drain = data.get("results", {}).get("drain", {})
    on, off = drain.get("postgres", {}).get("rate"), drain.get("postgres-noevents", {}).get("rate")
    if on and off:
        lines.append(
            f"drain, events on / events off: {on['median'] / off['median']:.2f} "
            "(what the audit trail costs)"
        )
    mem = data.get("results", {}).get("memory", {})
    for b, figs in mem.items():
        if "idle_mb" in figs and "delayed_mb" in figs:
            growth = figs["delayed_mb"]["median"] / figs["idle_mb"]["median"] - 1
            lines.append(
                f"memory, {LABELS.get(b, b)}: {growth * 100:+.0f} % with "
                f"{data['config']['delayed']:,} delayed messages"
            )
    return lines


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


TARGET_HEADER = ["target", "measured ratio", "required", "status"]


def terminal(data: dict) -> str:
    parts = [_table(HEADER, _rows(data)), "", *_extra_lines(data), ""]
    parts.append(_table(TARGET_HEADER, _target_rows(data)))
    return "\n".join(parts)


def markdown(data: dict) -> str:
    m = data["machine"]
    cfg = data["config"]
    lines = [
        "# Benchmark results",
        "",
        f"- date: {data['date']}",
        f"- machine: {m['cores']} CPU cores, {m['platform']}, Python {m['python']}, "
        f"PostgreSQL {m['postgresql']}",
        f"- command: `{data['command']}` ({data['elapsed_s'] / 60:.1f} min)",
        f"- repetitions: {cfg['repeat']}; median and spread (min–max) over them; ratios are "
        "between medians",
        f"- workloads: enqueue {cfg['enqueue']:,} sends from one thread; drain "
        f"{cfg['drain']:,} queued messages by one worker process with 8 threads; latency "
        f"{cfg['latency']:,} sends {cfg['latency_gap'] * 1000:g} ms apart to an idle worker "
        f"(send() to actor start); backlog: the drain with {cfg['backlog_finished']:,} "
        f"finished and {cfg['backlog_queued']:,} queued rows in the table; memory: worker "
        f"RSS {cfg['settle']:g} s after boot, idle and with {cfg['delayed']:,} messages "
        "delayed by an hour"
        + (
            f"; retention: the drain with {cfg['retention_finished']:,} finished jobs past "
            "their retention age in the table, without and then with retention deleting them; "
            f"churn: {cfg['churn_seconds']:,} s of {cfg['churn_rate']:,} jobs/s with retention "
            "every 5 s keeping succeeded jobs 30 s, job tables' size at half time and at the end"
            if "retention_finished" in cfg
            else ""
        ),
        "",
        _md_table(HEADER, _rows(data)),
        "",
        *[f"- {line}" for line in _extra_lines(data)],
        "",
        "## Targets",
        "",
        _md_table(TARGET_HEADER, _target_rows(data)),
        "",
    ]
    return "\n".join(lines)


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("enqueue (msg/s)", "enqueue", ["rate"]),
        ("drain (msg/s)", "drain", ["rate"]),
        ("latency (ms)", "latency", ["p50_ms", "p99_ms"]),
        ("drain, empty vs backlog table (msg/s)", None, None),
        ("worker RSS (MiB)", "memory", ["idle_mb", "delayed_mb"]),
    ]
    fig, grid = plt.subplots(2, 3, figsize=(15, 9))
    axes = list(grid.flat)
    for ax, (title, workload, metrics) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        if workload == "latency":
            ax.set_yscale("log")
        if workload is None:
            bars = [
                ("empty", _fig(data, "drain", "postgres", "rate")),
                ("backlog", _fig(data, "backlog", "postgres", "rate")),
            ]
            _bars(ax, [(n, [f]) for n, f in bars if f is not None], [""])
            continue
        per = data.get("results", {}).get(workload, {})
        groups = [
            (_chart_label(b), [per[b].get(m) for m in metrics])
            for b in ["raw-insert", "raw-insert-autocommit", *data.get("brokers", {})]
            if b in per
        ]
        _bars(ax, groups, metrics)
    axes[-1].axis("off")
    lines = [
        f"{t['status']:>12}  {t['target']}" + ("" if t["ratio"] is None else f": {t['ratio']:.2f}")
        for t in data.get("targets", [])
    ]
    axes[-1].text(0, 1, "Targets\n\n" + "\n".join(lines), va="top", fontsize=8, family="monospace")
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
    ax.set_xticklabels([name for name, _ in groups], fontsize=7)
    if len(metrics) > 1:
        ax.legend(fontsize=7)
