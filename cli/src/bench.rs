//! `warden bench` (filled in below).
#[derive(clap::Args)]
pub struct BenchArgs {}
pub async fn run(_: BenchArgs) -> anyhow::Result<i32> {
    anyhow::bail!("bench is being written")
}
