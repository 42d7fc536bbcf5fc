"""Test support: a local stand-in for the policy service and the ledger's signing keys.

A tool's unit tests should go through the same verification a real call meets — otherwise
they test a path production never takes. :class:`LocalAuthority` holds two fresh Ed25519 keys
(policy and ledger), signs authorizations and request acknowledgements with them exactly as
the mesh does, and builds hosts that trust only those keys::

    authority = LocalAuthority()
    host = authority.host([add], state_path=tmp_path / "tools.db")
    response = await host.invoke(authority.request("add", {"a": 1, "b": 2}))
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .auth import AuthorizationClaims, RequestAckClaims, key_id, sign_claims
from .canonical import args_digest, canonical_json
from .host import ToolDefinition, ToolHost, declaration_sha256, effect_name
from .v1 import common_pb2, toolhost_pb2

__all__ = ["LocalAuthority"]


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class LocalAuthority:
    """Signs calls as policy and acknowledges them as the ledger, with local keys."""

    def __init__(self) -> None:
        self.policy_key = Ed25519PrivateKey.generate()
        self.ledger_key = Ed25519PrivateKey.generate()
        #: The declarations of the tools of the hosts built here: authorizations name them, as
        #: the mesh's name the declaration a run pinned.
        self.declared: dict[str, common_pb2.ToolSpec] = {}

    @property
    def policy_keys(self) -> dict[str, bytes]:
        return {key_id(_raw(self.policy_key)): _raw(self.policy_key)}

    @property
    def ledger_keys(self) -> dict[str, bytes]:
        return {key_id(_raw(self.ledger_key)): _raw(self.ledger_key)}

    def host(
        self,
        tools: Iterable[ToolDefinition] = (),
        *,
        state_path: str | os.PathLike[str],
        clock: Callable[[], int] | None = None,
    ) -> ToolHost:
        """A host trusting only this authority's keys (it never contacts a mesh)."""
        extra: dict[str, Any] = {"clock": clock} if clock else {}
        tools = list(tools)
        self.declared.update({t.name: t.spec() for t in tools})
        return ToolHost(
            tools, state_path=state_path, policy_keys=self.policy_keys, ledger_keys=self.ledger_keys, **extra
        )

    def request(
        self,
        tool: str,
        args: Any,
        *,
        tenant: str = "acme",
        run_id: str = "run1",
        step_id: str = "s1",
        attempt: int = 1,
        idempotency_key: str | None = None,
        decision_id: str = "d1",
        capability_id: str = "",
        expires_in_ms: int = 60_000,
        acknowledged: bool = True,
        declared: bool = True,
        effect: str | None = None,
    ) -> toolhost_pb2.InvokeRequest:
        """An ``InvokeRequest`` for one call, authorized and (unless ``acknowledged`` is
        false) acknowledged like the mesh would. The authorization names the tool's declaration
        (digest and effect class) when a host built here declares it, unless ``declared`` is
        false; ``effect`` overrides the class it names."""
        key = idempotency_key or f"{run_id}:{step_id}:{attempt}"
        now = int(time.time() * 1000)
        spec = self.declared.get(tool) if declared else None
        named: dict[str, str] = {}
        if spec is not None:
            named = {"tool_version": spec.version, "tool_sha256": declaration_sha256(spec), "effect": effect_name(spec)}
        if effect is not None:
            named["effect"] = effect
        claims = AuthorizationClaims(
            v=1,
            key_id="",
            decision_id=decision_id,
            tenant=tenant,
            run_id=run_id,
            step_id=step_id,
            attempt=attempt,
            tool=tool,
            args_sha256=args_digest(args),
            idempotency_key=key,
            capability_id=capability_id,
            issued_at_ms=now,
            expires_at_ms=now + expires_in_ms,
            **named,
        )
        auth = sign_claims(claims, self.policy_key)
        req = toolhost_pb2.InvokeRequest(
            tenant=tenant,
            run_id=run_id,
            step_id=step_id,
            attempt=attempt,
            tool=tool,
            args_json=canonical_json(args),
            idempotency_key=key,
            authorization=common_pb2.SignedAuthorization(
                claims_json=auth.claims_json, signature=auth.signature, key_id=auth.key_id
            ),
        )
        if acknowledged:
            ack = sign_claims(
                RequestAckClaims(
                    v=1,
                    kind="",
                    key_id="",
                    tenant=tenant,
                    run_id=run_id,
                    step_id=step_id,
                    attempt=attempt,
                    decision_id=decision_id,
                    idempotency_key=key,
                    seq=3,
                    event_hash="0" * 64,
                ),
                self.ledger_key,
            )
            req.request_ack.CopyFrom(
                common_pb2.SignedAuthorization(claims_json=ack.claims_json, signature=ack.signature, key_id=ack.key_id)
            )
        return req
