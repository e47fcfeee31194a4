//! Address helpers: kernel structs store IPv4 addresses as `__be32` and
//! IPv6 ones as `[__be32; 4]`; ambpf keys both as 16 bytes (IPv4 mapped).

use ambpf_common::IpKey;

#[inline(always)]
pub fn v4(be: u32) -> IpKey {
    IpKey::v4(be.to_ne_bytes())
}

#[inline(always)]
pub fn v6(be: [u32; 4]) -> IpKey {
    let [a, b, c, d] = [
        be[0].to_ne_bytes(),
        be[1].to_ne_bytes(),
        be[2].to_ne_bytes(),
        be[3].to_ne_bytes(),
    ];
    IpKey::v6([
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ])
}

/// The IPv4 address in a v4-mapped key, as `__be32`.
#[inline(always)]
pub fn v4_be(key: &IpKey) -> u32 {
    u32::from_ne_bytes([key.addr[12], key.addr[13], key.addr[14], key.addr[15]])
}

/// The key as `[__be32; 4]`.
#[inline(always)]
pub fn v6_be(key: &IpKey) -> [u32; 4] {
    let a = &key.addr;
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// 127.0.0.0/8, ::1, or ::ffff:127.0.0.0/104.
#[inline(always)]
pub fn is_loopback(key: &IpKey) -> bool {
    if key.is_v4() {
        return key.addr[12] == 127;
    }
    let a = &key.addr;
    a[..15].iter().all(|b| *b == 0) && a[15] == 1
}

/// Where Istio's host rules SNAT the node's own connections to ambient
/// pods (kubelet's probes), and which its in-pod rules let through:
/// 169.254.7.127 and fd16:9254:7127:1337:ffff:ffff:ffff:ffff.
pub const PROBE_SNAT_V4: IpKey = IpKey::v4([169, 254, 7, 127]);
pub const PROBE_SNAT_V6: IpKey = IpKey::v6([
    0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
]);

#[inline(always)]
pub fn is_probe_snat(key: &IpKey) -> bool {
    key.addr == PROBE_SNAT_V4.addr || key.addr == PROBE_SNAT_V6.addr
}

pub const LOOPBACK_V4: IpKey = IpKey::v4([127, 0, 0, 1]);
pub const LOOPBACK_V6: IpKey = IpKey::v6([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);

/// Reads the `[__be32; 4]` at `offset` bytes into a context or socket struct
/// with four loads, each at a constant offset from the struct's pointer.
///
/// The verifier refuses a pointer *into* such a struct, which is what LLVM
/// would otherwise compute once and share between the four loads;
/// `black_box` hides that the bases are the same.
#[inline(always)]
pub unsafe fn load_ip6<T>(base: *const T, offset: usize) -> [u32; 4] {
    let mut out = [0u32; 4];
    let mut i = 0;
    while i < 4 {
        let base = core::hint::black_box(base).cast::<u8>();
        out[i] = unsafe { base.add(offset + 4 * i).cast::<u32>().read() };
        i += 1;
    }
    out
}

/// Writes `value` as four stores at constant offsets (see [`load_ip6`]).
#[inline(always)]
pub unsafe fn store_ip6<T>(base: *mut T, offset: usize, value: [u32; 4]) {
    let mut i = 0;
    while i < 4 {
        let base = core::hint::black_box(base).cast::<u8>();
        unsafe { base.add(offset + 4 * i).cast::<u32>().write(value[i]) };
        i += 1;
    }
}

/// Reads a `T` at `offset` bytes into a context or socket struct as one load
/// at a constant offset from the struct's pointer (see [`load_ip6`]).
#[inline(always)]
pub unsafe fn load_field<S, T: Copy>(base: *const S, offset: usize) -> T {
    let base = core::hint::black_box(base).cast::<u8>();
    unsafe { base.add(offset).cast::<T>().read() }
}

/// `struct sockaddr_in` (getsockopt's SO_ORIGINAL_DST answer, bpf_bind).
#[repr(C)]
pub struct SockaddrIn {
    pub family: u16,
    pub port_be: u16,
    pub addr_be: u32,
    pub zero: [u8; 8],
}

/// `struct sockaddr_in6`.
#[repr(C)]
pub struct SockaddrIn6 {
    pub family: u16,
    pub port_be: u16,
    pub flowinfo: u32,
    pub addr_be: [u32; 4],
    pub scope_id: u32,
}
