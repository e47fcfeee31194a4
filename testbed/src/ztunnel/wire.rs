//! Reading one ZDS request as ztunnel does: one packet into a 1024-byte
//! buffer, with control space for exactly one file descriptor.

use std::os::fd::{OwnedFd, RawFd};

use ambpf_proto::{
    Message,
    zds::{WorkloadInfo, WorkloadRequest, workload_request::Payload},
};
use tokio_seqpacket::{UnixSeqpacket, ancillary::OwnedAncillaryMessage};

/// ztunnel's read buffer: a longer message is truncated, which is an error.
pub(super) const READ_BUFFER_LEN: usize = ambpf_proto::ZTUNNEL_READ_BUFFER;

// SAFETY: CMSG_SPACE only does arithmetic on its argument.
const CONTROL_LEN: usize = unsafe { nix::libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;

/// Control-message space for one fd, as ztunnel's `cmsg_space!(RawFd)`: a
/// second fd does not fit and sets MSG_CTRUNC. Aligned for `cmsghdr`.
#[repr(C, align(8))]
pub(super) struct ControlBuffer([u8; CONTROL_LEN]);

impl ControlBuffer {
    pub(super) fn new() -> Self {
        Self([0; CONTROL_LEN])
    }
}

/// A well-formed request.
pub(super) enum Request {
    Add {
        uid: String,
        /// `None` is a protocol error, decided by the client.
        info: Option<WorkloadInfo>,
        netns: OwnedFd,
    },
    Keep {
        uid: String,
    },
    Del {
        uid: String,
    },
    SnapshotSent,
}

pub(super) enum ReceiveError {
    /// The server closed the connection (a zero-length read).
    Closed,
    Io(std::io::Error),
    /// A request ztunnel cannot read: NACKed, then the connection is dropped.
    Unreadable {
        uid: Option<String>,
        reason: String,
    },
}

/// Receives and validates one request. Every fd received is either returned
/// (the netns of an Add) or closed before this returns.
pub(super) async fn receive(
    socket: &UnixSeqpacket,
    buffer: &mut [u8; READ_BUFFER_LEN],
    control: &mut ControlBuffer,
) -> Result<Request, ReceiveError> {
    let (info, ancillary) = socket
        .recv_with_ancillary(buffer, &mut control.0)
        .await
        .map_err(ReceiveError::Io)?;
    // Take ownership of the fds first, so that every early return closes them.
    let mut netns = None;
    let mut fd_count = 0usize;
    for message in ancillary.into_messages() {
        if let OwnedAncillaryMessage::FileDescriptors(fds) = message {
            for fd in fds {
                fd_count += 1;
                netns.get_or_insert(fd);
            }
        }
    }
    if info.bytes_read() == 0 {
        return Err(ReceiveError::Closed);
    }
    let unreadable = |uid: Option<&str>, reason: String| ReceiveError::Unreadable {
        uid: uid.map(str::to_owned),
        reason,
    };
    if info.truncated() || info.ancillary_truncated() {
        return Err(unreadable(None, "received truncated message".to_owned()));
    }
    let request = WorkloadRequest::decode(&buffer[..info.bytes_read()])
        .map_err(|e| unreadable(None, format!("cannot decode WorkloadRequest: {e}")))?;
    let payload = request
        .payload
        .ok_or_else(|| unreadable(None, "no payload".to_owned()))?;
    match (payload, netns) {
        (payload, _) if fd_count > 1 => Err(unreadable(
            payload_uid(&payload),
            format!("Expected 1 FD, got {fd_count}"),
        )),
        (Payload::Add(add), Some(netns)) => Ok(Request::Add {
            uid: add.uid,
            info: add.workload_info,
            netns,
        }),
        (Payload::Add(add), None) => {
            Err(unreadable(Some(&add.uid), "No control message".to_owned()))
        }
        // Only an Add carries an fd.
        (payload, Some(_)) => Err(unreadable(
            payload_uid(&payload),
            "Unexpected control message".to_owned(),
        )),
        (Payload::Keep(keep), None) => Ok(Request::Keep { uid: keep.uid }),
        (Payload::Del(del), None) => Ok(Request::Del { uid: del.uid }),
        (Payload::SnapshotSent(_), None) => Ok(Request::SnapshotSent),
    }
}

fn payload_uid(payload: &Payload) -> Option<&str> {
    match payload {
        Payload::Add(add) => Some(&add.uid),
        Payload::Keep(keep) => Some(&keep.uid),
        Payload::Del(del) => Some(&del.uid),
        Payload::SnapshotSent(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_buffer_holds_exactly_one_fd() {
        // cmsghdr (16 bytes on 64-bit) + one int padded to 8.
        assert_eq!(CONTROL_LEN, 24);
        assert_eq!(align_of::<ControlBuffer>(), 8);
    }
}
