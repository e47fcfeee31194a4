//! The ZDS protocol between the ambpf agent (server) and ztunnel (client),
//! generated from `zds.proto` at build time.

/// Messages of package `istio.workload.zds`.
pub mod zds {
    include!(concat!(env!("OUT_DIR"), "/istio.workload.zds.rs"));
}

pub use prost::{self, Message};

/// ztunnel reads each message into a buffer of this size and treats a
/// truncated read as an error, so every message must fit.
pub const ZTUNNEL_READ_BUFFER: usize = 1024;

/// The largest message ambpf sends, leaving headroom under
/// [`ZTUNNEL_READ_BUFFER`].
pub const MAX_MESSAGE_LEN: usize = 1000;

impl zds::WorkloadRequest {
    pub fn add(uid: &str, info: zds::WorkloadInfo) -> Self {
        Self {
            payload: Some(zds::workload_request::Payload::Add(zds::AddWorkload {
                uid: uid.to_owned(),
                workload_info: Some(info),
            })),
        }
    }

    pub fn keep(uid: &str) -> Self {
        Self {
            payload: Some(zds::workload_request::Payload::Keep(zds::KeepWorkload {
                uid: uid.to_owned(),
            })),
        }
    }

    pub fn del(uid: &str) -> Self {
        Self {
            payload: Some(zds::workload_request::Payload::Del(zds::DelWorkload {
                uid: uid.to_owned(),
            })),
        }
    }

    pub fn snapshot_sent() -> Self {
        Self {
            payload: Some(zds::workload_request::Payload::SnapshotSent(
                zds::SnapshotSent {},
            )),
        }
    }
}

impl zds::WorkloadResponse {
    /// An ACK (`error` empty) or a NACK carrying `error`.
    pub fn ack(error: impl Into<String>) -> Self {
        Self {
            payload: Some(zds::workload_response::Payload::Ack(zds::Ack {
                error: error.into(),
            })),
        }
    }

    /// `Ok(())` for an ACK, `Err(text)` for a NACK or a response without an ack.
    pub fn into_result(self) -> Result<(), String> {
        match self.payload {
            Some(zds::workload_response::Payload::Ack(ack)) if ack.error.is_empty() => Ok(()),
            Some(zds::workload_response::Payload::Ack(ack)) => Err(ack.error),
            None => Err("response without an ack".to_owned()),
        }
    }
}

impl zds::ZdsHello {
    pub fn v1() -> Self {
        Self {
            version: zds::Version::V1 as i32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{zds::*, *};

    /// Bytes ztunnel's prost types produce for the same messages: the field
    /// numbers are the wire contract (note DelWorkload.uid is field 2).
    #[test]
    fn wire_format_matches_the_contract() {
        assert_eq!(ZdsHello::v1().encode_to_vec(), [0x08, 0x01]);
        assert_eq!(
            WorkloadRequest::del("u").encode_to_vec(),
            [0x12, 0x03, 0x12, 0x01, b'u']
        );
        assert_eq!(
            WorkloadRequest::keep("u").encode_to_vec(),
            [0x2a, 0x03, 0x0a, 0x01, b'u']
        );
        assert_eq!(
            WorkloadRequest::snapshot_sent().encode_to_vec(),
            [0x1a, 0x00]
        );
        let info = WorkloadInfo {
            name: "n".into(),
            namespace: "s".into(),
            service_account: "a".into(),
        };
        assert_eq!(
            WorkloadRequest::add("u", info).encode_to_vec(),
            [
                0x0a, 0x0e, 0x0a, 0x01, b'u', 0x12, 0x09, 0x0a, 0x01, b'n', 0x12, 0x01, b's', 0x1a,
                0x01, b'a'
            ]
        );
        assert_eq!(WorkloadResponse::ack("").encode_to_vec(), [0x0a, 0x00]);
    }

    #[test]
    fn nack_text_comes_back_as_an_error() {
        let nack = WorkloadResponse::decode(
            &*WorkloadResponse::ack("failure to start proxy").encode_to_vec(),
        );
        assert_eq!(
            nack.unwrap().into_result(),
            Err("failure to start proxy".to_owned())
        );
        assert_eq!(
            WorkloadResponse::decode(&[0x0a, 0x00][..])
                .unwrap()
                .into_result(),
            Ok(())
        );
        assert!(WorkloadResponse::default().into_result().is_err());
    }

    /// The largest pod Kubernetes allows still fits ztunnel's read buffer.
    #[test]
    fn largest_kubernetes_pod_fits_the_read_buffer() {
        let info = WorkloadInfo {
            name: "n".repeat(253),
            namespace: "s".repeat(63),
            service_account: "a".repeat(253),
        };
        let uid = "0".repeat(36);
        let len = WorkloadRequest::add(&uid, info).encoded_len();
        assert!(len <= MAX_MESSAGE_LEN, "{len}");
    }
}
