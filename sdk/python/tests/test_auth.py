"""Authorization and acknowledgement verification, check by check (``auth.rs``, ``ack.rs``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from warden_sdk.auth import (
    AckedCall,
    AuthError,
    AuthorizationClaims,
    CallIdentity,
    RequestAckClaims,
    key_id,
    sign_claims,
    verify_authorization,
    verify_request_ack,
)
from warden_sdk.canonical import canonical_bytes
from warden_sdk.chain import Head


def _pub(k: Ed25519PrivateKey) -> bytes:
    return k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


POLICY = Ed25519PrivateKey.generate()
LEDGER = Ed25519PrivateKey.generate()
KEYS = {key_id(_pub(POLICY)): POLICY.public_key()}
LEDGER_KEYS = {key_id(_pub(LEDGER)): LEDGER.public_key()}

CLAIMS = AuthorizationClaims(
    v=1,
    key_id="",
    decision_id="d1",
    tenant="t",
    run_id="r",
    step_id="s",
    attempt=1,
    tool="echo",
    args_sha256="ab",
    idempotency_key="k",
    capability_id="",
    issued_at_ms=1_000,
    expires_at_ms=2_000,
)
CALL = CallIdentity(tenant="t", run_id="r", step_id="s", attempt=1, tool="echo", args_sha256="ab", idempotency_key="k")


@dataclasses.dataclass
class Wire:
    claims_json: bytes
    signature: bytes
    key_id: str


def _signed_raw(claims: dict[str, object], key: Ed25519PrivateKey = POLICY) -> Wire:
    raw = canonical_bytes(claims)
    return Wire(raw, key.sign(raw), key_id(_pub(key)))


def test_k01_signed_authorization_verifies_only_for_its_exact_call() -> None:
    s = sign_claims(CLAIMS, POLICY)
    assert verify_authorization(s, KEYS, CALL, 1_500).decision_id == "d1"
    with pytest.raises(AuthError, match=r"^authorization expired at 2000 \(now 2000\)$"):
        verify_authorization(s, KEYS, CALL, 2_000)
    for field, value in [
        ("tenant", "u"),
        ("run_id", "q"),
        ("step_id", "x"),
        ("attempt", 2),
        ("tool", "rm"),
        ("args_sha256", "cd"),
        ("idempotency_key", "j"),
    ]:
        with pytest.raises(AuthError) as e:
            verify_authorization(s, KEYS, dataclasses.replace(CALL, **{field: value}), 1_500)
        assert (e.value.kind, e.value.field) == ("mismatch", field)
        assert str(e.value) == f"authorization is for another call: {field} does not match"


def test_a_tampered_forged_or_missing_authorization_is_refused() -> None:
    s = sign_claims(CLAIMS, POLICY)
    tampered = Wire(s.claims_json.replace(b"echo", b"ecxo"), s.signature, s.key_id)
    with pytest.raises(AuthError, match="signature does not verify"):
        verify_authorization(tampered, KEYS, CALL, 1_500)
    forged = sign_claims(CLAIMS, Ed25519PrivateKey.generate())
    with pytest.raises(AuthError) as e:
        verify_authorization(forged, KEYS, CALL, 1_500)
    assert e.value.kind == "unknown_key"
    # A forger naming the real key id still fails the signature.
    with pytest.raises(AuthError, match="signature does not verify"):
        verify_authorization(Wire(forged.claims_json, forged.signature, s.key_id), KEYS, CALL, 1_500)
    for empty in (None, Wire(b"", b"", "")):
        with pytest.raises(AuthError, match="^authorization is missing$"):
            verify_authorization(empty, KEYS, CALL, 1_500)
    with pytest.raises(AuthError, match="signature does not verify"):
        verify_authorization(Wire(s.claims_json, s.signature[:63], s.key_id), KEYS, CALL, 1_500)


def test_claims_are_parsed_as_strictly_as_serde_deny_unknown_fields() -> None:
    kid = key_id(_pub(POLICY))
    good = {**dataclasses.asdict(CLAIMS), "key_id": kid}
    assert verify_authorization(_signed_raw(good), KEYS, CALL, 1_500).tool == "echo"
    for bad, why in [
        ({**good, "extra": 1}, "unknown field"),
        ({k: v for k, v in good.items() if k != "capability_id"}, "missing field"),
        ({**good, "attempt": 1.5}, "invalid type"),
        ({**good, "attempt": True}, "invalid type"),
        ({**good, "attempt": 2**32}, "out of range"),
        ({**good, "tool": 7}, "invalid type"),
    ]:
        with pytest.raises(AuthError, match=why) as e:
            verify_authorization(_signed_raw(bad), KEYS, CALL, 1_500)
        assert e.value.kind == "malformed"
    raw = canonical_bytes(good)[:-1] + b',"tool":"echo"}'
    with pytest.raises(AuthError, match="duplicate field"):
        verify_authorization(Wire(raw, POLICY.sign(raw), kid), KEYS, CALL, 1_500)
    # Claims naming another key than the one that signed them.
    with pytest.raises(AuthError) as e:
        verify_authorization(_signed_raw({**good, "key_id": "0" * 16}), KEYS, CALL, 1_500)
    assert e.value.field == "key_id"


ACK = RequestAckClaims(
    v=1,
    kind="",
    key_id="",
    tenant="t",
    run_id="r",
    step_id="s",
    attempt=1,
    decision_id="d",
    idempotency_key="k",
    seq=4,
    event_hash="ab",
)
ACKED = AckedCall(tenant="t", run_id="r", step_id="s", attempt=1, decision_id="d", idempotency_key="k")


def test_request_ack_verifies_only_for_its_exact_call_and_key() -> None:
    s = sign_claims(ACK, LEDGER)
    assert verify_request_ack(s, LEDGER_KEYS, ACKED).seq == 4
    for field, value in [("decision_id", "e"), ("attempt", 2), ("tenant", "u"), ("idempotency_key", "j")]:
        with pytest.raises(AuthError) as e:
            verify_request_ack(s, LEDGER_KEYS, dataclasses.replace(ACKED, **{field: value}))
        assert e.value.field == field
    with pytest.raises(AuthError) as e:
        verify_request_ack(sign_claims(ACK, POLICY), LEDGER_KEYS, ACKED)
    assert e.value.kind == "unknown_key", "the policy's key does not acknowledge requests"
    with pytest.raises(AuthError, match="missing"):
        verify_request_ack(None, LEDGER_KEYS, ACKED)


def test_an_ack_of_another_kind_or_a_head_signature_is_not_an_acknowledgement() -> None:
    kid = key_id(_pub(LEDGER))
    other_kind = {**dataclasses.asdict(ACK), "key_id": kid, "kind": "head"}
    with pytest.raises(AuthError) as e:
        verify_request_ack(_signed_raw(other_kind, LEDGER), LEDGER_KEYS, ACKED)
    assert e.value.field == "kind"
    head = Head(run_id="r", seq=4, hash="ab")
    as_ack = Wire(head.message(), LEDGER.sign(head.message()), kid)
    with pytest.raises(AuthError) as e:
        verify_request_ack(as_ack, LEDGER_KEYS, ACKED)
    assert e.value.kind == "malformed"


def test_signed_claims_are_rfc8785_bytes() -> None:
    s = sign_claims(CLAIMS, POLICY)
    parsed = json.loads(s.claims_json)
    assert s.claims_json == canonical_bytes(parsed)
    assert parsed["key_id"] == s.key_id == key_id(POLICY.public_key())
