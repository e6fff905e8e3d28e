"""Spot interruption notices (services/core/kube/interruption.py)."""

from __future__ import annotations

from services.core.kube import interruption

TAINTS = ("aws-node-termination-handler/spot-itn", "cloud.google.com/impending-node-termination")


def test_a_notice_is_a_termination_handlers_taint() -> None:
    node = {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"},
                                {"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}]}}
    assert interruption.notice(node, TAINTS) == "taint cloud.google.com/impending-node-termination:NoSchedule"
    assert interruption.notice({"spec": {"taints": [{"key": "nvidia.com/gpu"}]}}, TAINTS) is None
    assert interruption.notice({"spec": {}}, TAINTS) is None
    assert interruption.notice(node, ()) is None  # none configured: never


def test_a_job_under_notice_is_requeued_once_it_checkpointed_or_the_wait_is_over() -> None:
    base = {"can_checkpoint": True, "checkpoint_at_notice": "s3://c/1", "noticed_at": 100.0, "wait_s": 90.0}
    assert interruption.requeue_now(**base, last_checkpoint="s3://c/1", now=150.0) is None  # still waiting
    assert interruption.requeue_now(**base, last_checkpoint="s3://c/2", now=150.0) == \
        "requeued from the checkpoint it wrote on the notice, s3://c/2"
    assert interruption.requeue_now(**base, last_checkpoint="s3://c/1", now=190.0) == \
        "no checkpoint within 90 s of the notice: requeued from its last checkpoint, s3://c/1"
    assert interruption.requeue_now(**{**base, "can_checkpoint": False}, last_checkpoint=None, now=10_000.0) is None
