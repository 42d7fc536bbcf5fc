//! The mesh as the console reaches it: one lazily connected channel per service, and per request
//! a client that presents the caller's own token — never the console's.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use warden_grpc::auth::{Bearer, Ch};
use warden_proto::v1::approvals_client::ApprovalsClient;
use warden_proto::v1::capabilities_client::CapabilitiesClient;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::runs_client::RunsClient;

use crate::error::ApiError;

/// Where the mesh's services are (`warden dev` serves them all on one endpoint).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshEndpoints {
    /// The executor's `Runs` service (the front door).
    pub runs: String,
    pub ledger: String,
    /// The policy service (`Approvals`, `Capabilities`).
    pub policy: String,
}

impl MeshEndpoints {
    /// Every service on one endpoint, as `warden dev` serves them.
    pub fn single(endpoint: &str) -> MeshEndpoints {
        MeshEndpoints { runs: endpoint.into(), ledger: endpoint.into(), policy: endpoint.into() }
    }
}

/// How long a unary call may take before the page hears `504`; streams are not bounded.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Clone)]
pub struct Mesh {
    runs: Channel,
    ledger: Channel,
    policy: Channel,
}

fn channel(endpoint: &str) -> Result<Channel, ApiError> {
    Ok(Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| ApiError::invalid("endpoint", format!("'{endpoint}' is not a valid endpoint: {e}")))?
        // A mesh that is down answers `503` quickly instead of hanging the page.
        .connect_timeout(Duration::from_secs(2))
        .initial_connection_window_size(warden_grpc::CONNECTION_WINDOW)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .connect_lazy())
}

/// The caller's token as a client interceptor (a token that is not header text is refused).
fn as_caller(token: &str) -> Result<Bearer, ApiError> {
    Bearer::new(Some(token)).map_err(|_| ApiError::unauthenticated("the token is not valid header text"))
}

impl Mesh {
    pub fn new(endpoints: &MeshEndpoints) -> Result<Mesh, ApiError> {
        Ok(Mesh {
            runs: channel(&endpoints.runs)?,
            ledger: channel(&endpoints.ledger)?,
            policy: channel(&endpoints.policy)?,
        })
    }

    fn with(&self, channel: &Channel, token: &str) -> Result<Ch, ApiError> {
        Ok(InterceptedService::new(warden_grpc::eager::Eager::new(channel.clone().into()), as_caller(token)?))
    }

    pub fn runs(&self, token: &str) -> Result<RunsClient<Ch>, ApiError> {
        Ok(limits(RunsClient::new(self.with(&self.runs, token)?)))
    }

    pub fn ledger(&self, token: &str) -> Result<LedgerClient<Ch>, ApiError> {
        Ok(LedgerClient::new(self.with(&self.ledger, token)?).max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES))
    }

    pub fn approvals(&self, token: &str) -> Result<ApprovalsClient<Ch>, ApiError> {
        Ok(ApprovalsClient::new(self.with(&self.policy, token)?))
    }

    pub fn capabilities(&self, token: &str) -> Result<CapabilitiesClient<Ch>, ApiError> {
        Ok(CapabilitiesClient::new(self.with(&self.policy, token)?))
    }
}

fn limits(c: RunsClient<Ch>) -> RunsClient<Ch> {
    c.max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES)
}

/// A unary request with the console's deadline.
pub fn request<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(CALL_TIMEOUT);
    r
}
