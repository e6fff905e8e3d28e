"""Predicted run times: how long a job will take, from its limit and the history of similar jobs.

Users' limits (`max_runtime_s`) are typically several times the true duration, so a forecast built on limits
(ETAs, duration-aware ordering) is late by that factor. This core learns, from jobs that finished, the ratio
`duration / limit` of similar jobs and predicts `limit × ratio`:

- "similar" is the most specific of (team, user, job-name stem), (team, user), (team), everyone that has at least
  `min_samples` finished jobs in its window (the last `window` of them); with no history at all the prediction is
  the limit itself (the only thing known);
- the spread of the ratios of that group is the spread of the prediction's errors: p10 and p90 of
  `limit × ratio` are the range;
- a running job's remaining time conditions on what is known: it has already run `elapsed_s` (durations shorter
  than that are ruled out) and, if it reports checkpoint progress, `elapsed / progress` is its total;
- the predictor records each prediction it would have made against the actual duration when a job ends
  (`BiasRecord`) and multiplies its predictions by the median error: a systematic bias (a group whose jobs got
  longer, a level fallback that is off) is corrected from the record;
- a running job whose start is known (`remaining(..., started_at=)`) also listens to its cohort: the jobs of
  its group that started near it and have since ended (`CohortEvidence`, a Bayesian mixture: each such job a
  component weighted by start proximity, the group's window the prior; conditioning on the elapsed time
  reweights them), and those still running (`running_now`): how long they have run so far says how much of
  the cohort outlasts that (censored durations), and their limits are independent guesses at the durations of
  alike jobs, so together they place the prior (`pooled_prior`, a random-effects model) better than the job's
  own limit alone, the more so the less they scatter. Each side keeps its COHORT_MAX nearest and, when cut, is
  reweighted to stand for all of its kind within reach (`balance_truncated`). With no such job it is the
  prediction above, unchanged.

Pure: no I/O and no clock; all times are seconds handed in. It never sees a job's true duration except through
`observe`, which callers invoke only when the job has ended. Deterministic: same observations in the same order,
same predictions.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from shared.domain import JobSpec

# Window and thresholds are statistical choices, not fitted to any trace: a window long enough for stable
# p10/p90 (the 10% tail of 200 is 20 points) and short enough to follow drift.
DEFAULT_WINDOW = 200
DEFAULT_MIN_SAMPLES = 5
LOW_Q, HIGH_Q = 0.1, 0.9
MIN_REMAINING_S = 60.0  # a job past everything history allows is assumed to end this soon
# Cohort evidence (CohortEvidence): an ended job of the group counts with weight exp(-|start gap| / elapsed),
# dropped below this weight (a numerical cut: jobs that far apart add under 1% each).
COHORT_MIN_WEIGHT = 0.01
# At most this many ended jobs and this many running peers per prediction, the nearest by start (the heaviest
# weights): the peers' responsibilities cost their product, and the rest weigh less than the nearest ones (each
# side then stands for the rest of its kind: `balance_truncated`).
COHORT_MAX = 32
# The narrowest spread a cohort's durations are given (log scale, ±5%): alike jobs' run times still differ by
# their start-up and checkpoint writes; numerical floor, so that a kernel never degenerates to a point.
COHORT_MIN_BANDWIDTH = 0.05
# The cohort mixture's quantiles are found by bisection down to this bracket (seconds of run time): far below
# what any end time is known to, so a quantile costs ~20 evaluations of the mixture instead of a fixed 36.
BISECT_TOLERANCE_S = 0.5
_STD_NORMAL = NormalDist()
_STEM_TAIL = re.compile(r"([-_.:]?([0-9]+|[0-9a-f]{6,}))+$")


def name_stem(job_id: str) -> str:
    """The job-name stem: the id without its trailing counters or hashes ("bert-ft-0042" -> "bert-ft",
    "sweep_lr.3" -> "sweep_lr"). An id that is all counter keeps itself."""
    stem = _STEM_TAIL.sub("", job_id)
    return stem or job_id


@dataclass(frozen=True, order=True)
class JobKey:
    """What makes jobs similar: the team, the user (None when unknown) and the job-name stem."""

    team: str
    user: str | None
    stem: str

    @classmethod
    def of(cls, spec: JobSpec) -> JobKey:
        stem = spec.labels.get("gpuq.io/name") or name_stem(spec.job_id)
        return cls(team=spec.team, user=spec.user, stem=stem)

    def levels(self) -> tuple[tuple[str, ...], ...]:
        """History groups, most specific first (the last is everyone)."""
        user = self.user or ""
        return (("s", self.team, user, self.stem), ("u", self.team, user), ("t", self.team), ("*",))


@dataclass(frozen=True)
class Prediction:
    """A predicted duration (or remaining time) in seconds: the median and the p10-p90 range."""

    median_s: float
    low_s: float
    high_s: float
    samples: int  # finished jobs the prediction rests on (0: the limit alone)
    basis: str  # which history group: "team/user/name", "team/user", "team", "all" or "limit"


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty sequence."""
    if not sorted_values:
        raise ValueError("quantile of an empty sequence")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return _between(sorted_values[lo], sorted_values[hi], pos - lo)


