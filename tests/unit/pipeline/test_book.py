"""The placement book (services/core/pipeline/book.py): kept up to date event by event, it reads exactly as the
dictionaries it replaced, sorted again, would; and a cycle placing from it decides what `place` decides from them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.pipeline import PlacementBook, WaitingJob, place, place_ordered, placement_key
from services.core.scheduler import ClusterState, PendingJob, RunningJob
from shared.domain import JobSpec, NodeSpec, PodSet

JOBS = [f"j{i}" for i in range(8)]  # few ids: re-admissions, placements of waiting jobs and ends of unknown ones


def spec(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(job_id=job_id, team="t", queue="t", max_runtime_s=3600,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=("H100",)),))


# (operation, job, a small number: priority / time / GPUs, another)
OPS = st.lists(st.tuples(st.sampled_from(["wait", "unwait", "place", "move", "end", "forget"]), st.sampled_from(JOBS),
                         st.integers(0, 3), st.integers(0, 3)), min_size=10, max_size=80)


class Reference:
    """What the scheduler kept before the book: two dictionaries, sorted again at every cycle."""

    def __init__(self) -> None:
        self.waiting: dict[str, WaitingJob] = {}
        self.placed: dict[str, tuple[float, int | None]] = {}

    def apply(self, book: PlacementBook, op: str, job_id: str, a: int, b: int) -> None:
        if op == "wait":  # ties on priority and admission time: the id decides
            job = WaitingJob(spec=spec(job_id, 1 + b % 3), allowed_models=(), priority=a, admitted_at=float(b))
            self.waiting[job_id] = job
            book.wait(job)
        elif op == "unwait":
            assert book.unwait(job_id) == self.waiting.pop(job_id, None)
        elif op == "place":  # equal ends too: the id decides
            prio = None if a == 0 else a
            self.placed[job_id] = (100.0 + b, prio)
            book.add_placed(job_id, 100.0 + b, prio)
        elif op == "move":
            if job_id in self.placed:
                self.placed[job_id] = (200.0 + b, self.placed[job_id][1])
            book.move_end(job_id, 200.0 + b)
        elif op == "end":
            self.placed.pop(job_id, None)
            book.end(job_id)
        else:
            self.waiting.pop(job_id, None)
            self.placed.pop(job_id, None)
            book.forget(job_id)

    def pending(self) -> list[PendingJob]:
        return [PendingJob(spec=w.spec, allowed_models=w.allowed_models)
                for w in sorted(self.waiting.values(), key=placement_key)]

    def running(self) -> list[RunningJob]:
        return [RunningJob(job_id=job_id, expected_end=end) for job_id, (end, _) in sorted(self.placed.items())]

    def lowest(self) -> int | None:
        return min((p for _, p in self.placed.values() if p is not None), default=None)


def run(ops: list[tuple[str, str, int, int]]) -> tuple[Reference, PlacementBook]:
    ref, book = Reference(), PlacementBook()
    for op in ops:
        ref.apply(book, *op)
    return ref, book


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_book_after_any_events_reads_as_the_dictionaries_sorted_again(ops: list[tuple[str, str, int, int]]) -> None:
    ref, book = run(ops)
    view = book.view()
    assert list(view.pending) == ref.pending()
    assert list(view.timeline) == sorted((r.expected_end, r.job_id) for r in ref.running())
    assert view.lowest_preemptible == ref.lowest()
    assert view == book.rebuilt()
    assert dict(book.waiting) == ref.waiting and dict(book.placed) == ref.placed


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_a_cycle_from_the_book_decides_what_place_decides_from_the_dictionaries(
        ops: list[tuple[str, str, int, int]]) -> None:
    ref, book = run(ops)
    nodes = [NodeSpec(name=f"n{i}", gpus=2, gpu_model="H100", cpu_milli=64_000, memory_mib=512_000, rack=f"r{i}",
                      block="b") for i in range(2)]
    before, after = ClusterState.from_nodes(nodes), ClusterState.from_nodes(nodes)
    old = place(before, ref.waiting.values(), ref.running(), 50.0, lowest_preemptible_running=ref.lowest())
    new = place_ordered(after, book.pending, book.priority, book.timeline, 50.0,
                        lowest_preemptible_running=book.lowest_preemptible)
    assert new.result == old.result  # the same placements (order, nodes, GPUs), reasons and reservations
    assert new.preemption_asks == old.preemption_asks
    assert after.fingerprint() == before.fingerprint()


def test_a_readmitted_job_moves_to_its_new_place_in_the_order_and_an_end_frees_its_timeline_entry() -> None:
    book = PlacementBook()
    for job_id, prio, at in (("a", 1, 3.0), ("b", 1, 1.0), ("c", 5, 9.0)):
        book.wait(WaitingJob(spec=spec(job_id, 1), allowed_models=(), priority=prio, admitted_at=at))
    assert [p.spec.job_id for p in book.pending] == ["c", "b", "a"]  # priority first, then admission time
    book.wait(WaitingJob(spec=spec("a", 1), allowed_models=(), priority=1, admitted_at=0.5))
    assert [p.spec.job_id for p in book.pending] == ["c", "a", "b"]
    book.add_placed("x", 10.0, 3)
    book.add_placed("y", 5.0, 1)
    book.move_end("x", 4.0)
    assert list(book.timeline) == [(4.0, "x"), (5.0, "y")] and book.lowest_preemptible == 1
    book.end("y")
    assert list(book.timeline) == [(4.0, "x")] and book.lowest_preemptible == 3
