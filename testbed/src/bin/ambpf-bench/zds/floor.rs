//! The floor ZDS server of the `zds` suite: the protocol's own cost, with no
//! per-pod work and no state.

use super::*;

/// The floor ZDS server: one connection at a time; hello, N Adds with
/// the same pre-opened netns fd, SnapshotSent, each acked; then waits for
/// the peer to close.
pub(super) struct Floor {
    served: watch::Receiver<u64>,
    /// [`FloorThread::Own`]: stops the thread's runtime, then it is joined.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// [`FloorThread::Own`]: the thread's id, for its CPU time.
    tid: Option<u32>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// [`FloorThread::Shared`]: the task on the bench's runtime.
    _task: Option<AbortOnDrop>,
}

impl Drop for Floor {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn floor_loop(
    mut listener: UnixSeqpacketListener,
    pods: Arc<Vec<BenchPod>>,
    netns: Arc<File>,
    tx: watch::Sender<u64>,
) {
    loop {
        let socket = match listener.accept().await {
            Ok(socket) => socket,
            Err(e) => {
                eprintln!("zds floor: accept failed: {e}");
                return;
            }
        };
        if let Err(e) = serve_floor(&socket, &pods, &netns).await {
            eprintln!("zds floor: {e:#}");
        }
        drop(socket);
        tx.send_modify(|n| *n += 1);
    }
}

impl Floor {
    pub(super) fn start(
        path: &Path,
        pods: Arc<Vec<BenchPod>>,
        netns: Arc<File>,
        thread: FloorThread,
    ) -> Result<Self> {
        let (tx, served) = watch::channel(0u64);
        if thread == FloorThread::Shared {
            let listener = UnixSeqpacketListener::bind(path)
                .with_context(|| format!("binding the floor socket {}", path.display()))?;
            let task = tokio::spawn(floor_loop(listener, pods, netns, tx));
            return Ok(Self {
                served,
                stop: None,
                tid: None,
                thread: None,
                _task: Some(AbortOnDrop(task)),
            });
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (bound_tx, bound) = std::sync::mpsc::channel();
        let path = path.to_owned();
        let thread = std::thread::Builder::new()
            .name("zds-floor".to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match UnixSeqpacketListener::bind(&path) {
                        Ok(listener) => {
                            let tid = nix::unistd::gettid().as_raw() as u32;
                            let _ = bound_tx.send(Ok(tid));
                            listener
                        }
                        Err(e) => {
                            let _ = bound_tx.send(Err(e));
                            return;
                        }
                    };
                    tokio::select! {
                        () = floor_loop(listener, pods, netns, tx) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        let mut floor = Self {
            served,
            stop: Some(stop),
            tid: None,
            thread: Some(thread),
            _task: None,
        };
        // On error, dropping `floor` stops and joins the thread.
        let tid = bound
            .recv()
            .context("the floor thread died")?
            .context("binding the floor socket")?;
        floor.tid = Some(tid);
        Ok(floor)
    }

    /// CPU time of the floor's thread so far (`None` when it shares the
    /// double's runtime).
    pub(super) fn on_cpu(&self) -> Result<Option<Duration>> {
        self.tid
            .map(|tid| bench::thread_on_cpu(std::process::id(), tid))
            .transpose()
            .context("reading the floor thread's CPU time")
    }

    /// Waits until `count` connections have been served and closed.
    pub(super) async fn wait_served(&self, count: u64) -> Result<()> {
        let mut served = self.served.clone();
        tokio::time::timeout(DISCONNECT_TIMEOUT, served.wait_for(|&n| n >= count))
            .await
            .context("the floor did not see the double disconnect")?
            .context("the floor server stopped")?;
        Ok(())
    }
}

async fn serve_floor(socket: &UnixSeqpacket, pods: &[BenchPod], netns: &File) -> Result<()> {
    let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
    let len = socket.recv(&mut buf).await?.bytes_read();
    let hello = ZdsHello::decode(&buf[..len]).context("undecodable hello")?;
    ensure!(hello == ZdsHello::v1(), "unexpected hello {hello:?}");
    let fds = [netns.as_fd()];
    for pod in pods {
        let request = WorkloadRequest::add(&pod.uid, pod.info()).encode_to_vec();
        let mut control = [0u8; 64];
        let mut ancillary = AncillaryMessageWriter::new(&mut control);
        ancillary
            .add_fds(&fds)
            .map_err(|_| anyhow::anyhow!("control buffer too small for one fd"))?;
        socket.send_with_ancillary(&request, &mut ancillary).await?;
        await_ack(socket, &mut buf, &pod.uid).await?;
    }
    socket
        .send(&WorkloadRequest::snapshot_sent().encode_to_vec())
        .await?;
    await_ack(socket, &mut buf, "SnapshotSent").await?;
    // Stay connected, as the agent does, until the double goes away.
    let info = socket.recv(&mut buf).await?;
    ensure!(
        info.bytes_read() == 0,
        "unsolicited {}-byte message",
        info.bytes_read()
    );
    Ok(())
}

async fn await_ack(socket: &UnixSeqpacket, buf: &mut [u8], what: &str) -> Result<()> {
    let len = socket.recv(buf).await?.bytes_read();
    ensure!(
        len > 0,
        "the double closed the connection awaiting the ack of {what}"
    );
    WorkloadResponse::decode(&buf[..len])
        .context("undecodable response")?
        .into_result()
        .map_err(|why| anyhow::anyhow!("{what} NACKed: {why}"))
}
