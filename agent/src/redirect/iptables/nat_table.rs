//! The host's `nat` table under the nft backend, when ambpf is the one that
//! creates it.
//!
//! iptables-nft creates a table (and the base chain a rule goes into) on
//! first use, and removing the rules leaves both behind: an empty `nat`
//! table with a POSTROUTING base chain on a host that had none. So when the
//! host has no `nat` table of a family yet, ambpf creates it itself, with a
//! comment naming it (a table's comment can only be set when it is created,
//! so it tells ambpf's table from one that was there first), and removing
//! the host rules deletes it again, but only while it holds nothing: no
//! rule, no chain but empty base chains.
//!
//! The legacy backend's tables belong to the kernel modules and cannot be
//! removed; without the `nft` binary nothing is marked, and nothing removed.

use super::{Family, IptablesError};
use crate::netns::Netns;
use crate::redirect::in_pod::tools::{find_binary, run_in};

/// The comment on a `nat` table ambpf created.
pub const OWNED_COMMENT: &str = "ambpf: created for its host probe rules";
const TABLE: &str = "nat";

fn nft_family(family: Family) -> &'static str {
    match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

/// Whether `listing` (`nft list tables <family>`) names the `nat` table.
fn lists_nat_table(listing: &str, family: Family) -> bool {
    let wanted = format!("table {} {TABLE}", nft_family(family));
    listing.lines().any(|l| l.trim() == wanted)
}

/// Creates the `nat` table of `family` in `host`, marked as ambpf's, if it
/// does not exist yet. Without the `nft` binary, does nothing.
pub(super) fn create_if_missing(host: &Netns, family: Family) -> Result<(), IptablesError> {
    let Some(nft) = find_binary("nft") else {
        return Ok(());
    };
    let fam = nft_family(family);
    if lists_nat_table(&run_in(host, &nft, &["list", "tables", fam], None)?, family) {
        return Ok(());
    }
    let comment = format!("{{ comment \"{OWNED_COMMENT}\"; }}");
    run_in(host, &nft, &["add", "table", fam, TABLE, &comment], None)?;
    Ok(())
}

/// Deletes the `nat` table of `family` from `host` if ambpf created it and
/// it holds nothing any more; returns whether it did.
pub(super) fn remove_if_owned_and_empty(
    host: &Netns,
    family: Family,
) -> Result<bool, IptablesError> {
    let Some(nft) = find_binary("nft") else {
        return Ok(false);
    };
    let fam = nft_family(family);
    if !lists_nat_table(&run_in(host, &nft, &["list", "tables", fam], None)?, family) {
        return Ok(false);
    }
    let listing = run_in(host, &nft, &["list", "table", fam, TABLE], None)?;
    if !is_owned_and_empty(&listing) {
        return Ok(false);
    }
    run_in(host, &nft, &["delete", "table", fam, TABLE], None)?;
    Ok(true)
}

/// Whether `listing` (`nft list table`) is a table carrying ambpf's comment
/// whose chains are all base chains with policy accept and no rule.
fn is_owned_and_empty(listing: &str) -> bool {
    let mut owned = false;
    // Inside a chain: whether its base chain declaration was seen.
    let mut chain: Option<bool> = None;
    for line in listing.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match chain {
            Some(based) if line == "}" => {
                if !based {
                    return false; // a user chain
                }
                chain = None;
            }
            // The base chain's declaration is the one line allowed.
            Some(false) if line.starts_with("type ") && line.contains("policy accept;") => {
                chain = Some(true);
            }
            Some(_) => return false,
            None if line.starts_with("chain ") => chain = Some(false),
            None if line.starts_with("table ") || line == "}" => {}
            None if line == format!("comment \"{OWNED_COMMENT}\"") => owned = true,
            // Sets, maps, flowtables, another comment: not ambpf's to drop.
            None => return false,
        }
    }
    owned
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(body: &str) -> String {
        format!("table ip nat {{\n\tcomment \"{OWNED_COMMENT}\"\n{body}}}\n")
    }

    const BASE: &str = "\tchain POSTROUTING {\n\t\ttype nat hook postrouting priority srcnat; \
                        policy accept;\n\t}\n";

    #[test]
    fn an_owned_table_with_only_empty_base_chains_is_empty() {
        assert!(is_owned_and_empty(&table(BASE)));
        assert!(is_owned_and_empty(&table("")));
    }

    #[test]
    fn a_rule_a_user_chain_or_a_drop_policy_keeps_the_table() {
        let rule = "\tchain POSTROUTING {\n\t\ttype nat hook postrouting priority srcnat; \
                    policy accept;\n\t\tcounter packets 0 bytes 0 masquerade\n\t}\n";
        assert!(!is_owned_and_empty(&table(rule)));
        let user = format!("{BASE}\tchain KUBE-POSTROUTING {{\n\t}}\n");
        assert!(!is_owned_and_empty(&table(&user)));
        let drop = "\tchain OUTPUT {\n\t\ttype nat hook output priority -100; policy drop;\n\t}\n";
        assert!(!is_owned_and_empty(&table(drop)));
    }

    #[test]
    fn a_table_ambpf_did_not_create_is_never_empty_for_it() {
        assert!(!is_owned_and_empty(&format!("table ip nat {{\n{BASE}}}\n")));
        assert!(!is_owned_and_empty(&format!(
            "table ip nat {{\n\tcomment \"someone else\"\n{BASE}}}\n"
        )));
    }

    #[test]
    fn the_nat_table_is_found_in_a_listing_of_its_family_only() {
        assert!(lists_nat_table(
            "table ip filter\ntable ip nat\n",
            Family::V4
        ));
        assert!(!lists_nat_table("table ip filter\n", Family::V4));
        assert!(!lists_nat_table("table ip natural\n", Family::V4));
        assert!(lists_nat_table("table ip6 nat\n", Family::V6));
    }
}
