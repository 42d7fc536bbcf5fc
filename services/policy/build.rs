// Re-embed migrations when they change.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
