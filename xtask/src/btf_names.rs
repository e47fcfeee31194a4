//! Making the BTF that `llc` emits for Rust acceptable to the kernel.
//!
//! rustc describes types with their Rust names (`Option<u64>`,
//! `aya_ebpf::btf_maps::HashMap<u64, PodConfig, 4096, 0>`), which `llc` copies
//! into `.BTF` as they are. The kernel's BTF check wants C identifiers for
//! type, member, enumerator and parameter names, so it refuses the whole
//! `.BTF` section; without it the maps carry no key and value types, and
//! `bpftool map dump` can only print bytes. bpf-linker fixes this while it
//! links; this build has no bpf-linker, so the names are fixed in the object.
//!
//! Every character outside `[A-Za-z0-9_]` becomes `_`. That keeps each string
//! its length, so the string table is rewritten in place and no offset in the
//! object moves. The names of variables and data sections are left alone:
//! they are ELF symbol and section names that the loader looks up, and
//! already valid.

use anyhow::{Context as _, Result, bail};

/// Rewrites the `.BTF` section of the ELF object `object` in place.
/// Returns how many names were changed; an object without `.BTF` is left as it is.
pub fn sanitize_object(object: &mut [u8]) -> Result<usize> {
    match elf_section(object, ".BTF")? {
        Some(range) => sanitize_btf(&mut object[range]),
        None => Ok(0),
    }
}

/// The byte range of section `wanted` in a 64-bit little-endian ELF file.
fn elf_section(elf: &[u8], wanted: &str) -> Result<Option<std::ops::Range<usize>>> {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        bail!("not a 64-bit little-endian ELF object");
    }
    let shoff = u64_at(elf, 0x28)? as usize;
    let shentsize = u16_at(elf, 0x3a)? as usize;
    let shnum = u16_at(elf, 0x3c)? as usize;
    let shstrndx = u16_at(elf, 0x3e)? as usize;
    let header = |i: usize| shoff + i * shentsize;
    let names_at = u64_at(elf, header(shstrndx) + 0x18)? as usize;
    for i in 0..shnum {
        let name_off = u32_at(elf, header(i))? as usize;
        if c_str(elf, names_at + name_off)? == wanted.as_bytes() {
            let offset = u64_at(elf, header(i) + 0x18)? as usize;
            let size = u64_at(elf, header(i) + 0x20)? as usize;
            if offset.checked_add(size).is_none_or(|end| end > elf.len()) {
                bail!("section {wanted} lies outside the file");
            }
            return Ok(Some(offset..offset + size));
        }
    }
    Ok(None)
}

// BTF kinds (include/uapi/linux/btf.h) whose records are followed by more
// than the common 12-byte header, or whose names must stay as they are.
const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_ENUM64: u32 = 19;
const BTF_MAGIC: u16 = 0xeb9f;

/// Rewrites the names in a raw `.BTF` blob. Returns how many strings changed.
pub fn sanitize_btf(btf: &mut [u8]) -> Result<usize> {
    if u16_at(btf, 0)? != BTF_MAGIC {
        bail!("not BTF (bad magic)");
    }
    let hdr_len = u32_at(btf, 4)? as usize;
    let types = hdr_len + u32_at(btf, 8)? as usize;
    let types_end = types + u32_at(btf, 12)? as usize;
    let strings = hdr_len + u32_at(btf, 16)? as usize;
    let strings_end = strings + u32_at(btf, 20)? as usize;
    if types_end > btf.len() || strings_end > btf.len() {
        bail!("BTF header points past the section");
    }

    // Offsets (into the string table) of the names to fix, and of those to keep.
    let mut fix = Vec::new();
    let mut keep = Vec::new();
    let mut at = types;
    while at < types_end {
        let name = u32_at(btf, at)?;
        let info = u32_at(btf, at + 4)?;
        let kind = (info >> 24) & 0x1f;
        let vlen = (info & 0xffff) as usize;
        at += 12;
        match kind {
            KIND_VAR | KIND_DATASEC => keep.push(name),
            _ => fix.push(name),
        }
        // (record size, offset of a name within it) of what follows the header
        let (record, named) = match kind {
            KIND_INT | KIND_VAR | KIND_DECL_TAG => (4, None),
            KIND_ARRAY => (12, None),
            KIND_STRUCT | KIND_UNION | KIND_ENUM64 | KIND_DATASEC => (12, Some(0)),
            KIND_ENUM | KIND_FUNC_PROTO => (8, Some(0)),
            _ => (0, None),
        };
        let count = match kind {
            KIND_INT | KIND_VAR | KIND_DECL_TAG | KIND_ARRAY => 1,
            _ => vlen,
        };
        for i in 0..count {
            if let Some(offset) = named
                && kind != KIND_DATASEC
            {
                fix.push(u32_at(btf, at + i * record + offset)?);
            }
        }
        at += record * count;
    }
    if at != types_end {
        bail!("BTF type section ends inside a record");
    }

    fix.sort_unstable();
    fix.dedup();
    let mut changed = 0;
    for name in fix {
        if name == 0 || keep.contains(&name) {
            continue;
        }
        let start = strings + name as usize;
        let len = c_str(&btf[..strings_end], start)
            .context("BTF name outside the string table")?
            .len();
        let mut was_changed = false;
        for byte in &mut btf[start..start + len] {
            if !(byte.is_ascii_alphanumeric() || *byte == b'_') {
                *byte = b'_';
                was_changed = true;
            }
        }
        changed += usize::from(was_changed);
    }
    Ok(changed)
}

