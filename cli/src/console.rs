//! `warden console`: the web console (runs, the approval inbox, receipts, capabilities) served
//! on its own address, backed by the mesh's gRPC services. It keeps no authority: each request
//! presents the viewer's own bearer token to the mesh.

use warden_console::MeshEndpoints;

use crate::Target;

#[derive(clap::Args)]
pub struct ConsoleArgs {
    /// Address to serve the console on (port 0 picks a free port). Off loopback, put it behind
    /// TLS: the page sends bearer tokens.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: String,
}

/// Where the console listens by default, beside `warden dev`'s 7100.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7180";

/// Serves the console for the mesh at `target` (`--endpoint`, `--ledger-endpoint`,
/// `--policy-endpoint`) until Ctrl-C.
pub async fn run(target: &Target, policy_endpoint: &str, args: ConsoleArgs) -> anyhow::Result<i32> {
    let _telemetry = warden_telemetry::init_tracing("warden-console", &Default::default())?;
    let listener = warden_grpc::bind(&args.listen).await?;
    let url = format!("{}/", warden_grpc::endpoint_of(listener.local_addr()?));
    let mesh = MeshEndpoints {
        runs: target.endpoint.clone(),
        ledger: target.ledger_endpoint.clone(),
        policy: policy_endpoint.to_string(),
    };
    println!("console: {url}");
    println!("warden console: mesh at {} (ledger {}, policy {})", mesh.runs, mesh.ledger, mesh.policy);
    warden_console::serve(listener, mesh, warden_grpc::shutdown_signal()).await?;
    Ok(0)
}
