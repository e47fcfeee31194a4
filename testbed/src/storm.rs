//! A connection storm: many connections opened from a pod at once, each
//! told apart by where it was going, so that what became of every one can
//! be checked: reached the server it asked for, refused (closed or reset),
//! not connected at all, reached another server (misrouted), or left
//! hanging.
//!
//! The servers ([`Greeters`]) greet each connection with their own port
//! before echoing: a client that reads a port other than the one it
//! connected to was misrouted.

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use crate::NetnsGuard;

/// Servers in one namespace, one per port, each sending its port (2 bytes,
/// network order) to every connection and then echoing; on a tokio runtime
/// of their own (thousands of connections, few threads).
pub struct Greeters {
    pub addresses: Vec<SocketAddr>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Greeters {
    /// Servers on `addresses` in `ns`.
    pub fn start(ns: &NetnsGuard, addresses: &[SocketAddr]) -> io::Result<Self> {
        let listeners = ns.run(|| {
            addresses
                .iter()
                .map(|a| listen(*a))
                .collect::<io::Result<_>>()
        })??;
        Self::serve(addresses, listeners)
    }

    /// Servers on `addresses` in this thread's namespace.
    pub fn start_here(addresses: &[SocketAddr]) -> io::Result<Self> {
        let listeners = addresses
            .iter()
            .map(|a| listen(*a))
            .collect::<io::Result<_>>()?;
        Self::serve(addresses, listeners)
    }

    fn serve(addresses: &[SocketAddr], listeners: Vec<TcpListener>) -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("greeters")
            .enable_all()
            .build()?;
        for (address, listener) in addresses.iter().zip(listeners) {
            let port = address.port();
            let _enter = runtime.enter();
            let listener = tokio::net::TcpListener::from_std(listener)?;
            runtime.spawn(greet(listener, port));
        }
        Ok(Self {
            addresses: addresses.to_vec(),
            runtime: Some(runtime),
        })
    }
}

/// A non-blocking TCP listener on `address` in this thread's namespace
/// (SO_REUSEADDR, backlog 4096), for a tokio server.
pub fn listen(address: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&address.into())?;
    socket.listen(4096)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

async fn greet(listener: tokio::net::TcpListener, port: u16) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        };
        tokio::spawn(async move {
            if conn.write_all(&port.to_be_bytes()).await.is_err() {
                return;
            }
            let mut buf = [0u8; 256];
            while let Ok(n) = conn.read(&mut buf).await {
                if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        });
    }
}

impl Drop for Greeters {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// What became of one connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Greeted by the server it connected to.
    Reached,
    /// Closed or reset before any greeting (ztunnel refused it).
    Refused,
    /// `connect()` itself failed (e.g. EPERM from the socket programs).
    NotConnected(String),
    /// Greeted by another server than the one it connected to.
    Misrouted { greeted_by: u16 },
    /// Neither greeted nor closed within the patience.
    Hung,
}

/// One connection of a storm, open until dropped.
pub struct StormConnection {
    pub target: SocketAddr,
    /// The socket's own address (what ztunnel sees as its client).
    pub local: Option<SocketAddr>,
    pub fate: Fate,
    pub stream: Option<TcpStream>,
}

impl StormConnection {
    /// The app's view of its peer (`getpeername()`).
    pub fn peer(&self) -> Option<SocketAddr> {
        self.stream.as_ref()?.peer_addr().ok().map(canonical)
    }

    /// One echo through the connection, if it is still usable.
    pub fn echo(&mut self) -> bool {
        let Some(stream) = self.stream.as_mut() else {
            return false;
        };
        let mut reply = [0u8; 5];
        stream.write_all(b"storm").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && &reply == b"storm"
    }
}

/// Counts of each [`Fate`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StormSummary {
    pub opened: usize,
    pub reached: usize,
    pub refused: usize,
    pub not_connected: usize,
    pub misrouted: usize,
    pub hung: usize,
    /// Reached, but the app's `getpeername()` shows another address than the
    /// one it connected to (in eBPF mode: its record was evicted, a counted
    /// miss).
    pub wrong_peer: usize,
}

