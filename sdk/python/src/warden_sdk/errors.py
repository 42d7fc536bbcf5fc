"""Errors: a refused request names its gRPC code and, for bad input, each field and why.

Warden's services attach ``google.rpc`` details to refusals (``BadRequest`` field violations
for ``INVALID_ARGUMENT``, ``ErrorInfo`` such as ``STALE_EPOCH`` for fencing). A caller that
only saw the status text would have to parse prose to learn *which* field was wrong, so the
client decodes the details into :attr:`WardenError.field_violations` and
:attr:`WardenError.reason`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "FieldViolation",
    "WardenError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Unauthenticated",
    "FailedPrecondition",
    "Unavailable",
    "Unimplemented",
    "DeadlineExceeded",
    "from_rpc_error",
    "DETAILS_KEY",
]

DETAILS_KEY = "grpc-status-details-bin"
"""Trailing metadata key carrying a serialized ``google.rpc.Status``."""


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: its path (``plan_json.steps[b].depends_on``) and why."""

    field: str
    description: str


class WardenError(Exception):
    """A request Warden refused or could not answer."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field_violations: Iterable[FieldViolation] = (),
        reason: str = "",
    ) -> None:
        violations = list(field_violations)
        text = f"{code.name}: {message}"
        if violations:
            text += "".join(f"\n  {v.field}: {v.description}" for v in violations)
        super().__init__(text)
        self.code = code
        self.message = message
        self.field_violations = violations
        self.reason = reason


class InvalidArgument(WardenError):
    """The request is malformed; :attr:`field_violations` says where."""


class NotFound(WardenError):
    """No such run, approval or capability (another tenant's reads as missing)."""


class PermissionDenied(WardenError):
    """The caller's token may not do this (or a tool host refused an unproven call)."""


class Unauthenticated(WardenError):
    """A missing or unknown token."""


class FailedPrecondition(WardenError):
    """The request is well formed but the state forbids it (a stale epoch, a finished run)."""


class Unavailable(WardenError):
    """The service could not be reached or is shutting down; retrying may work."""


class Unimplemented(WardenError):
    """This Warden release does not serve the request (e.g. a run from a goal)."""


class DeadlineExceeded(WardenError):
    """No answer in time."""


_BY_CODE: dict[grpc.StatusCode, type[WardenError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _details(metadata: Any) -> tuple[list[FieldViolation], str]:
    violations: list[FieldViolation] = []
    reason = ""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    return violations, reason


def from_rpc_error(error: grpc.RpcError) -> WardenError:
    """The :class:`WardenError` for a failed call (sync or ``grpc.aio``)."""
    call: Any = error
    code = call.code() if hasattr(call, "code") else grpc.StatusCode.UNKNOWN
    message = (call.details() if hasattr(call, "details") else str(error)) or ""
    try:
        metadata = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
        violations, reason = _details(metadata)
    except Exception:  # malformed details must not hide the error itself
        violations, reason = [], ""
    cls = _BY_CODE.get(code, WardenError)
    return cls(code, message, field_violations=violations, reason=reason)
