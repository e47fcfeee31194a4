//! The ZDS server against a peer that says anything: arbitrary bytes,
//! hellos of any version, acks and NACKs with any text, truncated and
//! oversized messages, in any order, then a hang-up. The connection may be
//! closed; the server must not panic, lose a pod or stop serving: the next
//! well-behaved ztunnel gets the full snapshot.

use ambpf_proto::zds::{WorkloadResponse, ZdsHello};
use proptest::prelude::*;

use crate::{agent_panics, agent_runtime, common::*};

/// One message as a peer might send it.
fn message() -> impl Strategy<Value = Vec<u8>> {
    let encoded = prop_oneof![
        any::<i32>().prop_map(|version| ZdsHello { version }.encode_to_vec()),
        Just(ZdsHello::v1().encode_to_vec()),
        Just(WorkloadResponse::ack("").encode_to_vec()),
        ".{0,64}".prop_map(|why| WorkloadResponse::ack(why).encode_to_vec()),
        Just(WorkloadResponse { payload: None }.encode_to_vec()),
    ];
    prop_oneof![
        3 => encoded.clone(),
        // An encoding with a few bytes changed.
        2 => (encoded, prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4))
            .prop_map(|(mut bytes, edits)| {
                if !bytes.is_empty() {
                    for (at, value) in edits {
                        let i = at.index(bytes.len());
                        bytes[i] = value;
                    }
                }
                bytes
            }),
        2 => prop::collection::vec(any::<u8>(), 1..ZTUNNEL_READ_BUFFER),
        // Larger than the server's read buffer.
        1 => prop::collection::vec(any::<u8>(), ZTUNNEL_READ_BUFFER + 1..4 * ZTUNNEL_READ_BUFFER),
    ]
}

#[test]
fn whatever_a_peer_says_the_next_ztunnel_gets_every_pod() {
    let agent = agent_runtime();
    let peers = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let namespaces: Vec<_> = (0..2)
        .map(|_| NetnsGuard::create("fuzz").unwrap())
        .collect();
    let server = {
        let _agent = agent.enter();
        Server::start(fast_config())
    };
    for (i, ns) in namespaces.iter().enumerate() {
        server.handle.upsert(pod(&format!("p{i}"), ns));
    }

    let input = prop::collection::vec(message(), 0..8);
    let mut runner = proptest::test_runner::TestRunner::new(crate::config());
    let result = runner.run(&input, |messages| {
        let panics = agent_panics();
        peers.block_on(async {
            let peer = Peer::connect(&server.socket()).await;
            for message in &messages {
                // The server may have closed the connection already.
                if peer.try_send(message).await.is_err() {
                    break;
                }
            }
            drop(peer);
            let good = Peer::hello(&server.socket()).await;
            let uids: Vec<_> = good
                .take_snapshot()
                .await
                .iter()
                .map(|r| r.uid().to_owned())
                .collect();
            prop_assert_eq!(uids, ["p0", "p1"]);
            Ok(())
        })?;
        prop_assert_eq!(agent_panics(), panics, "a task of the ZDS server panicked");
        Ok(())
    });
    drop(server);
    agent.shutdown_background();
    if let Err(e) = result {
        panic!("{e}");
    }
}
