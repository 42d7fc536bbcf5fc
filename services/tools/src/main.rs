//! `warden-tools`: the demo tool host as its own process.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // With one worker too, the multi-threaded runtime: a call waiting on the state file hands the
    // host's other calls to another thread (`block_in_place`).
    use warden_grpc::launch::{Flavor, main};
    main(
        "warden-tools",
        "tools",
        |c| (&c.tools.listen, &c.tools.listen_unix),
        Flavor::MultiThread,
        |config, tokens, listener| async move {
            warden_tools::serve(&config.tools, tokens, listener, warden_grpc::shutdown_signal()).await
        },
    )
}
