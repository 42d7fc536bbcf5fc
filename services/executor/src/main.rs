//! `warden-executor`: the executor as its own process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let l = warden_grpc::launch::launch("warden-executor", "executor", |c| &c.executor.listen).await?;
    warden_executor::serve(&l.config.executor, l.tokens, l.listener, warden_grpc::shutdown_signal()).await
}
