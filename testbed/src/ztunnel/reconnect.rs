//! ztunnel's reconnect: its backoff between attempts to reach the agent's
//! ZDS socket, interruptible by the test's commands.

use std::{path::Path, time::Duration};

use tokio::sync::mpsc;
use tokio_seqpacket::UnixSeqpacket;

use super::Command;

/// ztunnel's reconnect backoff: 10 ms, doubling, at most 15 s.
pub(super) const BACKOFF_INITIAL: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(15);

/// Connects, sleeping with backoff between failures; `None` on shutdown.
pub(super) async fn connect_with_backoff(
    path: &Path,
    backoff: &mut Duration,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> Option<UnixSeqpacket> {
    loop {
        match UnixSeqpacket::connect(path).await {
            Ok(socket) => return Some(socket),
            Err(_) => {
                if !sleep_unless_shutdown(next_backoff(backoff), commands).await {
                    return None;
                }
            }
        }
    }
}

/// The delay to wait now; doubles the next one up to [`BACKOFF_MAX`].
pub(super) fn next_backoff(backoff: &mut Duration) -> Duration {
    let delay = *backoff;
    *backoff = (*backoff * 2).min(BACKOFF_MAX);
    delay
}

/// Sleeps for `delay`; false if shutdown was requested meanwhile.
pub(super) async fn sleep_unless_shutdown(
    delay: Duration,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            () = &mut sleep => return true,
            command = commands.recv() => match command {
                // Nothing to disconnect while not connected.
                Some(Command::Disconnect) => {}
                Some(Command::Shutdown) | None => return false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_10ms_up_to_15s() {
        let mut backoff = BACKOFF_INITIAL;
        let delays: Vec<Duration> = (0..14).map(|_| next_backoff(&mut backoff)).collect();
        assert_eq!(delays[0], Duration::from_millis(10));
        assert_eq!(delays[1], Duration::from_millis(20));
        assert_eq!(delays[10], Duration::from_millis(10240));
        assert_eq!(delays[11], Duration::from_secs(15));
        assert_eq!(delays[13], Duration::from_secs(15));
    }
}
