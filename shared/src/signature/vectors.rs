//! The catalogue's known-answer vectors, run through the signature engine: each entry's
//! recorded deliveries verified as the entry's layouts would verify a real one. The catalogue
//! test runs every entry's; `hookctl providers check` a draft's.

use crate::catalogue::Provider;
use crate::secrets::SecretSet;
use crate::signature::{Request, choose_layout, verify_with};

/// One known-answer vector of an entry, checked.
#[derive(Debug, Clone)]
pub struct VectorCheck {
    pub index: usize,
    pub source: String,
    /// What the entry records: valid or not.
    pub recorded_valid: bool,
    /// What verification answered: `Ok`, or why it refused.
    pub verified: Result<(), String>,
}

impl VectorCheck {
    /// Whether verification answered what the vector records.
    pub fn agrees(&self) -> bool {
        self.verified.is_ok() == self.recorded_valid
    }
}

/// Runs every known-answer vector of `provider` through verification, as a delivery to a source
/// of it would be verified (its layouts, the vector's `layouts` if it names some, the entry's
/// own timestamp tolerance, at the vector's `now`). The catalogue test runs it on every entry;
/// `hookctl providers check` on a draft.
pub fn check_vectors(provider: &'static Provider) -> Vec<VectorCheck> {
    let tolerance = provider
        .signatures
        .iter()
        .find_map(|s| s.timestamp.as_ref())
        .map_or(300, |t| t.tolerance_seconds);
    provider
        .vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let verified = (|| {
                let headers = crate::catalogue::vector_headers(&v.headers)?;
                let body = v.body_bytes().map_err(|e| format!("body_base64: {e}"))?;
                let request = Request {
                    headers: &headers,
                    body: &body,
                    method: &v.method,
                    url: v.url.as_deref(),
                };
                let layout = choose_layout(&provider.signatures, v.layouts.as_deref(), &request)
                    .map_err(|e| e.to_string())?;
                verify_with(
                    layout,
                    &request,
                    &SecretSet::new(v.secret.clone(), None),
                    std::time::Duration::from_secs(tolerance.into()),
                    v.now,
                )
                .map(|_| ())
                .map_err(|e| e.to_string())
            })();
            VectorCheck {
                index,
                source: v.source.clone(),
                recorded_valid: v.valid,
                verified,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::providers;

    /// Every entry's known-answer vectors verify as recorded: the valid ones (from the
    /// provider's SDK tests or documentation) with the secret they name, the tampered copies
    /// refused. Each entry has at least one of each.
    #[test]
    fn every_vector_verifies_as_recorded() {
        for (scheme, p) in providers() {
            assert!(
                p.vectors.iter().any(|v| v.valid) && p.vectors.iter().any(|v| !v.valid),
                "{scheme}: needs a valid vector and a tampered one"
            );
            for check in check_vectors(p) {
                assert!(
                    check.agrees(),
                    "{scheme} vector {} ({}): recorded valid={}, verified {:?}",
                    check.index,
                    check.source,
                    check.recorded_valid,
                    check.verified
                );
            }
        }
    }
}
