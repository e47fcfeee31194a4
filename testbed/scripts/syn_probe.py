#!/usr/bin/python3
"""Sends hand-built connection attempts and reports what came back.

Used by agent/tests/adversarial.rs, in a namespace of the test's own: the
attempts are TCP SYNs (and SCTP INITs) in shapes a kernel's own sockets never
send: IPv4 fragments (tiny, out of order, overlapping), IPv6 Fragment and
extension headers, 802.1Q and QinQ frames, odd flags and options. scapy
(Debian's python3-scapy) builds each of them in a line; writing fragments and
extension headers by hand in Rust would be a second packet library to trust.

Input (stdin, JSON): {"iface": "eth0", "src_mac": ..., "dst_mac": ...,
"probes": [...]} or, instead of "probes", {"random": {"seed": N, "count": N,
"v4": {...}, "v6": {...}}} for generated mutations. Each probe has an "id",
a "sport" of its own, "src", "dst", "dport" and a "shape" (see build()).
Output (stdout, JSON): {id: outcome}, where the outcome is what the target
answered to that sport:
  "syn-ack"  a SYN-ACK: a listener took the connection;
  "syn-ack from the app"  a SYN-ACK advertising the MSS `app_mss` of the
             spec, which only the app's own listener sets: the app took it;
  "rst"      an RST: refused (no listener, or capture towards none);
  "abort"    an SCTP ABORT;
  "icmp"     an ICMP or ICMPv6 error;
  "none"     nothing within the wait.
"""

import json
import random
import sys
import time

from scapy.all import (  # noqa: E402
    AsyncSniffer,
    Dot1Q,
    Ether,
    IP,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    Raw,
    SCTP,
    SCTPChunkInit,
    TCP,
    conf,
    fragment,
    fragment6,
    send,
    sendp,
)

conf.verb = 0

OPTIONS = {
    "mss": ("MSS", 1460),
    "wscale": ("WScale", 7),
    "sack": ("SAckOK", b""),
    "ts": ("Timestamp", (12345, 0)),
    "nop": ("NOP", None),
}


def tcp(probe):
    flags = probe.get("flags", "S")
    options = [OPTIONS[o] for o in probe.get("options", ["mss"])]
    layer = TCP(
        sport=probe["sport"],
        dport=probe["dport"],
        flags=flags,
        seq=probe.get("seq", 1000),
        window=probe.get("window", 64240),
        options=options,
    )
    if probe.get("payload"):
        layer = layer / Raw(b"x" * probe["payload"])
    return layer


def build(probe):
    """The packets (L3) or frames (L2) of one probe, in sending order."""
    shape = probe["shape"]
    v6 = ":" in probe["dst"]
    if shape == "sctp":
        l4 = SCTP(sport=probe["sport"], dport=probe["dport"]) / SCTPChunkInit(
            init_tag=probe["sport"], a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=1
        )
    else:
        l4 = tcp(probe)
    if not v6:
        ip = IP(src=probe["src"], dst=probe["dst"], ttl=probe.get("ttl", 64), tos=probe.get("tos", 0))
        if probe.get("ip_options"):
            from scapy.layers.inet import IPOption_NOP, IPOption_RR

            ip.options = [IPOption_NOP(), IPOption_RR()]
        packet = ip / l4
        if shape in ("plain", "sctp", "l2-vlan", "l2-qinq", "l2-plain"):
            packets = [packet]
        elif shape == "frag-tiny":
            packets = fragment(packet, fragsize=8)
        elif shape == "frag-reverse":
            packets = list(reversed(fragment(packet, fragsize=8)))
        elif shape == "frag-sized":
            packets = fragment(packet, fragsize=probe["fragsize"])
            if probe.get("reverse"):
                packets.reverse()
        elif shape == "frag-overlap":
            # The first fragment carries the real header; a second, at
            # offset 0 again, rewrites the destination port.
            packets = fragment(packet, fragsize=8)
            rewrite = packet.copy()
            rewrite[TCP].dport = probe.get("overlap_dport", 15008)
            second = fragment(rewrite, fragsize=8)[0]
            packets = [packets[0], second] + packets[1:]
        else:
            raise ValueError(f"shape {shape} for IPv4")
    else:
        ip = IPv6(src=probe["src"], dst=probe["dst"], hlim=probe.get("ttl", 64))
        if shape in ("plain", "sctp", "l2-vlan", "l2-qinq", "l2-plain"):
            packets = [ip / l4]
        elif shape == "frag-atomic":
            packets = [ip / IPv6ExtHdrFragment(id=probe["sport"], m=0, offset=0) / l4]
        elif shape == "frag6":
            packets = fragment6(ip / IPv6ExtHdrFragment(id=probe["sport"]) / l4, probe.get("fragsize", 1280))
            if probe.get("reverse"):
                packets.reverse()
        elif shape == "ext-chain":
            chain = ip
            for kind in probe["chain"]:
                chain = chain / {
                    "hbh": IPv6ExtHdrHopByHop,
                    "dst": IPv6ExtHdrDestOpt,
                    "rt": lambda: IPv6ExtHdrRouting(type=0, segleft=0),
                }[kind]()
            packets = [chain / l4]
        else:
            raise ValueError(f"shape {shape} for IPv6")
    return packets