fn c_str(bytes: &[u8], start: usize) -> Result<&[u8]> {
    let tail = bytes.get(start..).context("string offset out of range")?;
    let len = tail
        .iter()
        .position(|&b| b == 0)
        .context("unterminated string")?;
    Ok(&tail[..len])
}

fn u16_at(bytes: &[u8], at: usize) -> Result<u16> {
    let raw = bytes.get(at..at + 2).context("truncated")?;
    Ok(u16::from_le_bytes(raw.try_into()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32> {
    let raw = bytes.get(at..at + 4).context("truncated")?;
    Ok(u32::from_le_bytes(raw.try_into()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64> {
    let raw = bytes.get(at..at + 8).context("truncated")?;
    Ok(u64::from_le_bytes(raw.try_into()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob from type records (as u32 words) and a string table.
    fn btf(types: &[u32], strings: &[u8]) -> Vec<u8> {
        let type_len = (types.len() * 4) as u32;
        let mut out = Vec::new();
        out.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        out.extend_from_slice(&[1, 0]); // version, flags
        for word in [24, 0, type_len, type_len, strings.len() as u32] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        for word in types {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(strings);
        out
    }

    fn info(kind: u32, vlen: u32) -> u32 {
        kind << 24 | vlen
    }

    fn strings_of(blob: &[u8]) -> &[u8] {
        let type_len = u32::from_le_bytes(blob[12..16].try_into().unwrap()) as usize;
        &blob[24 + type_len..]
    }

    #[test]
    fn rust_type_and_member_names_become_identifiers_and_symbols_stay() {
        // 1: "\0", 1..: names
        let strings = b"\0Option<u64>\0is::some\0ambpf_pods\0.maps\0u64\0A::B\0";
        let off = |s: &str| {
            let hay = std::str::from_utf8(strings).unwrap();
            hay.find(&format!("\0{s}\0")).unwrap() as u32 + 1
        };
        let types = [
            // [1] INT u64
            off("u64"),
            info(KIND_INT, 0),
            8,
            64,
            // [2] STRUCT Option<u64> { is::some: u64 }
            off("Option<u64>"),
            info(KIND_STRUCT, 1),
            8,
            off("is::some"),
            1,
            0,
            // [3] ENUM A::B... with enumerator "A::B"
            off("A::B"),
            info(KIND_ENUM, 1),
            4,
            off("A::B"),
            0,
            // [4] VAR ambpf_pods
            off("ambpf_pods"),
            info(KIND_VAR, 0),
            2,
            1,
            // [5] DATASEC .maps { [4] }
            off(".maps"),
            info(KIND_DATASEC, 1),
            0,
            4,
            0,
            8,
        ];
        let mut blob = btf(&types, strings);
        let changed = sanitize_btf(&mut blob).unwrap();
        assert_eq!(changed, 3);
        assert_eq!(
            strings_of(&blob),
            b"\0Option_u64_\0is__some\0ambpf_pods\0.maps\0u64\0A__B\0"
        );
        // Idempotent: a second pass finds nothing left to change.
        assert_eq!(sanitize_btf(&mut blob).unwrap(), 0);
    }

    #[test]
    fn malformed_btf_is_an_error_not_a_panic() {
        assert!(sanitize_btf(&mut [0u8; 4]).is_err());
        let mut truncated = btf(&[0, info(KIND_STRUCT, 3), 8], b"\0");
        assert!(sanitize_btf(&mut truncated).is_err());
        let mut bad_name = btf(&[99, info(KIND_INT, 0), 4, 32], b"\0");
        assert!(sanitize_btf(&mut bad_name).is_err());
    }

    #[test]
    fn objects_that_are_not_elf_are_refused() {
        assert!(sanitize_object(&mut [0u8; 100]).is_err());
    }
}
