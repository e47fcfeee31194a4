//! TCP traffic that must never fail, for the end-to-end suite's disruption
//! scenarios (ambpf's DaemonSet restarted under load), run in pods:
//!
//! - `conn-generator echo --port P`: a server. A connection's first byte
//!   says what it is: `S` (short) is echoed and the server closes (so the
//!   server, not the client, keeps the TIME_WAIT); `L` (long) is echoed and
//!   so is everything after it, until the client closes.
//! - `conn-generator run --target ADDR:PORT ...`: opens a short connection
//!   every `--every-ms` (connect, a byte each way, the server's close), holds
//!   `--long` long connections open exchanging a message every
//!   `--exchange-ms`, and stops when `--stop-file` appears (or after
//!   `--max-secs`). It then prints one JSON line, `{"event":"summary",...}`:
//!   attempts, successes, connect failures, timeouts, resets, and how many
//!   long connections are still alive. It exits 0 either way: judging the
//!   numbers is the caller's.

use std::{
    io::{self, ErrorKind, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::ExitCode,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "conn-generator",
    about = "Short and long TCP connections, counting every failure"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The echo server the generator talks to.
    Echo {
        #[arg(long)]
        port: u16,
    },
    /// The generator.
    Run {
        #[arg(long)]
        target: SocketAddr,
        /// A new short connection this often.
        #[arg(long, default_value_t = 5)]
        every_ms: u64,
        /// Long connections held open for the whole run.
        #[arg(long, default_value_t = 8)]
        long: usize,
        /// A message on each long connection this often.
        #[arg(long, default_value_t = 100)]
        exchange_ms: u64,
        /// Connect, read and write timeout.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
        /// Short connections in flight at once, at most.
        #[arg(long, default_value_t = 32)]
        workers: usize,
        /// The run stops once this file exists.
        #[arg(long)]
        stop_file: PathBuf,
        /// ... or after this long.
        #[arg(long, default_value_t = 1800)]
        max_secs: u64,
    },
}

const SHORT: u8 = b'S';
const LONG: u8 = b'L';

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Echo { port } => serve_echo(port),
        Command::Run {
            target,
            every_ms,
            long,
            exchange_ms,
            timeout_ms,
            workers,
            stop_file,
            max_secs,
        } => {
            let run = Run {
                dialer: Dialer {
                    target,
                    timeout: Duration::from_millis(timeout_ms),
                },
                every: Duration::from_millis(every_ms),
                long,
                exchange_every: Duration::from_millis(exchange_ms),
                workers,
            };
            generate(&run, &stop_file, Duration::from_secs(max_secs))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("conn-generator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve_echo(port: u16) -> io::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port))?;
    println!("{{\"event\":\"listening\",\"port\":{port}}}");
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                thread::spawn(move || {
                    // A client gone mid-way is the client's to count.
                    let _ = echo(stream);
                });
            }
            Err(e) => eprintln!("accept: {e}"),
        }
    }
    Ok(())
}

fn echo(mut stream: TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut kind = [0u8; 1];
    stream.read_exact(&mut kind)?;
    stream.write_all(&kind)?;
    if kind[0] != LONG {
        return Ok(());
    }
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        stream.write_all(&buf[..n])?;
    }
}

struct Run {
    dialer: Dialer,
    every: Duration,
    long: usize,
    exchange_every: Duration,
    workers: usize,
}

/// Where connections go, and how long each step may take.
#[derive(Clone, Copy)]
struct Dialer {
    target: SocketAddr,
    timeout: Duration,
}

/// How a connection ended, when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The connect itself failed (refused, unreachable).
    Connect,
    /// No answer within the timeout (connect, read or write).
    Timeout,
    /// An established connection reset, broken or closed early.
    Reset,
    /// The peer answered something else than the echo.
    Garbled,
}

fn classify_connect(e: &io::Error) -> Failure {
    match e.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Failure::Timeout,
        _ => Failure::Connect,
    }
}

fn classify_established(e: &io::Error) -> Failure {
    match e.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Failure::Timeout,
        ErrorKind::InvalidData => Failure::Garbled,
        // ECONNRESET, EPIPE, ECONNABORTED, an EOF before the echo, and any
        // other error on an open connection: it was broken under us.
        _ => Failure::Reset,
    }
}

#[derive(Default)]
struct Counters {
    attempts: AtomicU64,
    succeeded: AtomicU64,
    connect_failed: AtomicU64,
    timeouts: AtomicU64,
    resets: AtomicU64,
    garbled: AtomicU64,
    long_exchanges: AtomicU64,
    /// The first few failures, with when they happened, for the report.
    first_errors: Mutex<Vec<String>>,
}