def small_frag6(probe):
    """IPv6 fragments of 8 payload bytes after a first one that holds the
    whole TCP header (the kernel drops a first fragment without the
    upper-layer header, RFC 7112): fragment6() cuts at the MTU only."""
    ip = IPv6(src=probe["src"], dst=probe["dst"])
    layer = tcp(dict(probe, payload=probe.get("payload") or 40))
    # The checksum covers the IPv6 pseudo-header: built on the whole packet.
    inner = bytes(IPv6(bytes(ip / layer))[TCP])
    header = (len(inner) - len(bytes(layer.payload)) + 7) // 8 * 8
    ident = probe["sport"]
    pieces = [inner[:header]] + [inner[i : i + 8] for i in range(header, len(inner), 8)]
    out = []
    for i, piece in enumerate(pieces):
        more = 1 if i < len(pieces) - 1 else 0
        offset = 0 if i == 0 else (header + 8 * (i - 1)) // 8
        out.append(ip / IPv6ExtHdrFragment(id=ident, nh=6, offset=offset, m=more) / Raw(piece))
    if probe.get("reverse"):
        out.reverse()
    return out


def generate(spec):
    """Random mutations of a SYN: `count` probes from `seed`."""
    rng = random.Random(spec["seed"])
    probes = []
    flag_sets = ["S", "S", "S", "SE", "SC", "SU", "SP", "SF", "SR", "SA", "A", "F", "R", ""]
    for i in range(spec["count"]):
        family = rng.choice(["v4", "v6"])
        addrs = spec[family]
        flags = rng.choice(flag_sets)
        probe = {
            "id": f"random-{i} flags {flags or '-'}",
            "sport": spec["first_sport"] + i,
            "src": addrs["src"],
            "dst": addrs["dst"],
            "dport": rng.choice(addrs["ports"]),
            "flags": flags,
            "options": rng.sample(list(OPTIONS), rng.randint(0, 4)),
            "seq": rng.randrange(1 << 32),
            "window": rng.choice([0, 1, 1024, 65535]),
            "payload": rng.choice([0, 0, 0, 1, 100]),
            "ttl": rng.choice([1, 2, 64, 255]),
        }
        if family == "v4":
            probe["shape"] = rng.choice(["plain", "plain", "frag-tiny", "frag-reverse", "frag-sized", "frag-overlap"])
            probe["fragsize"] = rng.choice([8, 16, 24, 32])
            probe["reverse"] = rng.random() < 0.5
            probe["ip_options"] = rng.random() < 0.2
            probe["tos"] = rng.choice([0, 0x10, 0xb8])
        else:
            probe["shape"] = rng.choice(["plain", "plain", "frag-atomic", "frag6-small", "ext-chain"])
            probe["reverse"] = rng.random() < 0.5
            probe["chain"] = [rng.choice(["dst", "dst", "rt", "hbh"]) for _ in range(rng.randint(1, 8))]
            # Hop-by-Hop is only valid first.
            probe["chain"] = [k for j, k in enumerate(probe["chain"]) if k != "hbh" or j == 0]
        probes.append(probe)
    return probes


def main():
    spec = json.load(sys.stdin)
    probes = spec.get("probes") or generate(spec["random"])
    iface = spec["iface"]
    by_sport = {p["sport"]: p["id"] for p in probes}
    outcome = {p["id"]: "none" for p in probes}

    def classify(pkt):
        # An ICMP error quotes the probe: its TCPerror/SCTPerror layer.
        for quoted in ("TCPerror", "SCTPerror"):
            if pkt.haslayer(quoted) and pkt[quoted].sport in by_sport:
                outcome[by_sport[pkt[quoted].sport]] = "icmp"
                return
        if TCP in pkt and pkt[TCP].dport in by_sport:
            probe = by_sport[pkt[TCP].dport]
            flags = int(pkt[TCP].flags)
            if flags & 0x04:
                outcome[probe] = "rst"
            elif flags & 0x12 == 0x12:
                mss = dict(o for o in pkt[TCP].options if isinstance(o, tuple)).get("MSS")
                app = spec.get("app_mss") is not None and mss == spec["app_mss"]
                outcome[probe] = "syn-ack from the app" if app else "syn-ack"
        elif SCTP in pkt and pkt[SCTP].dport in by_sport:
            outcome[by_sport[pkt[SCTP].dport]] = "abort"

    sniffer = AsyncSniffer(iface=iface, store=False, prn=classify)
    sniffer.start()
    time.sleep(0.5)
    for probe in probes:
        if probe["shape"] == "frag6-small":
            packets = small_frag6(probe)
        else:
            packets = build(probe)
        shape = probe["shape"]
        if shape.startswith("l2-"):
            frames = []
            for packet in packets:
                eth = Ether(src=spec["src_mac"], dst=spec["dst_mac"])
                if shape == "l2-vlan":
                    frame = eth / Dot1Q(vlan=probe.get("vlan", 0)) / packet
                elif shape == "l2-qinq":
                    frame = eth / Dot1Q(vlan=100, type=0x8100) / Dot1Q(vlan=probe.get("vlan", 0)) / packet
                else:
                    frame = eth / packet
                frames.append(frame)
            sendp(frames, iface=iface)
        else:
            send(packets)
    time.sleep(spec.get("wait_secs", 1.5))
    sniffer.stop()
    json.dump(outcome, sys.stdout)


if __name__ == "__main__":
    main()
