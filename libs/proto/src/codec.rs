//! The codec of every generated client and server (`codec_path` in build.rs): prost's, plus
//! the string check on each decoded request.
//!
//! Checking in the decoder covers every RPC, unary and streaming, without touching a handler:
//! a decoder error is answered by tonic as the call's status (with its details) before the
//! handler runs. Clients decode with the same codec, but only responses, and a response type
//! is never checked (`CheckStrings::CHECK_ON_DECODE` is true for RPC inputs only; build.rs
//! refuses a contract where one type is both), so a stored or tool-produced string is always
//! delivered to the caller, whatever it contains.

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::check::{CheckStrings, check_request};

/// [`ProstCodec`] whose decoder refuses a request holding a string that cannot be stored.
#[derive(Debug, Clone)]
pub struct CheckedCodec<T, U> {
    inner: ProstCodec<T, U>,
}

impl<T, U> Default for CheckedCodec<T, U> {
    fn default() -> Self {
        Self { inner: ProstCodec::default() }
    }
}

impl<T, U> Codec for CheckedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + CheckStrings + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.inner.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder { inner: self.inner.decoder() }
    }
}

/// [`ProstDecoder`] followed by [`check_request`] for RPC input types.
#[derive(Debug, Clone)]
pub struct CheckedDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: Message + Default + CheckStrings> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let item = self.inner.decode(buf)?;
        if U::CHECK_ON_DECODE
            && let Some(message) = &item
        {
            check_request(message)?;
        }
        Ok(item)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

#[cfg(all(test, feature = "client", feature = "server"))]
mod tests {
    //! Through a real tonic server and client on a local socket: the decoder's status must
    //! reach the caller with its details for unary and server-streaming RPCs, and responses
    //! must pass whatever they hold.

    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tonic::{Code, Request, Response, Status};
    use tonic_types::StatusExt;

    use crate::v1 as pb;
    use crate::v1::approvals_client::ApprovalsClient;
    use crate::v1::approvals_server::{Approvals, ApprovalsServer};
    use crate::v1::tool_host_client::ToolHostClient;
    use crate::v1::tool_host_server::{ToolHost, ToolHostServer};

    /// Answers every call with strings holding NUL bytes, and counts the calls that reached it.
    #[derive(Clone, Default)]
    struct Nul {
        handled: Arc<AtomicUsize>,
    }

    impl Nul {
        fn hit(&self) {
            self.handled.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn approval() -> pb::Approval {
        pb::Approval { reason: "stored\0as is".into(), ..Default::default() }
    }

    #[tonic::async_trait]
    impl ToolHost for Nul {
        async fn list_tools(
            &self,
            _: Request<pb::ListToolsRequest>,
        ) -> Result<Response<pb::ListToolsResponse>, Status> {
            self.hit();
            Ok(Response::new(pb::ListToolsResponse::default()))
        }

        async fn invoke(&self, _: Request<pb::InvokeRequest>) -> Result<Response<pb::InvokeResponse>, Status> {
            self.hit();
            let outcome = pb::invoke_response::Outcome::OutputJson("\"a\\u0000b\0\"".into());
            Ok(Response::new(pb::InvokeResponse { outcome: Some(outcome), replayed: false }))
        }
    }

    #[tonic::async_trait]
    impl Approvals for Nul {
        type WatchStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::Approval, Status>>>;

        async fn list(
            &self,
            _: Request<pb::ListApprovalsRequest>,
        ) -> Result<Response<pb::ListApprovalsResponse>, Status> {
            self.hit();
            Ok(Response::new(pb::ListApprovalsResponse { approvals: vec![approval()], ..Default::default() }))
        }

        async fn get(&self, _: Request<pb::GetApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
            self.hit();
            Ok(Response::new(approval()))
        }

        async fn approve(&self, _: Request<pb::ResolveApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
            self.hit();
            Ok(Response::new(approval()))
        }

        async fn deny(&self, _: Request<pb::ResolveApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
            self.hit();
            Ok(Response::new(approval()))
        }

        async fn watch(&self, _: Request<pb::WatchApprovalsRequest>) -> Result<Response<Self::WatchStream>, Status> {
            self.hit();
            Ok(Response::new(tokio_stream::iter(vec![Ok(approval()), Ok(approval())])))
        }
    }

    async fn serve(service: Nul) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let router = tonic::transport::Server::builder()
            .add_service(ToolHostServer::new(service.clone()))
            .add_service(ApprovalsServer::new(service));
        tokio::spawn(router.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)));
        addr
    }

    #[track_caller]
    fn assert_refused(status: &Status, field: &str) {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let violations = status.get_details_bad_request().expect("BadRequest details").field_violations;
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(violations[0].field, field);
        assert!(violations[0].description.contains("NUL"), "{violations:?}");
        assert!(status.message().starts_with(&format!("{field}: ")), "{}", status.message());
    }

    #[tokio::test]
    async fn nul_in_a_request_reaches_the_client_as_invalid_argument_and_nul_in_a_response_passes() {
        let service = Nul::default();
        let handled = service.handled.clone();
        let endpoint = format!("http://{}", serve(service).await);
        let mut tools = ToolHostClient::connect(endpoint.clone()).await.expect("connect");
        let mut approvals = ApprovalsClient::connect(endpoint).await.expect("connect");

        // Unary, nested field: refused before the handler.
        let auth = pb::SignedAuthorization { key_id: "k\0".into(), ..Default::default() };
        let req = pb::InvokeRequest { authorization: Some(auth), ..Default::default() };
        let e = tools.invoke(req).await.expect_err("refused");
        assert_refused(&e, "authorization.key_id");
        // Server streaming: the status of the call itself.
        let e = approvals.watch(pb::WatchApprovalsRequest { tenant: "t\0".into() }).await.expect_err("refused");
        assert_refused(&e, "tenant");
        let req = pb::ResolveApprovalRequest { approver: "\0".into(), ..Default::default() };
        assert_refused(&approvals.approve(req).await.expect_err("refused"), "approver");
        assert_eq!(handled.load(Ordering::SeqCst), 0, "no refused request reached a handler");

        // Responses are decoded by the client with the same codec and never refused.
        let out = tools.invoke(pb::InvokeRequest::default()).await.expect("response with NUL passes").into_inner();
        assert!(matches!(out.outcome, Some(pb::invoke_response::Outcome::OutputJson(s)) if s.contains('\0')));
        let listed = approvals.list(pb::ListApprovalsRequest::default()).await.expect("list").into_inner();
        assert_eq!(listed.approvals, vec![approval()]);
        let mut stream = approvals.watch(pb::WatchApprovalsRequest::default()).await.expect("watch").into_inner();
        let mut seen = 0;
        while let Some(a) = stream.message().await.expect("streamed response with NUL passes") {
            assert_eq!(a, approval());
            seen += 1;
        }
        assert_eq!(seen, 2);
        assert_eq!(handled.load(Ordering::SeqCst), 3);
    }
}
