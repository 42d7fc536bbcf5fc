//! `warden-ledger`: the ledger service as its own process.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    use warden_grpc::launch::{Flavor, main};
    main(
        "warden-ledger",
        "ledger",
        |c| (&c.ledger.listen, &c.ledger.listen_unix),
        Flavor::CurrentThread,
        |config, tokens, listener| async move {
            warden_ledger::serve(&config.ledger, tokens, listener, warden_grpc::shutdown_signal()).await
        },
    )
}
