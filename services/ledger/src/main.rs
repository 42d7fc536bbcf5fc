//! `warden-ledger`: the ledger service as its own process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let l = warden_grpc::launch::launch("warden-ledger", "ledger", |c| &c.ledger.listen).await?;
    warden_ledger::serve(&l.config.ledger, l.tokens, l.listener, warden_grpc::shutdown_signal()).await
}
