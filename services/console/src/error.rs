//! The API's errors: one JSON shape, `{"error": {"code", "message", "field"?}}`, with the HTTP
//! status a browser and a person understand. gRPC codes from the mesh map one to one.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Code;

/// An error the API answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// A stable, lower-case code (`invalid_argument`, `unauthenticated`, …) the page switches on.
    pub code: &'static str,
    pub message: String,
    /// The request field at fault, for invalid input.
    pub field: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), field: None }
    }

    /// 400 naming the field and why.
    pub fn invalid(field: impl Into<String>, why: impl std::fmt::Display) -> ApiError {
        let field = field.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_argument",
            message: format!("{field}: {why}"),
            field: Some(field),
        }
    }

    pub fn unauthenticated(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "permission_denied", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// The mesh answered something the console cannot read.
    pub fn bad_gateway(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_GATEWAY, "bad_gateway", message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status.as_u16(), self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// The mesh's answer, as HTTP: the field of an `INVALID_ARGUMENT` travels along.
impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> ApiError {
        let message = s.message().to_string();
        let (status, code) = match s.code() {
            Code::InvalidArgument | Code::OutOfRange => (StatusCode::BAD_REQUEST, "invalid_argument"),
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_denied"),
            Code::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            Code::AlreadyExists | Code::Aborted => (StatusCode::CONFLICT, "conflict"),
            Code::FailedPrecondition => (StatusCode::CONFLICT, "failed_precondition"),
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted"),
            Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded"),
            Code::Unimplemented => (StatusCode::NOT_IMPLEMENTED, "unimplemented"),
            Code::Cancelled => (StatusCode::SERVICE_UNAVAILABLE, "cancelled"),
            Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => (StatusCode::BAD_GATEWAY, "mesh_error"),
        };
        let field = warden_grpc::field_violations(&s).into_iter().next().map(|(f, _)| f);
        // A connection that never opened reads as "transport error": say what it means.
        let message = if s.code() == Code::Unavailable && !message.contains("mesh") {
            format!("the mesh is unreachable: {message}")
        } else {
            message
        };
        ApiError { status, code, message, field }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"error": {"code": self.code, "message": self.message}});
        if let Some(f) = &self.field {
            body["error"]["field"] = json!(f);
        }
        crate::views::json_response(self.status, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_to_http() {
        let cases = [
            (tonic::Status::unauthenticated("x"), StatusCode::UNAUTHORIZED),
            (tonic::Status::permission_denied("x"), StatusCode::FORBIDDEN),
            (tonic::Status::invalid_argument("x"), StatusCode::BAD_REQUEST),
            (tonic::Status::not_found("x"), StatusCode::NOT_FOUND),
            (tonic::Status::failed_precondition("x"), StatusCode::CONFLICT),
            (tonic::Status::unavailable("x"), StatusCode::SERVICE_UNAVAILABLE),
            (tonic::Status::internal("x"), StatusCode::BAD_GATEWAY),
        ];
        for (s, want) in cases {
            assert_eq!(ApiError::from(s).status, want);
        }
    }

    #[test]
    fn a_field_violation_names_the_field() {
        let e = ApiError::from(warden_grpc::invalid_field("tool_patterns[0]", "bad pattern"));
        assert_eq!((e.status, e.field.as_deref()), (StatusCode::BAD_REQUEST, Some("tool_patterns[0]")));
    }
}
