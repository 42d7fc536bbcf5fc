//! `warden ledger verify-file`: verify an exported run with no server.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use ed25519_dalek::VerifyingKey;

#[derive(clap::Subcommand)]
pub enum LedgerCommand {
    /// Verify a `warden run export` file offline: chain, receipts and signed head. Prints
    /// `valid …` (exit 0) or `invalid: line N (seq S): reason` (exit 1).
    VerifyFile {
        file: PathBuf,
        /// The ledger public key to trust (64 hex chars); without it the file's own key is
        /// used and its id printed for comparison.
        #[arg(long)]
        key: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: LedgerCommand) -> anyhow::Result<i32> {
    match cmd {
        LedgerCommand::VerifyFile { file, key, json } => {
            let pinned = key
                .map(|k| -> anyhow::Result<VerifyingKey> {
                    let bytes: [u8; 32] = hex::decode(k.trim())?
                        .try_into()
                        .map_err(|_| anyhow::anyhow!("--key must be 32 bytes of hex"))?;
                    Ok(VerifyingKey::from_bytes(&bytes)?)
                })
                .transpose()?;
            let f = std::fs::File::open(&file).with_context(|| format!("opening {}", file.display()))?;
            let lines = std::io::BufReader::new(f).lines().map_while(Result::ok);
            match warden_core::export::verify(lines, pinned.as_ref()) {
                Ok(r) if json => println!(
                    "{}",
                    serde_json::json!({"valid": true, "run_id": r.run_id, "events": r.events, "receipts": r.receipts, "key_id": r.key_id})
                ),
                Ok(r) => println!(
                    "valid: run {} — {} events, {} receipts, head signed by key {}{}",
                    r.run_id,
                    r.events,
                    r.receipts,
                    r.key_id,
                    if pinned.is_some() { " (pinned)" } else { " (key from the file; pin it with --key)" }
                ),
                Err(e) if json => {
                    println!(
                        "{}",
                        serde_json::json!({"valid": false, "line": e.line, "seq": e.seq, "reason": e.reason})
                    );
                    return Ok(1);
                }
                Err(e) => {
                    println!("invalid: {e}");
                    return Ok(1);
                }
            }
            Ok(0)
        }
    }
}
