"""The `gpuq` command: users' commands (submit, status, explain, queues, report), operators' (up, demo),
and the benchmarks and the simulator.

Each area's commands live in that area's module; this module only names them, with the summary `gpuq --help` lists
(the start of the command's docstring), and imports none of them: a command's module is imported when it runs
(cli/lazy.py), so that every command starts in a fraction of a second. To add one, add it to the table of its group
(keep it sorted by area); tests/unit/cli/test_lazy_commands.py checks each entry against its command.
"""

from __future__ import annotations

import os

# Help and usage errors in click's plain format: typer's rich formatting costs ~60 ms per command (rich, markdown),
# a fifth of the 0.3 s a command may take to start (`gpuq bench cli`). TYPER_USE_RICH=1 brings it back.
os.environ.setdefault("TYPER_USE_RICH", "0")

import typer  # (after the setting above, which typer reads when imported)

from cli.lazy import GpuqGroup, Lazy, LazyGroup

JOBS, ADMIN, OPERATE = "Jobs", "Platform admins", "Operators"


class Commands(GpuqGroup):
    LAZY = {
        "submit": Lazy("cli.jobs:submit", "Submit jobs by publishing JobSubmitted events", JOBS),
        "status": Lazy("cli.jobs:status", "Where jobs are: pending, admitted, running, completed, failed, rejected",
                       JOBS),
        "explain": Lazy("cli.jobs:explain", "Why a job waits, where it stands, and when it is expected to start",
                        JOBS),
        "queues": Lazy("cli.jobs:queues", "Per queue: nominal, used, borrowed, lent, pending, running, oldest wait",
                       JOBS),
        "cancel": Lazy("cli.jobs:cancel", "Cancel a job of your team (any job: admins).", JOBS),
        "approve": Lazy("cli.jobs:approve", "Approve a job of a priority class that needs a platform admin's "
                                            "approval", JOBS),
        "report": Lazy("cli.remote:report", "GPU usage and cost: allocated, used, idle and lost GPU-hours, energy "
                                            "and cost", JOBS),  # metering
        "budget": Lazy("cli.budget:budget", "GPU-hour budgets: use in the current month or quarter, the forecast to "
                                            "its end, and what happens at 100%", JOBS),  # metering's read model
        "webhooks": Lazy("cli.remote:webhooks_app", "Webhook subscriptions: signed CloudEvents POSTed to your URL "
                                                    "when your jobs change state.", JOBS),  # telemetry
        "audit": Lazy("cli.admin:audit", "Who did what: submits, cancels, admissions, placements, preemptions", ADMIN),
        "tokens": Lazy("cli.admin:tokens_app", "API bearer tokens (admins, with DATABASE_URL): create, list, revoke.",
                       ADMIN),
        "nats-auth": Lazy("cli.admin:nats_auth", "Write the bus users' configuration", ADMIN),
        "retention": Lazy("cli.admin:retention", "Prune now what the metering and audit services prune every hour",
                          ADMIN),
        "apply-queues": Lazy("cli.jobs:apply_queues", "Change teams, quotas and policy at runtime", ADMIN),
        "dead-letters": Lazy("cli.deadletters:dead_letters", "Recent dead letters with their reasons", ADMIN),
        "export-trace": Lazy("cli.export_trace:export_trace", "Write the platform's own finished jobs as a "
                                                              "simulator trace", ADMIN),  # what-if
        "preemptible": Lazy("services.preemption.cli:preemptible", "List the running jobs that could be preempted "
                                                                   "now", ADMIN),  # preemption
        # after a restore: the bus brought in line with the restored database
        "reconcile-bus": Lazy("cli.restore:reconcile_bus", "After restoring gpuq's database from a backup, with the "
                                                           "services stopped: bring the bus in line with it.", ADMIN),
        "up": Lazy("cli.platform:up", "Run the services until interrupted.", OPERATE),
        "demo": Lazy("cli.platform:demo", "Start everything on embedded servers (or NATS_URL/DATABASE_URL), replay "
                                          "a synthetic Philly-shaped workload", OPERATE),
        "smoke": Lazy("cli.smoke:smoke", "Submit a 1-GPU job through the API with a token made for it",
                      OPERATE),  # helm test
        "chaos": Lazy("gpuq_tools.chaos.cli:chaos", "Soak the platform under faults", OPERATE),  # gpuq_tools/chaos
        "simulate": Lazy("sim.cli:simulate", "Replay a GPU job trace through the same cores as production and "
                                             "compare policies.", OPERATE),  # sim
    }


    # These start or simulate a platform of their own: a running platform's servers are not theirs to use.
    OWN_SERVERS = frozenset({"up", "demo", "chaos", "simulate", "bench"})

    def prepare(self, name: str) -> None:
        if name in self.OWN_SERVERS:
            return
        from cli.runtime import ConfigFileError, export_settings

        try:
            export_settings()  # options read NATS_URL, DATABASE_URL, ... from the environment while parsing
        except ConfigFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="GPUQ_CONFIG") from None


class Benchmarks(LazyGroup):
    # The benchmarks are the tools package's (gpuq_tools/bench), which the service image leaves out.
    LAZY = {
        "admission": Lazy("gpuq_tools.bench.admission:bench_admission",
                          "Admissions per second of the admission core"),
        "admission-e2e": Lazy("gpuq_tools.bench.admission_e2e:bench_admission_e2e",
                              "Admissions per second of the admission service with its database"),
        "cli": Lazy("cli.bench:bench_cli", "Start-up time of gpuq commands"),
        "e2e": Lazy("gpuq_tools.bench.e2e:bench_e2e", "The running platform end to end"),
        "eta": Lazy("gpuq_tools.bench.eta:bench_eta", "Wall time of one ETA refresh with a deep queue"),  # eta
        # scheduler and executor handlers
        "jobpath": Lazy("gpuq_tools.bench.jobpath:bench_jobpath", "CPU per placed job of the scheduler's and the "
                                                                  "simulated executor's handlers"),
        "dcgm": Lazy("gpuq_tools.bench.dcgm:bench_dcgm", "Time the DCGM source's work per poll"),  # executor
        "metering": Lazy("gpuq_tools.bench.metering:bench_metering",
                         "Sustained GPU samples/s into the metering ledger"),
        "placement": Lazy("gpuq_tools.bench.placement:bench_placement", "Placement-core throughput"),  # scheduler
        # shared runtime, per message
        "runtime": Lazy("gpuq_tools.bench.runtime:bench_runtime", "CPU microseconds per step of the runtime's "
                                                                  "per-message path"),
        "telemetry": Lazy("gpuq_tools.bench.telemetry:bench_telemetry", "Fold a synthetic event stream into the "
                                                                        "telemetry core"),
    }


app = typer.Typer(
    name="gpuq",
    cls=Commands,
    help="gpuq: GPU training-job scheduling for shared clusters. Run `gpuq COMMAND --help` for details.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(cls=Benchmarks, help="Benchmarks that print figures (placement, admission, metering, cli, "
                                             "...).", no_args_is_help=True)
app.add_typer(bench_app, name="bench", rich_help_panel=OPERATE)


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="On an error, show the traceback (also GPUQ_DEBUG=1) instead "
                                                      "of one line"),
) -> None:
    """(--debug is taken out of the arguments before they are parsed: cli/lazy.py)"""
