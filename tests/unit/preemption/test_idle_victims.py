"""Idle reclaim's victims (services/core/preemption/idle.py): the named idle job, unless it is production, not
preemptible, already being preempted or no longer running; never another running job."""

from __future__ import annotations

from services.core.preemption import Why
from services.core.preemption.idle import idle_victims
from tests.unit.preemption.test_drain import running


def test_only_the_named_preemptible_running_job_is_taken() -> None:
    jobs = [running("nb"), running("other"), running("prod", production=True), running("pinned", preemptible=False),
            running("busy")]
    assert idle_victims(["nb"], jobs) == (("nb",), {})
    victims, kept = idle_victims(["prod", "pinned", "busy", "gone", "nb"], jobs, busy={"busy"})
    assert victims == ("nb",)
    assert kept == {"prod": Why.PRODUCTION, "pinned": Why.NOT_PREEMPTIBLE, "busy": Why.BEING_PREEMPTED,
                    "gone": "not running"}
