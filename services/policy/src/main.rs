//! `warden-policy`: the policy service as its own process.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    warden_grpc::launch::run(warden_grpc::launch::Flavor::CurrentThread, async {
        let l = warden_grpc::launch::launch("warden-policy", "policy", |c| (&c.policy.listen, &c.policy.listen_unix))
            .await?;
        let served = warden_policy::serve(&l.config.policy, l.tokens, l.listener, warden_grpc::shutdown_signal()).await;
        // Last: the spans of the stop included.
        l.telemetry.shutdown().await;
        served
    })
}
