//! Refusing a SYN that no listener takes, as the kernel does: the SYN itself
//! is turned into the RST|ACK the kernel would send (`tcp_v4_send_reset`) and
//! sent back out of the interface it came in on (`bpf_redirect`).
//!
//! Under Istio's rules an inbound SYN is REDIRECTed to 15006; with no
//! ztunnel listening there the kernel answers with an RST, so the client
//! gets ECONNREFUSED at once instead of retrying into silence.
//!
//! The reply is the SYN rewritten in place (same length): addresses, ports
//! and MAC addresses swapped, TTL/hop limit reset, `seq` 0, `ack` the SYN's
//! `seq` + 1, flags RST|ACK, window 0, options turned into NOPs. Checksums
//! are updated incrementally with `bpf_l3/l4_csum_replace`, which also does
//! the right thing for a `CHECKSUM_PARTIAL` skb (a SYN from another
//! namespace over veths): there only the pseudo-header counts, and swapping
//! addresses leaves it unchanged. A SYN this cannot answer exactly (IPv4
//! options, IPv6 extension headers, data in the SYN) is dropped, never
//! passed to the app.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::bpf_redirect, programs::TcContext};

/// Ethernet header length; the IP header follows it.
pub const ETH_HLEN: usize = 14;
const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
const TCP_HLEN: usize = 20;
/// Options of a TCP header, in 4-byte words, at most.
const MAX_OPTION_WORDS: usize = 10;
/// TCP flags byte of the reply.
const RST_ACK: u8 = 0x04 | 0x10;
/// TTL / hop limit of the reply (Linux's default).
const REPLY_TTL: u8 = 64;
/// `bpf_l3/l4_csum_replace`: the size of the field replaced.
const CSUM_FIELD_2: u64 = 2;
const CSUM_FIELD_4: u64 = 4;
/// Four TCP NOP options.
const NOPS: u32 = 0x0101_0101;
/// `bpf_skb_store_bytes` flags: none. The reply leaves through egress,
/// where a `CHECKSUM_COMPLETE` sum of the received packet plays no part.
const STORE_FLAGS: u64 = 0;
/// The SYN could not be answered exactly.
const UNSUPPORTED: i64 = -1;

/// Answers the SYN in `ctx` (its TCP header at `l4`) with an RST|ACK out of
/// the same interface; drops it if that cannot be done.
#[inline(always)]
pub fn refuse(ctx: &TcContext, is_v4: bool, l4: usize) -> i32 {
    match rewrite_as_reset(ctx, is_v4, l4) {
        Ok(()) => {
            // SAFETY: `skb` is the context pointer the kernel handed us.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            // Egress of the device it arrived on: back towards the client.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        Err(_) => TC_ACT_SHOT,
    }
}

#[inline(always)]
fn rewrite_as_reset(ctx: &TcContext, is_v4: bool, l4: usize) -> Result<(), i64> {
    let data_offset: u8 = ctx.load(l4 + 12)?;
    let tcp_len = usize::from(data_offset >> 4) * 4;
    if tcp_len < TCP_HLEN {
        return Err(UNSUPPORTED);
    }
    // Plain headers only, and no data in the SYN: the reply keeps the
    // packet's length, so nothing needs to be cut off.
    let (ip_len, headers) = if is_v4 {
        // IPv4 total length: header included.
        (u16::from_be(ctx.load(ETH_HLEN + 2)?), IPV4_HLEN + tcp_len)
    } else {
        // IPv6 payload length: header excluded.
        (u16::from_be(ctx.load(ETH_HLEN + 4)?), tcp_len)
    };
    let ip_hlen = if is_v4 { IPV4_HLEN } else { IPV6_HLEN };
    if l4 != ETH_HLEN + ip_hlen || usize::from(ip_len) != headers {
        return Err(UNSUPPORTED);
    }
    let csum = l4 + 16;
    let store = |offset: usize, bytes: &[u8; 4]| ctx.store(offset, bytes, STORE_FLAGS);

    // Ethernet: back to the sender.
    let dst_mac: [u8; 6] = ctx.load(0)?;
    let src_mac: [u8; 6] = ctx.load(6)?;
    ctx.store(0, &src_mac, STORE_FLAGS)?;
    ctx.store(6, &dst_mac, STORE_FLAGS)?;

    // IP: addresses swapped (the sums stay the same), a fresh TTL.
    if is_v4 {
        let saddr: [u8; 4] = ctx.load(ETH_HLEN + 12)?;
        let daddr: [u8; 4] = ctx.load(ETH_HLEN + 16)?;
        store(ETH_HLEN + 12, &daddr)?;
        store(ETH_HLEN + 16, &saddr)?;
        // TTL and protocol share a 16-bit word of the header checksum.
        let old: u16 = ctx.load(ETH_HLEN + 8)?;
        let new = u16::from_ne_bytes([REPLY_TTL, old.to_ne_bytes()[1]]);
        ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(old), u64::from(new), CSUM_FIELD_2)?;
        ctx.store(ETH_HLEN + 8, &new, STORE_FLAGS)?;
    } else {
        let saddr: [u8; 16] = ctx.load(ETH_HLEN + 8)?;
        let daddr: [u8; 16] = ctx.load(ETH_HLEN + 24)?;
        ctx.store(ETH_HLEN + 8, &daddr, STORE_FLAGS)?;
        ctx.store(ETH_HLEN + 24, &saddr, STORE_FLAGS)?;
        ctx.store(ETH_HLEN + 7, &REPLY_TTL, STORE_FLAGS)?;
    }

    // TCP: ports swapped (the sum stays the same).
    let ports: [u8; 4] = ctx.load(l4)?;
    store(l4, &[ports[2], ports[3], ports[0], ports[1]])?;
    // seq 0, ack the SYN's seq + 1.
    let seq: u32 = ctx.load(l4 + 4)?;
    let old_ack: u32 = ctx.load(l4 + 8)?;
    let ack = u32::from_be(seq).wrapping_add(1).to_be();
    replace_word(ctx, csum, l4 + 4, seq, 0)?;
    replace_word(ctx, csum, l4 + 8, old_ack, ack)?;
    // Header length kept, flags RST|ACK, window 0.
    let old: u32 = ctx.load(l4 + 12)?;
    let new = u32::from_ne_bytes([data_offset & 0xf0, RST_ACK, 0, 0]);
    replace_word(ctx, csum, l4 + 12, old, new)?;
    // Urgent pointer 0.
    let old_urgent: u16 = ctx.load(l4 + 18)?;
    ctx.l4_csum_replace(csum, u64::from(old_urgent), 0, CSUM_FIELD_2)?;
    ctx.store(l4 + 18, &0u16, STORE_FLAGS)?;
    // The SYN's options mean nothing in a reset.
    let option_words = (tcp_len - TCP_HLEN) / 4;
    for word in 0..MAX_OPTION_WORDS {
        if word >= option_words {
            break;
        }
        let offset = l4 + TCP_HLEN + 4 * word;
        let old: u32 = ctx.load(offset)?;
        replace_word(ctx, csum, offset, old, NOPS)?;
    }
    Ok(())
}

/// Writes the 32-bit word at `offset` and updates the TCP checksum at `csum`
/// (a field outside the pseudo-header).
#[inline(always)]
fn replace_word(
    ctx: &TcContext,
    csum: usize,
    offset: usize,
    old: u32,
    new: u32,
) -> Result<(), i64> {
    ctx.l4_csum_replace(csum, u64::from(old), u64::from(new), CSUM_FIELD_4)?;
    ctx.store(offset, &new, STORE_FLAGS)
}