def _between(a: float, b: float, frac: float) -> float:
    """a + (b - a)·frac for a <= b, never outside [a, b]: `a·(1 − frac) + b·frac` can land an ulp above b
    (a p10 above its median when the two fall between equal values), this form is monotone in frac."""
    return min(b, max(a, a + (b - a) * frac))


class BiasRecord:
    """A record of (predicted, actual) pairs per key, and the correction it implies.

    Errors are kept as log(actual / predicted) (late positive), the last `window` per key. `factor(key)` is
    exp(median error) once `min_samples` pairs exist (1.0 before): multiply a prediction by it to remove the
    bias seen so far. `spread(key)` gives the error quantiles, for an interval whose coverage follows the record.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, min_samples: int = DEFAULT_MIN_SAMPLES):
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be at least 1")
        self.window = window
        self.min_samples = min_samples
        self._errors: dict[str, deque[float]] = {}

    def record(self, key: str, predicted: float, actual: float) -> None:
        """One prediction checked against what happened (both > 0; non-positive values are floored at 1 s)."""
        err = math.log(max(actual, 1.0) / max(predicted, 1.0))
        self._errors.setdefault(key, deque(maxlen=self.window)).append(err)

    def count(self, key: str) -> int:
        return len(self._errors.get(key, ()))

    def errors(self, key: str) -> list[float]:
        """The recorded log errors of `key`, sorted."""
        return sorted(self._errors.get(key, ()))

    def factor(self, key: str) -> float:
        errs = self.errors(key)
        if len(errs) < self.min_samples:
            return 1.0
        return math.exp(quantile(errs, 0.5))

    def spread(self, key: str, low_q: float = LOW_Q, high_q: float = HIGH_Q) -> tuple[float, float] | None:
        """(low, high) multiplicative error quantiles around the bias-corrected prediction; None until
        `min_samples` pairs exist."""
        errs = self.errors(key)
        if len(errs) < self.min_samples:
            return None
        mid = quantile(errs, 0.5)
        return math.exp(quantile(errs, low_q) - mid), math.exp(quantile(errs, high_q) - mid)

    def keys(self) -> list[str]:
        return sorted(self._errors)


_BASIS = {"s": "team/user/name", "u": "team/user", "t": "team", "*": "all"}


class DurationPredictor:
    """Predicts run times from limits and the history of similar finished jobs (see the module doc).

    `observe(key, limit_s, duration_s)` when a job ends; `predict(key, limit_s)` for a job not started;
    `remaining(key, limit_s, elapsed_s, progress)` for a running one. Predictions never exceed the limit by
    more than history says jobs overrun it (a job killed at its limit never does).
    """

    def __init__(self, *, window: int = DEFAULT_WINDOW, min_samples: int = DEFAULT_MIN_SAMPLES,
                 low_q: float = LOW_Q, high_q: float = HIGH_Q, correct_bias: bool = True,
                 use_cohort: bool = True):
        if not 0.0 < low_q < 0.5 < high_q < 1.0:
            raise ValueError(f"need 0 < low_q < 0.5 < high_q < 1, got {low_q}, {high_q}")
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be at least 1")
        self.window = window
        self.min_samples = min_samples
        self.low_q, self.high_q = low_q, high_q
        self.correct_bias = correct_bias
        self._ratios: dict[tuple[str, ...], deque[float]] = {}  # group -> duration/limit of finished jobs
        self._sorted: dict[tuple[str, ...], list[float]] = {}  # cache of sorted ratios, dropped on change
        # A shorter memory for errors than for ratios: the correction follows a drift quickly and forgets it once
        # the ratios themselves have caught up (the same window would over-correct for a whole window).
        self.bias = BiasRecord(window=max(min_samples, window // 4), min_samples=min_samples)
        self.observed = 0
        self._runs: dict[str, CohortEvidence] = {}  # group name -> its ended jobs' (start, duration)
        self.use_cohort = use_cohort
        # The jobs running as of the last `running_now`: group name -> their (started_at, limit_s), sorted.
        self._running: dict[str, list[tuple[float, float]]] = {}
        self._log_stats: dict[str, tuple[float, float]] = {}  # group name -> `ratio_log_stats` of its window

    # ------------------------------------------------------------------ learning

    def observe(self, key: JobKey, limit_s: float, duration_s: float, started_at: float | None = None) -> None:
        """A job of `key` with this limit ran `duration_s` in all (it has ended). Its error against what would
        have been predicted is recorded first, then its ratio joins every group it belongs to; with its start
        (`started_at`, the end minus the run time) it also becomes cohort evidence for the group's running jobs."""
        if limit_s <= 0 or duration_s < 0:
            raise ValueError(f"limit_s must be > 0 and duration_s >= 0, got {limit_s}, {duration_s}")
        ratios, _, used = self._group(key)
        if ratios:
            self.bias.record(used, limit_s * quantile(ratios, 0.5), duration_s)
        ratio = max(duration_s, 1.0) / limit_s
        for level in key.levels():
            self._ratios.setdefault(level, deque(maxlen=self.window)).append(ratio)
            self._sorted.pop(level, None)
            self._log_stats.pop("\x1f".join(level), None)
            if started_at is not None:
                self._runs.setdefault("\x1f".join(level), CohortEvidence(self.window)).add(
                    started_at, max(duration_s, 1.0))
        self.observed += 1

    def running_now(self, jobs: Iterable[tuple[JobKey, float, float]]) -> None:
        """The jobs holding GPUs now, as (key, limit_s, started_at), until the next call replaces them: a running
        job's prediction (`remaining(..., started_at=)`) also hears the jobs of its group started near it, how
        long they have run (censored durations) and their limits (`pooled_prior`). An empty call forgets them."""
        running: dict[str, list[tuple[float, float]]] = {}
        for key, limit_s, started_at in jobs:
            group = self.group_name(key)
            if group and limit_s > 0:
                running.setdefault(group, []).append((started_at, limit_s))
        self._running = {group: sorted(v) for group, v in running.items()}

    # ------------------------------------------------------------------ predicting

    def predict(self, key: JobKey, limit_s: float) -> Prediction:
        """The duration of a job of `key` with limit `limit_s` that has not started."""
        raw = self._raw(key, limit_s)
        f = self._factor(self._group(key)[2])
        return Prediction(raw.median_s * f, raw.low_s * f, raw.high_s * f, raw.samples, raw.basis)

    def remaining(self, key: JobKey, limit_s: float, elapsed_s: float, progress: float | None = None,
                  started_at: float | None = None) -> Prediction:
        """Seconds left for a job of `key` that has run `elapsed_s`. `progress` (0-1], the fraction of its work
        its last checkpoint reports done, gives the total as elapsed / progress when it is known. `started_at`
        (same clock as the observed starts) lets its cohort speak (module doc): the ended jobs of its group
        started near it, and the running ones `running_now` last handed in."""
        elapsed_s = max(0.0, elapsed_s)
        if progress is not None and 0.0 < progress <= 1.0 and elapsed_s > 0:
            left = elapsed_s * (1.0 - progress) / progress
            left = max(MIN_REMAINING_S, left) if progress < 1.0 else MIN_REMAINING_S
            return Prediction(left, left, left, 0, "progress")
        at, samples, basis = self.remaining_quantiles(key, limit_s, elapsed_s, started_at)
        return Prediction(at(0.5), at(self.low_q), at(self.high_q), samples, basis)

    def remaining_quantiles(self, key: JobKey, limit_s: float, elapsed_s: float, started_at: float | None = None,
                            ) -> tuple[Callable[[float], float], int, str]:
        """What `remaining` predicts (without checkpoint progress), at any quantile: a function q -> seconds
        left (at least 1, nondecreasing in q), the samples and the basis. `remaining` reads it at the median, p10
        and p90."""
        elapsed_s = max(0.0, elapsed_s)
        if started_at is not None and self.use_cohort:
            cohort = self._cohort(key, limit_s, elapsed_s, started_at)
            if cohort is not None:
                return cohort
        alive_q, samples, basis = self._alive(key, limit_s, elapsed_s)
        if alive_q is None:
            return (lambda q: MIN_REMAINING_S), samples, basis
        aq = alive_q
        return (lambda q: max(1.0, aq(q) - elapsed_s)), samples, basis

    def _alive(self, key: JobKey, limit_s: float, elapsed_s: float,
               ) -> tuple[Callable[[float], float] | None, int, str]:
        """The quantile function of the durations still possible after `elapsed_s` (None: history allows none),
        the samples and the basis."""
        ratios, samples, group = self._group(key)
        basis, f = _basis(group), self._factor(group)
        # History bounds the total: a bias correction never predicts a run longer than any similar job took.
        cap = limit_s * ratios[-1] if ratios else float(limit_s)
        values: Sequence[float] = ratios or [1.0]

        def total(r: float) -> float:  # a similar job's duration scaled to this one's limit (sorted like ratios)
            return min(cap, limit_s * r * f)

        first = bisect.bisect_right(values, elapsed_s, key=total)  # durations still possible: values[first:]
        if first == len(values):
            return None, samples, basis
        n = len(values) - first

        def alive_q(q: float) -> float:  # `quantile` of the durations still possible, without building them
            pos = q * (n - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, n - 1)
            return _between(total(values[first + lo]), total(values[first + hi]), pos - lo)

        return alive_q, samples, basis

    def group_name(self, key: JobKey) -> str:
        """The history group a prediction for `key` rests on ("" when none has enough): running jobs of the same
        group are each other's peers (`running_now`)."""
        return self._group(key)[2]

    def _cohort(self, key: JobKey, limit_s: float, elapsed_s: float, started_at: float,
                ) -> tuple[Callable[[float], float], int, str] | None:
        """The remaining time from the cohort mixture (CohortEvidence) as `remaining_quantiles` returns it, None
        when no job of the group started near this one has ended or is running (`running_now`): the caller then
        predicts from the window alone."""
        ratios, samples, group = self._group(key)
        if not group:
            return None
        evidence = self._runs.get(group)
        scale = max(elapsed_s, MIN_REMAINING_S)
        now = started_at + elapsed_s
        near = evidence.near(started_at, scale) if evidence is not None else []
        running = self._running_peers(group, limit_s, started_at, scale)
        # the running peers: (weight, log of how long each has run so far), censored durations
        censored = [(w, math.log(max(now - s, 1.0))) for w, s, _ in running]
        if len(near) == COHORT_MAX or len(censored) == COHORT_MAX:
            near, censored = balance_truncated(
                near, censored, evidence.count_near(started_at, scale) if evidence is not None else 0,
                self._count_running(group, limit_s, started_at, scale))
        f = self._factor(group)
        # The prior: the durations the group's window allows (ratio × limit, bias-corrected, capped as in
        # `_alive`), as `min_samples` pseudo-jobs: the window is trusted once it holds that many. With running
        # jobs of the group started near it (`running_now`), their limits say more (`pooled_prior`).
        # (a named group always has ratios: `_group` names one only once it holds `min_samples`)
        cap = limit_s * ratios[-1]
        others = [(w, lim) for w, _, lim in running]
        if others:
            stats = self._log_stats.get(group)
            if stats is None:
                stats = self._log_stats[group] = ratio_log_stats(ratios)
            prior = [min(cap, d) for d in pooled_prior(ratios, f, limit_s, others, stats)]
            kind = "+cohort+peers" if near else "+peers"
        elif near:
            prior = [min(cap, limit_s * r * f) for r in ratios]  # sorted, as the ratios are
            kind = "+cohort"
        else:
            return None
        total = cohort_quantile_fn(near, prior, float(self.min_samples), elapsed_s, censored)
        if total is None:
            return None
        top = max(cap, elapsed_s + MIN_REMAINING_S)

        def left(q: float) -> float:
            return max(1.0, min(total(q), top) - elapsed_s)

        return left, samples + len(near), _basis(group) + kind

    def _count_running(self, group: str, limit_s: float, started_at: float, scale: float) -> int:
        """How many of the group's other running jobs started within the cohort's reach (two bisections)."""
        rows = self._running.get(group, [])
        lo, hi = _within_reach(rows, started_at, scale)
        me = bisect.bisect_left(rows, (started_at, limit_s))
        return hi - lo - (1 if me < len(rows) and rows[me] == (started_at, limit_s) else 0)

    def _running_peers(self, group: str, limit_s: float, started_at: float, scale: float
                       ) -> list[tuple[float, float, float]]:
        """(weight, start, limit) of the group's other running jobs (`running_now`) started near this one,
        weighted like ended cohort jobs by start proximity: the COHORT_MAX heaviest (ties: the longer limit
        first), heaviest first. Found by walking out from this job's start, one start value at a time, so that a
        refresh costs O(running × COHORT_MAX), not O(running²), however many jobs started in the same burst."""
        rows = self._running.get(group)
        if not rows:
            return []
        found: list[tuple[float, float, float]] = []
        me = (started_at, limit_s)

        def take(block: list[tuple[float, float]], w: float) -> None:  # block: one weight, limits descending
            nonlocal me
            for s, lim in block:
                if len(found) >= COHORT_MAX:
                    return
                if (s, lim) == me:
                    me = (math.nan, math.nan)  # this job itself (once)
                    continue
                found.append((w, s, lim))

        def tail(lo: int, hi: int) -> list[tuple[float, float]]:  # rows[lo:hi], limits descending, enough of them
            return rows[max(lo, hi - COHORT_MAX - 1):hi][::-1]

        left = bisect.bisect_left(rows, (started_at, -math.inf))
        right = bisect.bisect_right(rows, (started_at, math.inf))
        take(tail(left, right), 1.0)
        while len(found) < COHORT_MAX and (left > 0 or right < len(rows)):
            gap_left = started_at - rows[left - 1][0] if left > 0 else math.inf
            gap_right = rows[right][0] - started_at if right < len(rows) else math.inf
            gap = min(gap_left, gap_right)
            if (w := math.exp(-gap / scale)) < COHORT_MIN_WEIGHT:
                break
            block: list[tuple[float, float]] = []
            if gap_left == gap:
                lo = bisect.bisect_left(rows, (rows[left - 1][0], -math.inf))
                block += tail(lo, left)
                left = lo
            if gap_right == gap:
                hi = bisect.bisect_right(rows, (rows[right][0], math.inf))
                block += tail(right, hi)
                right = hi
            if gap_left == gap_right:  # the same distance on both sides: one weight, merged by limit
                block.sort(key=lambda row: row[1], reverse=True)
            take(block, w)
        return found

    def ratios(self, key: JobKey) -> list[float]:
        """The sorted duration/limit ratios of the group a prediction for `key` rests on (empty: none yet)."""
        return list(self._group(key)[0])

    # ------------------------------------------------------------------ internals

    def _group(self, key: JobKey) -> tuple[list[float], int, str]:
        """The sorted ratios of the most specific group with enough history, their count and the group's name
        ("\x1f"-joined, also the key of its bias record); ([], 0, "") when no group has enough."""
        for group in key.levels():
            values = self._ratios.get(group)
            if values is not None and len(values) >= self.min_samples:
                cached = self._sorted.get(group)
                if cached is None:
                    cached = self._sorted[group] = sorted(values)
                return cached, len(cached), "\x1f".join(group)
        return [], 0, ""

    def _raw(self, key: JobKey, limit_s: float) -> Prediction:
        if limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        ratios, samples, group = self._group(key)
        if not ratios:
            return Prediction(float(limit_s), float(limit_s), float(limit_s), 0, "limit")
        return Prediction(limit_s * quantile(ratios, 0.5), limit_s * quantile(ratios, self.low_q),
                          limit_s * quantile(ratios, self.high_q), samples, _basis(group))

    def _factor(self, group: str) -> float:
        """The bias correction of predictions resting on `group` (its own record of errors)."""
        if not self.correct_bias or not group:
            return 1.0
        return self.bias.factor(group)


