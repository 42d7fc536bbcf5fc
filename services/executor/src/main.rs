//! `warden-executor`: the executor as its own process.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    use warden_grpc::launch::{Flavor, main};
    main(
        "warden-executor",
        "executor",
        |c| (&c.executor.listen, &c.executor.listen_unix),
        Flavor::CurrentThread,
        |config, tokens, listener| async move {
            warden_executor::serve(&config.executor, tokens, listener, warden_grpc::shutdown_signal()).await
        },
    )
}
