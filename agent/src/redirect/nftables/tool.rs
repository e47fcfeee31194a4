//! The `nft` binary: found and vetted once at start-up, then run inside a
//! namespace (a child that enters it before exec, as the iptables mode's
//! restores are run).

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use super::{MIN_NFT_VERSION, NftablesError, OWNED_COMMENT};
use crate::{
    netns::Netns,
    redirect::in_pod::{
        ToolError,
        tools::{find_binary, run_in},
    },
};

/// What `nft` prints when it was built without libjansson.
const NO_JSON: &str = "JSON support not compiled-in";

/// A vetted `nft`.
#[derive(Clone, Debug)]
pub struct Nft {
    path: PathBuf,
    pub version: (u32, u32, u32),
}

/// `nftables v1.0.6 (Lester Gooch #5)` → (1, 0, 6).
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

fn version_text((a, b, c): (u32, u32, u32)) -> String {
    format!("{a}.{b}.{c}")
}

impl Nft {
    /// The `nft` in `$PATH` (or the sbin directories), vetted in `host`.
    pub fn find(host: &Netns) -> Result<Self, NftablesError> {
        let path = find_binary("nft").ok_or(NftablesError::Missing)?;
        Self::at(path, host)
    }

    /// The `nft` at `path`, refused unless it is recent enough and reads
    /// JSON: every check runs before anything is written.
    pub fn at(path: PathBuf, host: &Netns) -> Result<Self, NftablesError> {
        let shown = path.display().to_string();
        let out = run_in(host, &path, &["--version"], None)?;
        let version = parse_version(&out).ok_or_else(|| NftablesError::Unversioned {
            nft: shown.clone(),
            output: out.trim().to_owned(),
        })?;
        if version < MIN_NFT_VERSION {
            return Err(NftablesError::TooOld {
                nft: shown,
                found: version_text(version),
                needed: version_text(MIN_NFT_VERSION),
            });
        }
        let nft = Self { path, version };
        match run_in(host, &nft.path, &["-j", "list", "tables"], None) {
            Ok(_) => Ok(nft),
            Err(e) if e.to_string().contains(NO_JSON) => Err(NftablesError::NoJson { nft: shown }),
            Err(e) => Err(NftablesError::Run(e)),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs one `nft -f -` transaction in `netns`.
    pub fn apply(&self, netns: &Netns, script: &str) -> Result<(), NftablesError> {
        run_in(netns, &self.path, &["-f", "-"], Some(script))?;
        Ok(())
    }

    fn json(&self, netns: &Netns, args: &[&str]) -> Result<serde_json::Value, NftablesError> {
        let mut all = vec!["-j"];
        all.extend_from_slice(args);
        let out = run_in(netns, &self.path, &all, None)?;
        serde_json::from_str(&out).map_err(|e| NftablesError::Unreadable {
            what: format!("`nft {}`", all.join(" ")),
            cause: e.to_string(),
        })
    }

    /// The `inet` tables of `netns`.
    pub fn inet_tables(&self, netns: &Netns) -> Result<Vec<String>, NftablesError> {
        let listing = self.json(netns, &["list", "tables", "inet"])?;
        Ok(objects(&listing, "table")
            .filter_map(|t| t.get("name")?.as_str().map(str::to_owned))
            .collect())
    }

    /// Whether the `inet` table `name` of `netns` carries ambpf's comment.
    /// Read from the text listing: nft's JSON leaves table comments out
    /// before 1.0.7.
    pub fn owns(&self, netns: &Netns, name: &str) -> Result<bool, NftablesError> {
        let text = run_in(netns, &self.path, &["list", "table", "inet", name], None)?;
        Ok(table_comment(&text).as_deref() == Some(OWNED_COMMENT))
    }

    /// Whether the `inet` table `name` of `netns` holds any rule.
    pub fn has_rules(&self, netns: &Netns, name: &str) -> Result<bool, NftablesError> {
        let listing = self.json(netns, &["list", "table", "inet", name])?;
        Ok(objects(&listing, "rule").next().is_some())
    }

    /// The elements of the set `set` in the `inet` table `table`, each with
    /// its comment.
    pub fn set_elements(
        &self,
        netns: &Netns,
        table: &str,
        set: &str,
    ) -> Result<Vec<(IpAddr, Option<String>)>, NftablesError> {
        let listing = self.json(netns, &["list", "set", "inet", table, set])?;
        let mut out = Vec::new();
        for set in objects(&listing, "set") {
            let Some(elems) = set.get("elem").and_then(|e| e.as_array()) else {
                continue;
            };
            for elem in elems {
                // `{"elem": {"val": ..., "comment": ...}}` with a comment,
                // the bare value without.
                let (val, comment) = match elem.get("elem") {
                    Some(inner) => (inner.get("val"), inner.get("comment")),
                    None => (Some(elem), None),
                };
                if let Some(ip) = val.and_then(|v| v.as_str()).and_then(|v| v.parse().ok()) {
                    let comment = comment.and_then(|c| c.as_str()).map(str::to_owned);
                    out.push((ip, comment));
                }
            }
        }
        Ok(out)
    }
}

/// The objects of kind `kind` in an `nft -j` listing.
fn objects<'a>(
    listing: &'a serde_json::Value,
    kind: &'a str,
) -> impl Iterator<Item = &'a serde_json::Value> {
    listing
        .get("nftables")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
}

/// The comment of the table in `text` (`nft list table`): the table's own
/// `comment "..."` line, before any chain or set.
fn table_comment(text: &str) -> Option<String> {
    for line in text.lines().map(str::trim) {
        if line.starts_with("table ") || line.is_empty() {
            continue;
        }
        let quoted = line.strip_prefix("comment \"")?;
        return quoted.strip_suffix('"').map(str::to_owned);
    }
    None
}

impl From<ToolError> for NftablesError {
    fn from(e: ToolError) -> Self {
        Self::Run(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_nft_version() {
        assert_eq!(
            parse_version("nftables v1.0.6 (Lester Gooch #5)"),
            Some((1, 0, 6))
        );
        assert_eq!(parse_version("nftables v1.1 (x)"), Some((1, 1, 0)));
        assert_eq!(parse_version("nftables v0.9.8 (E.D.S.)"), Some((0, 9, 8)));
        assert_eq!(parse_version("nft: unknown"), None);
        assert!((0, 9, 8) < MIN_NFT_VERSION && (1, 0, 6) >= MIN_NFT_VERSION);
    }

    #[test]
    fn the_table_comment_is_the_tables_own() {
        let ours = format!(
            "table inet istio-ambient-nat {{\n\tcomment \"{OWNED_COMMENT}\"\n\tchain output {{\n\t}}\n}}\n"
        );
        assert_eq!(table_comment(&ours).as_deref(), Some(OWNED_COMMENT));
        let bare = "table inet istio-ambient-nat {\n\tchain output {\n\t\tcomment \"x\"\n\t}\n}\n";
        assert_eq!(table_comment(bare), None);
        assert_eq!(table_comment("table inet t {\n}\n"), None);
    }
}
