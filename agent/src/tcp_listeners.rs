//! The TCP sockets listening in the calling thread's network namespace, as
//! the kernel lists them in `/proc/thread-self/net/tcp{,6}` (read from
//! inside a pod's namespace: `Netns::run`).

use std::io;

/// A socket in state LISTEN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    /// The socket's inode (`/proc/<pid>/fd/<n>` links to `socket:[inode]`).
    pub inode: u64,
    /// Connections the kernel completed that the holder has not accepted
    /// yet (for a listener the table's `rx_queue` is `sk_ack_backlog`).
    pub accept_queue: u32,
}

/// The listeners on `port`, both families.
pub fn on_port(port: u16) -> io::Result<Vec<Listener>> {
    let mut listeners = Vec::new();
    for table in ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => listeners.extend(parse(&text, port)),
            // No IPv6 in the kernel: no tcp6 table.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(listeners)
}

/// `/proc/net/tcp` lines (`sl local_address rem_address st
/// tx_queue:rx_queue ... inode`) of sockets in state LISTEN (`0A`) on
/// `port`.
fn parse(text: &str, port: u16) -> impl Iterator<Item = Listener> + '_ {
    text.lines().skip(1).filter_map(move |line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (_, local_port) = fields.get(1)?.rsplit_once(':')?;
        if *fields.get(3)? != "0A" || u16::from_str_radix(local_port, 16).ok()? != port {
            return None;
        }
        let (_, rx_queue) = fields.get(4)?.split_once(':')?;
        Some(Listener {
            inode: fields.get(9)?.parse().ok()?,
            accept_queue: u32::from_str_radix(rx_queue, 16).ok()?,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_on_the_port_are_read_with_their_accept_queue() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:3A9E 00000000:0000 0A 00000000:00000002 00:00000000 00000000     0        0 41001 1 0000000000000000 100 0 0 10 0
   1: 0201F40A:3A9E 0301F40A:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 41002 1 0000000000000000 20 4 30 10 -1
   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41003 1 0000000000000000 100 0 0 10 0
";
        assert_eq!(
            parse(table, 15006).collect::<Vec<_>>(),
            [Listener {
                inode: 41001,
                accept_queue: 2
            }],
            "only the listener on 15006, not a connection to it nor another port's"
        );
    }
}
