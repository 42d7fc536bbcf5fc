//! Generates the warden.v1 code with a vendored `protoc`, so the build needs no system protoc.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files: Vec<PathBuf> = ["common", "runs", "planner", "policy", "ledger", "toolhost"]
        .iter()
        .map(|f| root.join(format!("warden/v1/{f}.proto")))
        .collect();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut protoc = protoc_bin_vendored::protoc_bin_path()?;
    if let Ok(system) = std::env::var("PROTOC") {
        protoc = PathBuf::from(system);
    }
    // SAFETY: build scripts are single-threaded; tonic-prost-build reads PROTOC from the env.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    tonic_prost_build::configure()
        .build_client(std::env::var("CARGO_FEATURE_CLIENT").is_ok())
        .build_server(std::env::var("CARGO_FEATURE_SERVER").is_ok())
        .file_descriptor_set_path(out.join("warden_descriptor.bin"))
        .compile_protos(&files, &[root])?;
    Ok(())
}
