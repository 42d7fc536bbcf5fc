//! Spawning children that die with this process.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, so every child
//! is forked by one keeper thread that lives as long as the process.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

type Job = (Command, libc::c_int, Sender<std::io::Result<Child>>);

fn keeper() -> &'static std::sync::Mutex<Sender<Job>> {
    static KEEPER: OnceLock<std::sync::Mutex<Sender<Job>>> = OnceLock::new();
    KEEPER.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("warden-testkit-keeper".into())
            .spawn(move || {
                for (mut cmd, signal, reply) in rx {
                    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
                    unsafe {
                        cmd.pre_exec(move || {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
                // The sender lives in a static, so this loop only ends with the process.
            })
            .expect("spawn keeper thread");
        std::sync::Mutex::new(tx)
    })
}

/// Spawns `cmd`; the child receives `signal` when this process exits.
pub fn spawn_tied(cmd: Command, signal: libc::c_int) -> std::io::Result<Child> {
    let (tx, rx) = channel();
    keeper().lock().unwrap_or_else(|p| p.into_inner()).send((cmd, signal, tx)).map_err(std::io::Error::other)?;
    rx.recv().map_err(std::io::Error::other)?
}

/// A free TCP port on loopback (bound and released; callers retry on a lost race).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub fn is_root() -> bool {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() == 0 }
}

/// Looks a binary up on PATH and in `extra` directories.
pub fn find_binary(name: &str, extra: &[std::path::PathBuf]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain(extra.iter().cloned()).map(|d| d.join(name)).find(|p| p.is_file())
}

/// `apt-get install -y PACKAGES` (as root), once per package set.
pub fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    anyhow::ensure!(
        is_root(),
        "{} is missing and installing it needs root: apt-get install {}",
        packages.join(" "),
        packages.join(" ")
    );
    eprintln!("warden-testkit: installing {} with apt-get", packages.join(" "));
    let update = Command::new("apt-get").args(["update", "-qq"]).status()?;
    anyhow::ensure!(update.success(), "apt-get update failed");
    let status = Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?;
    anyhow::ensure!(status.success(), "apt-get install {} failed", packages.join(" "));
    Ok(())
}
