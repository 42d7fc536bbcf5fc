//! `warden-tools`: the demo tool host as its own process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let l = warden_grpc::launch::launch("warden-tools", "tools", |c| &c.tools.listen).await?;
    warden_tools::serve(&l.config.tools, l.tokens, l.listener, warden_grpc::shutdown_signal()).await
}
