//! Lists of IPv4 and IPv6 networks, and what a source does with an address outside one: the
//! webhook ranges a provider publishes (`crate::address_ranges`) and a partner's CIDRs
//! (`crate::partners`). Parsed once, each entry a CIDR or a bare address.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// The most entries a list may hold: GitHub's `hooks` is a few dozen.
pub const MAX_ENTRIES: usize = 10_000;

/// Why a list of networks is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressListError {
    #[error("{entry:?} is neither an address nor a CIDR")]
    Invalid { entry: String },
    #[error("the list is empty")]
    Empty,
    #[error("the list holds {count} entries, more than {MAX_ENTRIES}")]
    TooMany { count: usize },
}

/// A provider's ranges: CIDRs of IPv4 and IPv6, host bits cleared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranges(Vec<IpNet>);

impl Ranges {
    /// Each entry a CIDR (`192.30.252.0/22`, `2a0a:a440::/29`) or a bare address (Stripe's
    /// `3.18.12.63`, a /32). Refused: an empty list (it would refuse every delivery), more than
    /// [`MAX_ENTRIES`], or any entry that is neither.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, AddressListError> {
        if entries.is_empty() {
            return Err(AddressListError::Empty);
        }
        if entries.len() > MAX_ENTRIES {
            return Err(AddressListError::TooMany {
                count: entries.len(),
            });
        }
        let mut nets = Vec::with_capacity(entries.len());
        for entry in entries {
            let text = entry.as_ref().trim();
            let net = match text.parse::<IpNet>() {
                Ok(net) => net.trunc(),
                Err(_) => match text.parse::<IpAddr>() {
                    Ok(address) => IpNet::from(address.to_canonical()),
                    Err(_) => {
                        return Err(AddressListError::Invalid {
                            entry: entry.as_ref().chars().take(100).collect(),
                        });
                    }
                },
            };
            nets.push(net);
        }
        nets.sort();
        nets.dedup();
        Ok(Ranges(nets))
    }

    /// Whether `address` is inside one of the ranges (an IPv4 address written as IPv6,
    /// `::ffff:192.0.2.1`, is read as the IPv4 one).
    pub fn contains(&self, address: IpAddr) -> bool {
        let address = address.to_canonical();
        self.0.iter().any(|net| net.contains(&address))
    }

    /// The CIDRs, as text.
    pub fn cidrs(&self) -> Vec<String> {
        self.0.iter().map(ToString::to_string).collect()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What a source does with a signed delivery from outside its provider's ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AddressCheck {
    /// Store it as usual, and count it.
    Observe,
    /// Refuse it (403), keep the refusal, and count it.
    Enforce,
    /// Do not look at the address.
    Off,
}

impl AddressCheck {
    pub fn as_str(self) -> &'static str {
        match self {
            AddressCheck::Observe => "observe",
            AddressCheck::Enforce => "enforce",
            AddressCheck::Off => "off",
        }
    }

    pub fn parse(raw: &str) -> Result<Self, String> {
        match raw {
            "observe" => Ok(AddressCheck::Observe),
            "enforce" => Ok(AddressCheck::Enforce),
            "off" => Ok(AddressCheck::Off),
            other => Err(format!(
                "address_check {other:?} is none of observe, enforce, off"
            )),
        }
    }
}
