"""Warden's Python SDK.

- :class:`Client` / :class:`AsyncClient`: submit runs (a plan or a goal), wait for them, stream
  their events, read runs, traces and receipts, cancel and reconcile, resolve approvals,
  manage capabilities, and verify runs — by the ledger, or here from an export.
- :class:`ToolHost` and :func:`tool`: serve Python functions as Warden tools; every call is
  verified (the policy's signed authorization and the ledger's acknowledgement) before the
  function runs, and its first outcome is kept durably per idempotency key.
- :func:`verify_export_file`: check a ``warden run export`` file offline, with the algorithm
  of ``warden ledger verify-file``.
- :mod:`warden_sdk.v1`: the generated contract (messages and gRPC stubs).
"""

from .auth import AuthError, AuthorizationClaims, RequestAckClaims
from .canonical import args_digest, canonical_json
from .client import SETTLED, TERMINAL, AsyncClient, Client, status_name
from .errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    WardenError,
)
from .export import ExportError, ExportReport, verify_export, verify_export_file
from .host import Effect, InvokeRefused, RetryPolicy, ToolContext, ToolDefinition, ToolFailure, ToolHost, tool

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "SETTLED",
    "TERMINAL",
    "status_name",
    "ToolHost",
    "ToolDefinition",
    "ToolContext",
    "ToolFailure",
    "InvokeRefused",
    "RetryPolicy",
    "Effect",
    "tool",
    "verify_export",
    "verify_export_file",
    "ExportError",
    "ExportReport",
    "canonical_json",
    "args_digest",
    "AuthError",
    "AuthorizationClaims",
    "RequestAckClaims",
    "WardenError",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Unauthenticated",
    "FailedPrecondition",
    "Unavailable",
    "Unimplemented",
]
