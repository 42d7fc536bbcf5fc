//! `warden-otlp-receiver [--dump FILE] [GRPC_ADDR [HTTP_ADDR]]`: a local OTLP trace receiver
//! for benchmarks (defaults 127.0.0.1:4317 and 127.0.0.1:4318). It counts the spans it
//! receives and prints the count every 10 s and on SIGINT/SIGTERM. With `--dump`, it keeps
//! every span and writes them to FILE on exit, one JSON object a line (name, service, ids,
//! attributes, start and end in Unix nanoseconds): a timeline of the calls a run made.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dump = match args.iter().position(|a| a == "--dump") {
        Some(i) if i + 1 < args.len() => {
            let file = args.remove(i + 1);
            args.remove(i);
            Some(file)
        }
        Some(_) => anyhow::bail!("--dump needs a file"),
        None => None,
    };
    let mut args = args.into_iter();
    let grpc = args.next().unwrap_or_else(|| "127.0.0.1:4317".into());
    let http = args.next().unwrap_or_else(|| "127.0.0.1:4318".into());
    let receiver = warden_testkit::otlp::OtlpReceiver::start_on(&grpc, &http, dump.is_some()).await?;
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
    if let Some(file) = dump {
        let lines: Vec<String> = receiver.spans().iter().map(|s| s.to_json().to_string()).collect();
        std::fs::write(&file, lines.join("\n") + "\n")?;
        println!("spans written to {file}");
    }
    Ok(())
}