impl Counters {
    fn failed(&self, failure: Failure, what: &str, e: &io::Error, at: Duration) {
        let counter = match failure {
            Failure::Connect => &self.connect_failed,
            Failure::Timeout => &self.timeouts,
            Failure::Reset => &self.resets,
            Failure::Garbled => &self.garbled,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_errors.lock().unwrap_or_else(|p| p.into_inner());
        if first.len() < 10 {
            first.push(format!(
                "{:.3} s: {what}: {failure:?}: {e}",
                at.as_secs_f64()
            ));
        }
    }
}

#[derive(Serialize)]
struct Summary {
    event: &'static str,
    target: String,
    seconds: f64,
    attempts: u64,
    succeeded: u64,
    connect_failed: u64,
    timeouts: u64,
    resets: u64,
    garbled: u64,
    /// Achieved short connections per second.
    rate_per_s: f64,
    /// What `every_ms` asks for.
    wanted_per_s: f64,
    long_opened: usize,
    long_alive: usize,
    long_exchanges: u64,
    first_errors: Vec<String>,
}

/// How long the long connections may take to open, before the run.
const SETUP: Duration = Duration::from_secs(30);

fn generate(run: &Run, stop_file: &Path, max: Duration) -> io::Result<()> {
    // The image may have no /tmp: the stop file's directory is made here,
    // so that the caller only has to create the file.
    if let Some(dir) = stop_file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let started = Instant::now();
    let counters = Arc::new(Counters::default());
    let stopping = Arc::new(AtomicBool::new(false));
    let mut long = Vec::new();
    // The Service may route a moment after its pod is Ready (kube-proxy
    // programs it on its next sync), so opening the long connections is
    // retried for a while; the measured load starts only once all are open.
    let setup_deadline = Instant::now() + SETUP;
    for i in 0..run.long {
        let stream = loop {
            match open(run.dialer, LONG) {
                Ok(stream) => break stream,
                Err(_) if Instant::now() < setup_deadline => {
                    thread::sleep(Duration::from_millis(200));
                }
                Err((_, e)) => {
                    return Err(io::Error::other(format!(
                        "long {i}: {e} (still, after {} s of trying)",
                        SETUP.as_secs()
                    )));
                }
            }
        };
        let (counters, stopping) = (counters.clone(), stopping.clone());
        let every = run.exchange_every;
        long.push(thread::spawn(move || {
            hold(stream, every, &stopping, &counters, started)
        }));
    }
    println!(
        "{{\"event\":\"started\",\"target\":\"{}\",\"long\":{}}}",
        run.dialer.target, run.long
    );
    let (ticks, queue) = mpsc::sync_channel::<()>(run.workers * 4);
    let queue = Arc::new(Mutex::new(queue));
    let workers: Vec<_> = (0..run.workers)
        .map(|_| {
            let (queue, counters) = (queue.clone(), counters.clone());
            let dialer = run.dialer;
            thread::spawn(move || {
                loop {
                    let tick = queue.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    if tick.is_err() {
                        return;
                    }
                    counters.attempts.fetch_add(1, Ordering::Relaxed);
                    match short_connection(dialer) {
                        Ok(()) => {
                            counters.succeeded.fetch_add(1, Ordering::Relaxed);
                        }
                        Err((failure, e)) => {
                            counters.failed(failure, "short", &e, started.elapsed())
                        }
                    }
                }
            })
        })
        .collect();
    // A fixed schedule: a late tick is sent at once, so the rate holds
    // unless the workers fall behind (then `send` waits, and the achieved
    // rate shows it).
    let mut next = Instant::now();
    while !stop_file.exists() && started.elapsed() < max {
        if ticks.send(()).is_err() {
            break;
        }
        next += run.every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(ticks);
    for worker in workers {
        let _ = worker.join();
    }
    stopping.store(true, Ordering::Relaxed);
    let long_alive = long
        .into_iter()
        .map(|h| h.join().unwrap_or(false))
        .filter(|alive| *alive)
        .count();
    let c = &counters;
    let attempts = c.attempts.load(Ordering::Relaxed);
    let summary = Summary {
        event: "summary",
        target: run.dialer.target.to_string(),
        seconds,
        attempts,
        succeeded: c.succeeded.load(Ordering::Relaxed),
        connect_failed: c.connect_failed.load(Ordering::Relaxed),
        timeouts: c.timeouts.load(Ordering::Relaxed),
        resets: c.resets.load(Ordering::Relaxed),
        garbled: c.garbled.load(Ordering::Relaxed),
        rate_per_s: attempts as f64 / seconds,
        wanted_per_s: 1.0 / run.every.as_secs_f64(),
        long_opened: run.long,
        long_alive,
        long_exchanges: c.long_exchanges.load(Ordering::Relaxed),
        first_errors: std::mem::take(
            &mut *c.first_errors.lock().unwrap_or_else(|p| p.into_inner()),
        ),
    };
    println!(
        "{}",
        serde_json::to_string(&summary).map_err(io::Error::other)?
    );
    Ok(())
}

/// Connects and says which kind of connection this is; the echo of that
/// byte is read back.
fn open(dialer: Dialer, kind: u8) -> Result<TcpStream, (Failure, io::Error)> {
    let mut stream = TcpStream::connect_timeout(&dialer.target, dialer.timeout)
        .map_err(|e| (classify_connect(&e), e))?;
    // The local port names the connection in ztunnel's log.
    let local = stream.local_addr().ok();
    let established = move |e: io::Error| (classify_established(&e), from(local, e));
    stream
        .set_read_timeout(Some(dialer.timeout))
        .map_err(established)?;
    stream
        .set_write_timeout(Some(dialer.timeout))
        .map_err(established)?;
    stream.set_nodelay(true).map_err(established)?;
    stream.write_all(&[kind]).map_err(established)?;
    expect_echo(&mut stream, &[kind]).map_err(established)?;
    Ok(stream)
}

/// One short connection: the kind byte each way, then the server's close.
fn short_connection(dialer: Dialer) -> Result<(), (Failure, io::Error)> {
    let mut stream = open(dialer, SHORT)?;
    let local = stream.local_addr().ok();
    let mut rest = [0u8; 1];
    match stream.read(&mut rest) {
        Ok(0) => Ok(()),
        Ok(_) => Err((
            Failure::Garbled,
            from(
                local,
                io::Error::new(ErrorKind::InvalidData, "bytes after the echo"),
            ),
        )),
        Err(e) => Err((classify_established(&e), from(local, e))),
    }
}

/// `e`, saying which local address the connection had.
fn from(local: Option<SocketAddr>, e: io::Error) -> io::Error {
    match local {
        Some(local) => io::Error::new(e.kind(), format!("from {local}: {e}")),
        None => e,
    }
}

fn expect_echo(stream: &mut TcpStream, sent: &[u8]) -> io::Result<()> {
    let mut got = vec![0u8; sent.len()];
    stream.read_exact(&mut got)?;
    if got != sent {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("sent {sent:?}, got {got:?}"),
        ));
    }
    Ok(())
}