impl StormSummary {
    pub fn of(connections: &[StormConnection]) -> Self {
        let mut summary = Self {
            opened: connections.len(),
            ..Self::default()
        };
        for connection in connections {
            match connection.fate {
                Fate::Reached => {
                    summary.reached += 1;
                    if connection.peer() != Some(connection.target) {
                        summary.wrong_peer += 1;
                    }
                }
                Fate::Refused => summary.refused += 1,
                Fate::NotConnected(_) => summary.not_connected += 1,
                Fate::Misrouted { .. } => summary.misrouted += 1,
                Fate::Hung => summary.hung += 1,
            }
        }
        summary
    }
}

impl std::ops::AddAssign for StormSummary {
    fn add_assign(&mut self, other: Self) {
        self.opened += other.opened;
        self.reached += other.reached;
        self.refused += other.refused;
        self.not_connected += other.not_connected;
        self.misrouted += other.misrouted;
        self.hung += other.hung;
        self.wrong_peer += other.wrong_peer;
    }
}

/// Opens `count` connections from inside `ns` as fast as it can (all
/// connects first, non-blocking, targets taken in turn), then waits up to
/// `patience` for each one's greeting. The connections stay open.
pub fn storm(
    ns: &NetnsGuard,
    targets: &[SocketAddr],
    count: usize,
    patience: Duration,
) -> io::Result<Vec<StormConnection>> {
    ns.run(|| storm_here(targets, count, patience))?
}

/// [`storm`] from this thread's namespace.
pub fn storm_here(
    targets: &[SocketAddr],
    count: usize,
    patience: Duration,
) -> io::Result<Vec<StormConnection>> {
    let mut pending = Vec::with_capacity(count);
    for i in 0..count {
        let target = targets[i % targets.len()];
        pending.push((target, start_connect(target)));
    }
    pending
        .into_iter()
        .map(|(target, started)| finish(target, started, patience))
        .collect()
}

/// Echoes once through every reached connection; returns how many of them
/// no longer work.
pub fn broken(connections: &mut [StormConnection]) -> usize {
    connections
        .iter_mut()
        .filter(|c| c.fate == Fate::Reached)
        .map(StormConnection::echo)
        .filter(|echoed| !echoed)
        .count()
}

/// Opens connections one after another, each greeted (or refused) before
/// the next starts.
pub fn one_by_one(
    ns: &NetnsGuard,
    targets: &[SocketAddr],
    count: usize,
    patience: Duration,
) -> io::Result<Vec<StormConnection>> {
    ns.run(|| {
        (0..count)
            .map(|i| {
                let target = targets[i % targets.len()];
                finish(target, start_connect(target), patience)
            })
            .collect::<io::Result<Vec<_>>>()
    })?
}

fn start_connect(target: SocketAddr) -> io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_nonblocking(true)?;
    match socket.connect(&target.into()) {
        Ok(()) => Ok(socket),
        Err(e) if e.raw_os_error() == Some(nix::libc::EINPROGRESS) => Ok(socket),
        Err(e) => Err(e),
    }
}

fn finish(
    target: SocketAddr,
    started: io::Result<socket2::Socket>,
    patience: Duration,
) -> io::Result<StormConnection> {
    let socket = match started {
        Ok(socket) => socket,
        Err(e) => {
            return Ok(StormConnection {
                target,
                local: None,
                fate: Fate::NotConnected(e.to_string()),
                stream: None,
            });
        }
    };
    socket.set_nonblocking(false)?;
    socket.set_read_timeout(Some(patience))?;
    let mut stream: TcpStream = socket.into();
    let mut greeting = [0u8; 2];
    let fate = match stream.read_exact(&mut greeting) {
        Ok(()) if u16::from_be_bytes(greeting) == target.port() => Fate::Reached,
        Ok(()) => Fate::Misrouted {
            greeted_by: u16::from_be_bytes(greeting),
        },
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Fate::Hung
        }
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Fate::Refused,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::ECONNRESET | nix::libc::ECONNREFUSED | nix::libc::EPIPE)
            ) =>
        {
            Fate::Refused
        }
        Err(e) => Fate::NotConnected(e.to_string()),
    };
    Ok(StormConnection {
        target,
        local: stream.local_addr().ok().map(canonical),
        fate,
        stream: Some(stream),
    })
}

fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}
