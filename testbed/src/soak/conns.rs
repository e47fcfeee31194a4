//! Long-lived connections: one outbound (pod → the off-node echo server)
//! and one inbound (off-node client → the pod's app) per pod, opened before
//! a fault and echoed through after it. A connection that fails to echo was
//! reset or stalled by the fault.

use std::{
    net::{IpAddr, SocketAddr, TcpStream as StdStream},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    task::JoinHandle,
};

use crate::NetnsGuard;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// An echo taking longer is a stall.
pub const ECHO_TIMEOUT: Duration = Duration::from_secs(5);

/// A task aborted when dropped.
pub struct Task(JoinHandle<()>);

impl Task {
    pub fn spawn(future: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        Self(tokio::spawn(future))
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An echo server on `addr` (dual-stack for `[::]`) in `ns`.
pub fn serve_echo(ns: &NetnsGuard, addr: SocketAddr) -> Result<Task> {
    let listener = ns.run(|| -> std::io::Result<std::net::TcpListener> {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        socket.set_reuse_address(true)?;
        if addr.is_ipv6() {
            socket.set_only_v6(false)?;
        }
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        socket.set_nonblocking(true)?;
        Ok(socket.into())
    })??;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    Ok(Task(tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    })))
}

/// A pod's two connections.
pub struct PodConns {
    pub outbound: TcpStream,
    pub inbound: TcpStream,
    /// The local port of each (how the ztunnel double's records name them).
    pub outbound_port: u16,
    pub inbound_port: u16,
    /// Whether the pod was redirected when they were opened.
    pub redirected: bool,
    /// Which ztunnel (counted from 1) proxied them.
    pub generation: u64,
}

/// Connects from a thread inside `ns`.
fn connect_in(ns: &NetnsGuard, to: SocketAddr) -> Result<TcpStream> {
    let stream = ns
        .run(|| StdStream::connect_timeout(&to, CONNECT_TIMEOUT))?
        .with_context(|| format!("connecting to {to} from {}", ns.name()))?;
    stream.set_nonblocking(true)?;
    stream.set_nodelay(true)?;
    Ok(TcpStream::from_std(stream)?)
}

impl PodConns {
    /// Opens both and checks that each echoes once.
    pub async fn open(
        pod: &NetnsGuard,
        pod_ip: IpAddr,
        remote: &NetnsGuard,
        remote_ip: IpAddr,
        redirected: bool,
    ) -> Result<Self> {
        let mut outbound = connect_in(pod, SocketAddr::new(remote_ip, super::world::REMOTE_PORT))?;
        let mut inbound = connect_in(remote, SocketAddr::new(pod_ip, super::world::APP_PORT))?;
        let outbound_port = outbound.local_addr()?.port();
        let inbound_port = inbound.local_addr()?.port();
        echo(&mut outbound, 0).await.context("outbound")?;
        echo(&mut inbound, 0).await.context("inbound")?;
        Ok(Self {
            outbound,
            inbound,
            outbound_port,
            inbound_port,
            redirected,
            generation: 0,
        })
    }

    /// Echoes through both; the first failure, named.
    pub async fn check(&mut self, round: u64) -> Result<()> {
        echo(&mut self.outbound, round).await.context("outbound")?;
        echo(&mut self.inbound, round).await.context("inbound")
    }
}

/// Writes 16 bytes and reads them back.
async fn echo(stream: &mut TcpStream, round: u64) -> Result<()> {
    let mut message = [0u8; 16];
    message[..8].copy_from_slice(&round.to_le_bytes());
    message[8..].copy_from_slice(b"soak-eco");
    let mut reply = [0u8; 16];
    tokio::time::timeout(ECHO_TIMEOUT, async {
        stream.write_all(&message).await?;
        stream.read_exact(&mut reply).await?;
        std::io::Result::Ok(())
    })
    .await
    .map_err(|_| anyhow::anyhow!("no echo within {ECHO_TIMEOUT:?} (stalled)"))?
    .map_err(|e| anyhow::anyhow!("{e} ({:?})", e.kind()))?;
    ensure!(reply == message, "echoed {reply:?}, not {message:?}");
    Ok(())
}