/// Exchanges a numbered message every `every` until `stopping`, then one
/// last; whether the connection lived to the end.
fn hold(
    mut stream: TcpStream,
    every: Duration,
    stopping: &AtomicBool,
    counters: &Counters,
    started: Instant,
) -> bool {
    let mut sequence: u64 = 0;
    loop {
        let last = stopping.load(Ordering::Relaxed);
        sequence += 1;
        let message = sequence.to_be_bytes();
        let exchanged = stream
            .write_all(&message)
            .and_then(|()| expect_echo(&mut stream, &message));
        if let Err(e) = exchanged {
            counters.failed(classify_established(&e), "long", &e, started.elapsed());
            return false;
        }
        counters.long_exchanges.fetch_add(1, Ordering::Relaxed);
        if last {
            return true;
        }
        thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_or_early_close_on_an_open_connection_is_a_reset() {
        for kind in [
            ErrorKind::ConnectionReset,
            ErrorKind::BrokenPipe,
            ErrorKind::UnexpectedEof,
            ErrorKind::ConnectionAborted,
        ] {
            assert_eq!(classify_established(&io::Error::from(kind)), Failure::Reset);
        }
        assert_eq!(
            classify_established(&io::Error::from(ErrorKind::WouldBlock)),
            Failure::Timeout
        );
        assert_eq!(
            classify_connect(&io::Error::from(ErrorKind::ConnectionRefused)),
            Failure::Connect
        );
    }

    #[test]
    fn a_run_against_the_echo_server_succeeds_and_a_dead_server_counts_failures() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = listener.local_addr().unwrap();
        thread::spawn(move || {
            for stream in listener.incoming().take(3) {
                let stream = stream.unwrap();
                thread::spawn(move || echo(stream));
            }
            // Then the server is gone: new connections are refused.
        });
        let dialer = Dialer {
            target,
            timeout: Duration::from_secs(2),
        };
        assert!(short_connection(dialer).is_ok());
        let mut long = open(dialer, LONG).unwrap();
        long.write_all(b"12345678").unwrap();
        expect_echo(&mut long, b"12345678").unwrap();
        assert!(short_connection(dialer).is_ok());
        thread::sleep(Duration::from_millis(100));
        assert_eq!(short_connection(dialer).unwrap_err().0, Failure::Connect);
    }
}