class CohortEvidence:
    """A group's ended jobs as (start, log duration), the last `window` by end, kept sorted by start so that the
    ones started near a running job are found by bisection."""

    def __init__(self, window: int):
        self._order: deque[tuple[float, float]] = deque()
        self._by_start: list[tuple[float, float]] = []
        self.window = window

    def add(self, started_at: float, duration_s: float) -> None:
        entry = (started_at, math.log(duration_s))
        self._order.append(entry)
        bisect.insort(self._by_start, entry)
        if len(self._order) > self.window:
            old = self._order.popleft()
            del self._by_start[bisect.bisect_left(self._by_start, old)]

    def near(self, started_at: float, scale_s: float) -> list[tuple[float, float]]:
        """(weight, log duration) of the ended jobs started within the distance where exp(-|gap| / scale_s)
        stays above COHORT_MIN_WEIGHT."""
        lo, hi = _within_reach(self._by_start, started_at, scale_s)
        found = [(math.exp(-abs(s - started_at) / scale_s), d) for s, d in self._by_start[lo:hi]]
        return sorted(found, reverse=True)[:COHORT_MAX] if len(found) > COHORT_MAX else found

    def count_near(self, started_at: float, scale_s: float) -> int:
        """How many ended jobs `near` would weigh before it keeps the COHORT_MAX heaviest."""
        lo, hi = _within_reach(self._by_start, started_at, scale_s)
        return hi - lo

    def __len__(self) -> int:
        return len(self._order)


