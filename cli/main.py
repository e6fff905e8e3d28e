"""The `gpuq` command: users' commands (submit, status, explain, queues, report), operators' (up, demo),
and the benchmarks and the simulator."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="gpuq",
    help="gpuq: GPU training-job scheduling for shared clusters. Run `gpuq COMMAND --help` for details.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures (placement, admission, metering, ...).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Each area registers its commands below, one line each (keep the list sorted by area).
from services.admission.bench import bench_admission; bench_app.command("admission")(bench_admission)  # noqa: E402, E702, I001
from services.admission.bench_e2e import bench_admission_e2e; bench_app.command("admission-e2e")(bench_admission_e2e)  # noqa: E402, E702, I001
from services.metering.bench import bench_metering; bench_app.command("metering")(bench_metering)  # noqa: E402, E702, I001
from services.metering.report import report; app.command("report")(report)  # noqa: E402, E702, I001
from services.scheduler.bench import bench_placement; bench_app.command("placement")(bench_placement)  # noqa: E402, E702, I001
from services.preemption.cli import preemptible; app.command("preemptible")(preemptible)  # noqa: E402, E702, I001
from sim.cli import simulate; app.command("simulate")(simulate)  # noqa: E402, E702, I001
from services.telemetry.cli import webhooks_app; app.add_typer(webhooks_app, name="webhooks")  # noqa: E402, E702, I001
from services.telemetry.bench import bench_telemetry; bench_app.command("telemetry")(bench_telemetry)  # noqa: E402, E702, I001
from cli.jobs import apply_queues, cancel, explain, queues, status, submit  # noqa: E402
from cli.platform import demo, up  # noqa: E402

app.command("submit")(submit)
app.command("status")(status)
app.command("explain")(explain)
app.command("queues")(queues)
app.command("cancel")(cancel)
app.command("up")(up)
app.command("demo")(demo)
app.command("apply-queues")(apply_queues)
