"""Signatures are Standard Webhooks signatures: the reference `standardwebhooks` package verifies them."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook, WebhookVerificationError

from services.telemetry.webhooks.signing import CONTENT_TYPE, new_secret, sign, signed_headers


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=512).map(lambda b: b.hex().encode()), msg_id=st.uuids().map(str))
def test_reference_library_verifies_our_signature(body: bytes, msg_id: str) -> None:
    secret = new_secret()
    headers = signed_headers(secret, msg_id, int(time.time()), body)
    assert headers["content-type"] == CONTENT_TYPE
    Webhook(secret).verify(body, headers, json_parse=False)


def test_tampering_or_another_secret_fails_verification() -> None:
    secret = new_secret()
    headers = signed_headers(secret, "evt-1", int(time.time()), b'{"a":1}')
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(b'{"a":2}', headers, json_parse=False)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(b'{"a":1}', headers, json_parse=False)


def test_known_vector() -> None:
    # From the Standard Webhooks specification's example.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    with pytest.raises(ValueError):
        sign("not-a-secret", "id", 1, body)


def test_during_a_rotation_either_secret_verifies() -> None:
    old, new = new_secret(), new_secret()
    body = b'{"id":"evt-2"}'
    headers = signed_headers([new, old], "evt-2", int(time.time()), body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    Webhook(old).verify(body, headers, json_parse=False)  # a receiver that has not switched yet
    Webhook(new).verify(body, headers, json_parse=False)  # one that has
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers, json_parse=False)


@pytest.mark.parametrize("bad_id", ["", " ", "a b"])
def test_webhook_id_is_never_empty(bad_id: str) -> None:
    with pytest.raises(ValueError, match="webhook-id"):
        signed_headers(new_secret(), bad_id, int(time.time()), b"{}")
    with pytest.raises(ValueError, match="no webhook secret"):
        signed_headers([], "evt-3", int(time.time()), b"{}")
