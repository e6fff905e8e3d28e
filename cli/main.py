"""The `gpuq` command: users' commands (submit, status, explain, queues, report), operators' (up, demo),
and the benchmarks and the simulator.

Each area's commands live in that area's module; this module only names them. To add one, import it below
and register it in the list for its group (keep both sorted by area).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from cli.admin import audit, nats_auth, retention, tokens_app
from cli.jobs import apply_queues, approve, cancel, explain, queues, status, submit
from cli.platform import demo, up
from cli.remote import report, webhooks_app
from cli.restore import reconcile_bus
from cli.smoke import smoke
from services.admission.bench import bench_admission
from services.admission.bench_e2e import bench_admission_e2e
from services.bench_e2e import bench_e2e
from services.bench_jobpath import bench_jobpath
from services.chaos.cli import chaos
from services.executor.bench import bench_dcgm
from services.metering.bench import bench_metering
from services.preemption.cli import preemptible
from services.runtime_bench import bench_runtime
from services.scheduler.bench import bench_placement
from services.telemetry.bench import bench_telemetry
from sim.cli import simulate

app = typer.Typer(
    name="gpuq",
    help="gpuq: GPU training-job scheduling for shared clusters. Run `gpuq COMMAND --help` for details.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures (placement, admission, metering, ...).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(tokens_app, name="tokens")

COMMANDS: dict[str, Callable[..., Any]] = {
    "submit": submit,
    "status": status,
    "explain": explain,
    "queues": queues,
    "cancel": cancel,
    "approve": approve,
    "audit": audit,
    "nats-auth": nats_auth,
    "retention": retention,
    "reconcile-bus": reconcile_bus,  # after a restore: the bus brought in line with the restored database
    "apply-queues": apply_queues,
    "smoke": smoke,  # a first job through the API, then cleaned up (helm test)
    "up": up,
    "demo": demo,
    "report": report,  # metering
    "preemptible": preemptible,  # preemption
    "simulate": simulate,  # sim
    "chaos": chaos,  # faults: services/chaos
}
BENCHMARKS: dict[str, Callable[..., Any]] = {
    "admission": bench_admission,
    "admission-e2e": bench_admission_e2e,
    "e2e": bench_e2e,
    "jobpath": bench_jobpath,  # scheduler and executor handlers
    "dcgm": bench_dcgm,  # executor
    "metering": bench_metering,
    "placement": bench_placement,
    "runtime": bench_runtime,  # shared runtime, per message
    "telemetry": bench_telemetry,
}

for _name, _command in COMMANDS.items():
    app.command(_name)(_command)
for _name, _command in BENCHMARKS.items():
    bench_app.command(_name)(_command)
