//! `warden-otlp-receiver [GRPC_ADDR [HTTP_ADDR]]`: a local OTLP trace receiver for benchmarks
//! (defaults 127.0.0.1:4317 and 127.0.0.1:4318). It counts the spans it receives, prints the
//! count every 10 s and on SIGINT/SIGTERM, and keeps nothing.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let grpc = args.next().unwrap_or_else(|| "127.0.0.1:4317".into());
    let http = args.next().unwrap_or_else(|| "127.0.0.1:4318".into());
    let receiver = warden_testkit::otlp::OtlpReceiver::start_on(&grpc, &http, false).await?;
    println!("otlp receiver: grpc {} http {}", receiver.grpc_endpoint, receiver.http_endpoint);
    let stop = warden_grpc::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(std::time::Duration::from_secs(10)) => println!("spans received: {}", receiver.count()),
        }
    }
    println!("spans received: {}", receiver.count());
    Ok(())
}
