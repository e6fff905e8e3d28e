"""The three replays of an ETA refresh (median, p10, p90) share their first instant (issue 49 item 5): it is
decided once and the p10 / p90 replays start from forks of it (`_StartsReplay.fork`), with the ends their own
predictions give. Every ETA equals the one the three replays from scratch give, to the last bit, with and without
a budget. (When a replay's share of the budget would have stopped its first instant elsewhere, it runs from
scratch: `shares_first_instant`.)"""

from __future__ import annotations

from typing import Any

import pytest

import services.core.eta.eta as eta_core
from gpuq_tools.bench.eta import build_platform
from services.core.eta import EtaRange
from services.eta.platform import PlatformEta


def _refresh(platform: tuple[Any, ...], budget: int | None) -> dict[str, EtaRange]:
    cluster, adm, reserved, model, now = platform
    return PlatformEta(model=model, budget=budget)(cluster, adm, reserved, now)


@pytest.mark.parametrize(("nodes", "waiting", "seed", "budget"),
                         [(16, 400, 2, None), (16, 400, 2, 6000), (16, 400, 2, 3000), (8, 200, 1, None),
                          (16, 300, 3, 6000)])
def test_a_refresh_sharing_its_first_instant_equals_three_replays_from_scratch(
        monkeypatch: pytest.MonkeyPatch, nodes: int, waiting: int, seed: int, budget: int | None) -> None:
    """A full cluster of jobs started within the hour (inside their protection windows) and a deep queue with
    higher priorities: the first instant preempts over several rounds. The ETAs (start, range, replayed range)
    with the first instant shared equal those of three replays from scratch (`shares_first_instant` forced
    off). Fails with a fork that gives the jobs the first instant started the median's run times, or that shares
    the median's preemption memory instead of copying it."""
    platform = build_platform(nodes, 4, waiting, 300, seed)
    forks: list[bool] = []
    shares = eta_core._StartsReplay.shares_first_instant

    def counted(self: Any, share: int | None) -> bool:
        forks.append(shares(self, share))
        return forks[-1]

    monkeypatch.setattr(eta_core._StartsReplay, "shares_first_instant", counted)
    shared = _refresh(platform, budget)
    monkeypatch.setattr(eta_core._StartsReplay, "shares_first_instant", lambda self, share: False)
    alone = _refresh(platform, budget)
    assert len(shared) > waiting // 2
    assert shared == alone
    assert forks == [True, True]  # (the forks were used)


def test_the_first_instant_preempts_in_rounds_and_runs_once() -> None:
    """The scenario above exercises what the fork rebuilds: the first instant preempts (its log holds stops)
    and its decisions run once, not three times."""
    cluster, adm, reserved, model, now = build_platform(16, 4, 400, 300, 2)
    settles: list[float] = []
    logs: list[list[tuple[str, Any]]] = []
    settle, fork = eta_core._StartsReplay.settle, eta_core._StartsReplay.fork

    def counting(self: Any, t: float) -> None:
        settles.append(t)
        settle(self, t)

    def logging(self: Any, *args: Any) -> Any:
        logs.append(list(self.log))
        return fork(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eta_core._StartsReplay, "settle", counting)
        mp.setattr(eta_core._StartsReplay, "fork", logging)
        PlatformEta(model=model, budget=None)(cluster, adm, reserved, now)
    assert settles.count(now) == 1
    assert any(spec is None for _job, spec in logs[0]) and any(spec is not None for _job, spec in logs[0])
