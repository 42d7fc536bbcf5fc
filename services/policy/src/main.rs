//! `warden-policy`: the policy service as its own process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let l = warden_grpc::launch::launch("warden-policy", "policy", |c| &c.policy.listen).await?;
    warden_policy::serve(&l.config.policy, l.tokens, l.listener, warden_grpc::shutdown_signal()).await
}
