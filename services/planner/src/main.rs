//! `warden-planner`: the planner service as its own process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let l = warden_grpc::launch::launch("warden-planner", "planner", |c| &c.planner.listen).await?;
    warden_planner::serve(&l.config.planner, l.tokens, l.listener, warden_grpc::shutdown_signal()).await
}
