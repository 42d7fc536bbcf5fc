//! The machine's own units, printed before `warden bench`'s step figures: what one Ed25519
//! signature and verification, one durable 8 kB write and one loopback round trip — between
//! two threads on one vCPU, and across two — cost here.
//!
//! A production step is made of these (four signatures and three verifications, one commit's
//! fdatasync, three round trips between services and one to the database), and the machines
//! the figures are taken on differ by a third and more in them. Printed beside the figures,
//! they say which entries of BENCHMARKS.md compare. Measured in well under a second, before
//! anything else runs; the median of each, so one preempted sample does not move it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ed25519_dalek::{Signer, SigningKey, Verifier};

/// Samples of each figure.
const SAMPLES: usize = 400;
/// Durable writes sampled (each is a disk flush).
const SYNCS: usize = 50;

/// The machine's units as one line, or what could not be measured.
pub fn units() -> String {
    let (sign, verify) = ed25519();
    let sync = match fdatasync() {
        Ok(d) => format!("{:.3}ms", ms(d)),
        Err(e) => format!("not measured ({e})"),
    };
    let trip = |cpus| match round_trip(cpus) {
        Ok(d) => format!("{:.3}ms", ms(d)),
        Err(e) => format!("not measured ({e})"),
    };
    let trips = match allowed_cpus().as_deref() {
        Ok([one, other, ..]) => format!("on one vCPU {}, across two {}", trip((*one, *one)), trip((*one, *other))),
        Ok([one]) => format!("on one vCPU {} (only one to run on)", trip((*one, *one))),
        Ok([]) => "not measured (no CPU to run on)".to_string(),
        Err(e) => format!("not measured ({e})"),
    };
    format!(
        "machine  ed25519-dalek sign {:.1}µs, verify {:.1}µs; 8 kB write + fdatasync in the temp dir {sync}; \
         loopback TCP round trip between two threads {trips} (medians)",
        us(sign),
        us(verify)
    )
}

fn ed25519() -> (Duration, Duration) {
    let key = SigningKey::from_bytes(&[42; 32]);
    let public = key.verifying_key();
    let message = [7u8; 256];
    let signature = key.sign(&message);
    let sign = median((0..SAMPLES).map(|_| {
        timed(|| {
            std::hint::black_box(key.sign(&message));
        })
    }));
    let verify = median((0..SAMPLES).map(|_| {
        timed(|| {
            let _ = std::hint::black_box(public.verify(&message, &signature));
        })
    }));
    (sign, verify)
}

/// An 8 kB page written and flushed (`File::sync_data`), as a commit flushes its WAL page.
fn fdatasync() -> std::io::Result<Duration> {
    let path = std::env::temp_dir().join(format!("warden-bench-fdatasync-{}", std::process::id()));
    let measured = (|| {
        let mut file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
        let page = [0u8; 8192];
        let mut samples = Vec::with_capacity(SYNCS);
        for _ in 0..SYNCS {
            let start = Instant::now();
            file.write_all(&page)?;
            file.sync_data()?;
            samples.push(start.elapsed());
        }
        Ok(median(samples.into_iter()))
    })();
    let _ = std::fs::remove_file(&path);
    measured
}

/// One byte there and back over loopback TCP (no Nagle) between two threads of their own,
/// each pinned to `cpus` (the first, the caller; the second, the answerer): on one vCPU, an
/// answer is a switch on a running core; across two, it wakes the other.
fn round_trip(cpus: (usize, usize)) -> std::io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        pin(cpus.1)?;
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        while s.read(&mut b)? == 1 {
            s.write_all(&b)?;
        }
        Ok(())
    });
    let caller = std::thread::spawn(move || -> std::io::Result<Duration> {
        pin(cpus.0)?;
        let mut s = TcpStream::connect(address)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut b = [0u8; 1];
        let mut samples = Vec::with_capacity(SAMPLES);
        for _ in 0..SAMPLES {
            let start = Instant::now();
            s.write_all(&b)?;
            s.read_exact(&mut b)?;
            samples.push(start.elapsed());
        }
        Ok(median(samples.into_iter()))
    });
    let measured = caller.join().unwrap_or_else(|_| Err(std::io::Error::other("the calling thread panicked")));
    // The answerer ends when the caller's connection closes. A caller that failed before it
    // connected leaves the answerer in `accept`: this connection, closed at once, releases it
    // (refused, and of no matter, when the answerer has ended already).
    if measured.is_err() {
        let _ = TcpStream::connect(address);
    }
    let answered = echo.join().unwrap_or_else(|_| Err(std::io::Error::other("the answering thread panicked")));
    let measured = measured?;
    answered?;
    Ok(measured)
}

/// The CPUs this process may run on, in order. `sched_getaffinity` and `sched_setaffinity`
/// through libc (already a dependency), as the test kit calls `prctl`: two calls do not need a
/// crate of their own.
#[allow(unsafe_code)]
fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: `set` is a plain bit set, zeroed, of the size passed; the call only writes it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Pins the calling thread to `cpu`.
#[allow(unsafe_code)]
fn pin(cpu: usize) -> std::io::Result<()> {
    // SAFETY: as in `allowed_cpus`; `cpu` is below CPU_SETSIZE (it came from there).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

fn median(samples: impl Iterator<Item = Duration>) -> Duration {
    let mut all: Vec<Duration> = samples.collect();
    all.sort_unstable();
    all.get(all.len() / 2).copied().unwrap_or_default()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit is measured on an ordinary machine (none is "not measured"), and the
    /// signature figures are real durations.
    #[test]
    fn the_machines_units_are_measured() {
        let line = units();
        assert!(!line.contains("not measured"), "{line}");
        let (sign, verify) = ed25519();
        assert!(sign > Duration::ZERO && verify > Duration::ZERO, "{sign:?} {verify:?}");
    }

    /// A round trip whose caller cannot be pinned (a CPU this machine does not have) is an
    /// error, and the answering thread does not wait for it for good.
    #[test]
    fn a_caller_that_cannot_start_is_an_error_not_a_hang() {
        let absent = libc::CPU_SETSIZE as usize - 1;
        let e = round_trip((absent, allowed_cpus().expect("cpus")[0])).expect_err("no such CPU");
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    }
}
