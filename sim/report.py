"""`--report DIR`: a markdown summary and PNG plots (matplotlib, Agg backend).

Plots: GPU allocation over time per policy (hourly averages), the wait-time CDF per policy (log x), and
per-team usage share against quota share.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt
import numpy as np

from sim.run import PolicyRun, trace_summary

HEADLINE = ("jobs", "completed", "avg_jct_s", "p50_wait_s", "p99_wait_s", "gpu_utilization",
            "busy_gpu_utilization", "idle_partial_gang_gpu_hours", "jain_fairness", "themis_rho_worst",
            "themis_share_rho_above_1", "fragmentation_avg_gpus", "preemptions", "sim_wall_s")


def _hourly_util(run: PolicyRun, bucket_s: float) -> tuple[np.ndarray, np.ndarray]:
    res = run.result
    cap = res.trace.capacity_gpus * 1000 or 1
    end = res.end_time
    n = max(1, int(np.ceil(end / bucket_s)))
    acc = np.zeros(n)
    s = res.samples
    for a, b in itertools.pairwise(s):
        t, t_end = a.t, b.t
        while t < t_end:  # spread the step over the buckets it covers
            i = min(int(t // bucket_s), n - 1)
            upto = min(t_end, (i + 1) * bucket_s)
            acc[i] += a.allocated_milli * (upto - t)
            t = upto
    return np.arange(n) * bucket_s / 86_400, acc / (cap * bucket_s)


def _plot_utilisation(runs: Sequence[PolicyRun], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    span = max(r.result.end_time for r in runs)
    bucket = 3_600.0 if span < 40 * 86_400 else 6 * 3_600.0
    for r in runs:
        x, y = _hourly_util(r, bucket)
        ax.plot(x, y * 100, label=r.metrics["policy"], linewidth=1.1, alpha=0.85)
    last_submit = runs[0].metrics["replay_window_s"] / 86_400
    ax.axvline(last_submit, color="grey", linestyle="--", linewidth=0.8)
    ax.text(last_submit, 102, " last arrival", fontsize=8, color="grey", va="bottom")
    ax.set_ylim(0, 110)
    ax.set_xlabel("virtual time (days)")
    ax.set_ylabel(f"GPUs allocated (% of capacity, {bucket / 3600:.0f}-hour mean)")
    ax.set_title("Allocation over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_wait_cdf(runs: Sequence[PolicyRun], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        recs = r.result.records.values()
        end = r.result.end_time
        w = np.sort([(x.start if x.start is not None else end) - x.job.submit_time
                     for x in recs if x.rejected is None])
        if not len(w):
            continue
        y = np.arange(1, len(w) + 1) / len(w)
        ax.step(np.maximum(w, 1.0), y * 100, where="post", label=r.metrics["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("wait before start (s, log scale; 0 s drawn at 1 s)")
    ax.set_ylabel("jobs (%)")
    ax.set_title("Wait-time CDF")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_shares(runs: Sequence[PolicyRun], out: Path) -> None:
    teams = sorted(runs[0].metrics["per_team"])
    x = np.arange(len(teams))
    width = 0.8 / (len(runs) + 1)
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(teams) + 3), 4.5))
    quota = [runs[0].metrics["per_team"][t]["quota_share"] * 100 for t in teams]
    ax.bar(x - 0.4 + width / 2, quota, width, label="quota share", color="lightgrey", edgecolor="grey")
    top = max(quota, default=0.0)
    for i, r in enumerate(runs, start=1):
        usage = [r.metrics["per_team"][t]["usage_share"] * 100 for t in teams]
        top = max(top, *usage) if usage else top
        ax.bar(x - 0.4 + width / 2 + i * width, usage, width, label=f"usage: {r.metrics['policy']}")
    ax.set_ylim(0, max(1.0, top) * 1.22)  # headroom so the legend never hides a bar
    ax.set_xticks(x, teams, rotation=30, ha="right")
    ax.set_ylabel("% of GPU-hours / of quota")
    ax.set_title("Per-team usage share (inside the replay window) vs quota share")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper center", ncol=len(runs) + 1, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def _lost_work_lines(runs: Sequence[PolicyRun]) -> list[str]:
    """Work lost per cause (GPU-hours), and all of it as a share of the delivered GPU-hours."""
    causes = sorted({c for r in runs for c in r.metrics.get("lost_gpu_hours_by_cause", {})})
    lines = ["", "## Work lost per cause (GPU-hours)", "",
             "| cause | " + " | ".join(r.metrics["policy"] for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for c in causes:
        lines.append(f"| {c} | " + " | ".join(_fmt(r.metrics["lost_gpu_hours_by_cause"].get(c, 0.0)) for r in runs)
                     + " |")
    lines.append("| share of delivered | " + " | ".join(f"{100 * r.metrics.get('lost_work_share', 0.0):.3f}%"
                                                       for r in runs) + " |")
    return lines


def write_report(runs: Sequence[PolicyRun], out_dir: Path, command: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "utilisation.png", out_dir / "wait_cdf.png", out_dir / "team_shares.png"]
    _plot_utilisation(runs, files[0])
    _plot_wait_cdf(runs, files[1])
    _plot_shares(runs, files[2])
    trace = runs[0].result.trace
    info = trace_summary(trace)
    lines = [f"# Simulation report: {trace.name}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["## Trace", "", *[f"- {k}: {v}" for k, v in info.items()], "", "## Results", ""]
    lines.append("| metric | " + " | ".join(r.metrics["policy"] for r in runs) + " |")
    lines.append("|---|" + "---:|" * len(runs))
    for key in HEADLINE:
        lines.append(f"| {key} | " + " | ".join(_fmt(r.metrics.get(key)) for r in runs) + " |")
    lines += ["", "## Per priority class (avg / p99 wait, s)", ""]
    classes = sorted({c for r in runs for c in r.metrics["per_priority_class"]})
    lines.append("| class | " + " | ".join(r.metrics["policy"] for r in runs) + " |")
    lines.append("|---|" + "---:|" * len(runs))
    for c in classes:
        cells = []
        for r in runs:
            m = r.metrics["per_priority_class"].get(c)
            cells.append(f"{_fmt(m['avg_wait_s'])} / {_fmt(m['p99_wait_s'])}" if m else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += _lost_work_lines(runs)
    lines += ["", "## Plots", "", *[f"![{f.stem}]({f.name})" for f in files], ""]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines))
    return [md, *files]