def _within_reach(rows: Sequence[tuple[float, float]], started_at: float, scale_s: float) -> tuple[int, int]:
    """rows[lo:hi]: the (start, ...) rows, sorted by start, whose weight exp(-|gap| / scale_s) stays at or above
    COHORT_MIN_WEIGHT (two bisections)."""
    reach = -math.log(COHORT_MIN_WEIGHT) * scale_s
    return (bisect.bisect_left(rows, (started_at - reach, -math.inf)),
            bisect.bisect_right(rows, (started_at + reach, math.inf)))


def balance_truncated(near: Sequence[tuple[float, float]], censored: Sequence[tuple[float, float]],
                      n_ended: int, n_running: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The ended (`near`) and running (`censored`) cohort evidence, each kept to its COHORT_MAX heaviest out of
    `n_ended` and `n_running` within reach, reweighted so that each side's share of their weight is its share of
    the whole cohort. Why: a burst of 200 jobs of which 20 have ended would otherwise be heard as 20 ended
    against 32 running, and the early ends (the short jobs, by selection) would speak for far more of the
    cohort than they are. Each side's full weight is estimated as its kept weight times n / kept (its kept rows
    stand for the rest); the total stays what was kept, so the window prior's say is unchanged. With neither
    side truncated (n equal to what was kept) the weights come back unchanged."""
    kept_e, kept_r = len(near), len(censored)
    if not kept_e or not kept_r or (n_ended <= kept_e and n_running <= kept_r):
        return list(near), list(censored)
    we, wr = sum(w for w, _ in near), sum(w for w, _ in censored)
    full_e, full_r = we * max(n_ended, kept_e) / kept_e, wr * max(n_running, kept_r) / kept_r
    k = (we + wr) / (full_e + full_r)
    ke, kr = k * full_e / we, k * full_r / wr
    return [(w * ke, mu) for w, mu in near], [(w * kr, c) for w, c in censored]


_SQRT2 = math.sqrt(2.0)


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / _SQRT2)


def _censored_weights(near: Sequence[tuple[float, float]], prior: Sequence[float], prior_weight: float,
                      censored: Sequence[tuple[float, float]], bw: float) -> tuple[list[tuple[float, float]], float]:
    """The mixture's weights after the running peers' censored durations (`cohort_quantile_fn`): each peer adds
    its weight to the components by its posterior responsibility."""
    erfc, n_prior = math.erfc, len(prior)
    weights = [w for w, _ in near]
    extra_prior = 0.0
    for v, c in censored:
        # (_phi inlined, the same arithmetic: this loop and the mixture's search are most of a refresh's
        # predictions, ~30 running jobs' peers x ~30 ended ones each)
        lasting = [w * (1.0 - 0.5 * erfc(-((c - mu) / bw) / _SQRT2)) for w, mu in near]
        prior_lasting = prior_weight * (n_prior - bisect.bisect_right(prior, math.exp(c))) / n_prior
        zc = sum(lasting) + prior_lasting
        if zc <= 1e-12:
            continue  # nothing known lasts that long: the peer says nothing about the components
        for i, m in enumerate(lasting):
            weights[i] += v * m / zc
        extra_prior += v * prior_lasting / zc
    return [(w, mu) for w, (_, mu) in zip(weights, near, strict=True)], prior_weight + extra_prior


def cohort_quantile_fn(near: Sequence[tuple[float, float]], prior: Sequence[float], prior_weight: float,
                       elapsed_s: float, censored: Sequence[tuple[float, float]] = ()
                       ) -> Callable[[float], float] | None:
    """Quantiles of a running job's total duration given that it has run `elapsed_s`, under a mixture prior:
    each ended cohort job (weight w, log duration mu) is a lognormal component (the job runs about as long as
    it did), the group's window (`prior`, sorted durations) one more component of weight `prior_weight`.
    Having survived to `elapsed_s` reweights every component by its chance of lasting that long (Bayes' rule):
    a cohort job that ran far shorter drops out, one that ended at about this job's elapsed time says it ends
    soon. The kernels' width is Silverman's rule on the cohort's weighted log durations (floored at
    COHORT_MIN_BANDWIDTH; with under two effective jobs, the prior's own log spread). The cohort's jobs still
    running (`censored`: weight, log of the time each has run) are observations too, "it lasts past c": the
    first to end are the short ones, and the ones still running say how much of the cohort outlasts them. Each
    adds its weight to the components by its posterior responsibility (a component's weight times its chance
    of lasting past c: one EM step of the mixture's weights), so peers outlasting every ended one move weight
    to the window. `near` may be empty: the prior alone, conditioned on the elapsed time. Returns q -> that
    quantile (seconds); None when no component allows a run this long."""
    erfc = math.erfc
    total_w = sum(w for w, _ in near)
    if total_w <= 0 and not prior:
        return None
    mean = sum(w * mu for w, mu in near) / total_w if total_w > 0 else 0.0
    var = sum(w * (mu - mean) ** 2 for w, mu in near) / total_w if total_w > 0 else 0.0
    n_eff = total_w ** 2 / sum(w * w for w, _ in near) if total_w > 0 else 0.0
    if n_eff < 2.0:
        logs = [math.log(max(v, 1.0)) for v in prior]
        pm = sum(logs) / len(logs)
        var = sum((x - pm) ** 2 for x in logs) / len(logs)
        n_eff = max(n_eff, 1.0)
    bw = max(COHORT_MIN_BANDWIDTH, 1.06 * math.sqrt(var) * n_eff ** -0.2)
    le = math.log(max(elapsed_s, 1.0))
    n_prior = len(prior)
    if censored:
        near, prior_weight = _censored_weights(near, prior, prior_weight, censored, bw)
    # Components that ran so much shorter that lasting this long is beyond 8 kernel widths weigh nothing now.
    near = [(w, mu) for w, mu in near if (le - mu) / bw < 8.0]
    first_alive = bisect.bisect_right(prior, elapsed_s)
    prior_alive = prior_weight * (n_prior - first_alive) / n_prior

    # each component's CDF at the elapsed time, once (the bisection below evaluates the mixture ~100 times)
    at_elapsed = [(w, mu, _phi((le - mu) / bw)) for w, mu in near]

    # (the median, p10 and p90 searches start from the same bracket: their first midpoints are the same, and
    # each is evaluated once)
    masses: dict[float, float] = {}

    def mass_above_elapsed_below(lx: float) -> float:  # unnormalised P(elapsed < D <= e^lx)
        found = masses.get(lx)
        if found is not None:
            return found
        x = math.exp(lx)
        m = sum([w * (0.5 * erfc(-((lx - mu) / bw) / _SQRT2) - c) for w, mu, c in at_elapsed])  # (_phi inlined)
        found = masses[lx] = m + prior_weight * max(0, bisect.bisect_right(prior, x) - first_alive) / n_prior
        return found

    z = sum(w * (1.0 - c) for w, _, c in at_elapsed) + prior_alive
    if z <= 1e-12:
        return None
    hi0 = max([le + 1e-6] + [mu + 8.0 * bw for _, mu in near] + [math.log(max(prior[-1], 1.0)) + 1e-6])

    def total(q: float) -> float:
        lo, hi = le, hi0
        # bisection in log seconds until the bracket is under BISECT_TOLERANCE_S of run time (or 36 halvings)
        for _ in range(36):
            if math.exp(hi) - math.exp(lo) < BISECT_TOLERANCE_S:
                break
            mid = 0.5 * (lo + hi)
            if mass_above_elapsed_below(mid) < q * z:
                lo = mid
            else:
                hi = mid
        return math.exp(hi)

    return total


def pooled_prior(ratios: Sequence[float], factor: float, limit_s: float, others: Sequence[tuple[float, float]],
                 log_stats: tuple[float, float] | None = None) -> list[float]:
    """A job's duration, before its elapsed time is known, from its own limit and those of the jobs of its group
    running beside it (`others`: (weight, limit)), as len(ratios) sorted quantiles.

    A random-effects model in log seconds: the cohort's durations scatter by ω around a common m, and each limit
    is its job's duration times the user's guess error, whose log is centred where the window's median is and
    spreads as the window's logs do, σ (the ratios duration/limit of the group's ended jobs, `factor` their bias
    correction). Each other limit is then a guess at m with variance ω² + σ²; their (weighted) mean estimates m,
    and the limits' own scatter estimates ω² (its variance less σ², method of moments, and no closer to zero
    than that estimate's standard error): a
    sweep whose limits scatter no more than users' guesses do runs alike, a mix of unlike jobs started together
    scatters more and leaves each job to its own limit. This job's duration is the cohort's (m, ω) combined with
    its own limit's guess (precision-weighted): a normal in log, widened by what the window's own mean is
    uncertain by. `log_stats`: `ratio_log_stats(ratios)`, when the caller keeps it."""
    n = len(ratios)
    centre_log, var_log = log_stats if log_stats is not None else ratio_log_stats(ratios)
    # log(duration / limit) of a typical job: the window's median ratio, as every other prediction takes it (the
    # bias correction `factor` is learnt against that median, so it corrects this centre and no other)
    bias = centre_log + math.log(factor)
    sigma2 = max(var_log, COHORT_MIN_BANDWIDTH ** 2)
    total_w = sum(w for w, _ in others)
    centre = sum(w * math.log(lim) for w, lim in others) / total_w
    n_eff = total_w ** 2 / sum(w * w for w, _ in others)
    mine = math.log(limit_s)
    pw = total_w + 1.0
    pm = (centre * total_w + mine) / pw
    scatter = (sum(w * (math.log(lim) - pm) ** 2 for w, lim in others) + (mine - pm) ** 2) / pw
    # ω² is told from zero no closer than its estimate's standard error (σ²·√(2/n) for n normal limits)
    omega2 = max(COHORT_MIN_BANDWIDTH ** 2, scatter - sigma2, sigma2 * math.sqrt(2.0 / (n_eff + 1.0)))
    cohort_var = omega2 + (omega2 + sigma2) / n_eff  # this job's log duration, from the others alone
    var = 1.0 / (1.0 / cohort_var + 1.0 / sigma2)
    mean = var * ((centre + bias) / cohort_var + (mine + bias) / sigma2)
    sd = math.sqrt(var + sigma2 / n)  # and the window's mean error is itself known to ±σ/√n
    return [math.exp(mean + sd * z) for z in _normal_scores(n)]


def ratio_log_stats(ratios: Sequence[float]) -> tuple[float, float]:
    """The log of the median of sorted `ratios` (non-empty, positive) and the (population) variance of their
    logs."""
    logs = [math.log(max(r, 1e-9)) for r in ratios]
    mean = sum(logs) / len(logs)
    return math.log(max(quantile(ratios, 0.5), 1e-9)), sum((x - mean) ** 2 for x in logs) / len(logs)


@functools.lru_cache(maxsize=64)
def _normal_scores(n: int) -> tuple[float, ...]:
    """The standard normal's quantiles at (k + 0.5) / n, k = 0..n-1: n evenly weighted points of it."""
    return tuple(_STD_NORMAL.inv_cdf((k + 0.5) / n) for k in range(n))


def _basis(group: str) -> str:
    return _BASIS[group[0]] if group else "limit"


def observe_all(predictor: DurationPredictor, finished: Iterable[tuple[JobSpec, float]]) -> DurationPredictor:
    """Feed finished jobs (spec, actual duration s), in the order given, into `predictor`; returns it."""
    for spec, duration in finished:
        predictor.observe(JobKey.of(spec), float(spec.max_runtime_s), duration)
    return predictor
