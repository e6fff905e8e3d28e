"""`gpuq explain` says what a borrower risks: reclaim always succeeds, so the cost of one is worth knowing."""

from __future__ import annotations

from typing import Any

from services.api.readmodel import explain_lines


def _row(state: str, borrowing: bool, checkpoint: bool) -> dict[str, Any]:
    spec = {"job_id": "j", "pod_sets": [{"count": 1, "gpus_per_pod": 8}], "priority_class": "normal",
            "max_runtime_s": 7200, "checkpoint": {"supported": checkpoint}}
    return {"job_id": "j", "team": "a", "queue": "a", "state": state, "spec": spec, "submitted_at": 0.0,
            "admitted_at": 1.0, "borrowing": borrowing, "placed_at": 2.0, "nodes": ["n-0"], "racks_spanned": 1,
            "blocks_spanned": 1}


def test_a_borrower_that_cannot_checkpoint_is_told_what_a_reclaim_would_cost() -> None:
    text = "\n".join(explain_lines(_row("running", borrowing=True, checkpoint=False), 10.0))
    assert "cannot checkpoint" in text and "7200 s" in text


def test_a_checkpointing_borrower_is_told_it_resumes_and_a_non_borrower_hears_nothing() -> None:
    assert "resumes from the checkpoint" in "\n".join(explain_lines(_row("running", True, True), 10.0))
    assert not any("borrows quota" in line for line in explain_lines(_row("running", False, False), 10.0))
