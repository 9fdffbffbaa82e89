//! Partners that do not sign: a source with `auth = "partner"` admits a request by who sent it
//! and from where, never by a signature over its body. Checked in ingest before anything is
//! read or stored, failing closed, in this order:
//!
//! 1. A client certificate, whose SHA-256 fingerprint is one of the source's pins (two while one
//!    is rotated). In AWS the certificate comes from the partner domain's mutual TLS (API
//!    Gateway verified its chain against the truststore: our CA); locally from the runner's TLS
//!    listener. No certificate: the request did not come over the partner domain (401). Not
//!    pinned (403): un-pinning a certificate revokes it on the next request, whatever the CA
//!    says.
//! 2. Its source address (API Gateway's `requestContext.http.sourceIp`, the TCP peer locally;
//!    never `X-Forwarded-For`) inside one of the source's CIDRs, IPv4 or IPv6 (403).
//! 3. When the source names a timestamp header, a timestamp within its tolerance (401).
//!
//! A bearer token, when the source names its header, is then checked as any shared token is: a
//! declared `token` layout compared in constant time (`crate::signature`).

use std::net::IpAddr;
use std::time::Duration;

use http::HeaderMap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The client certificate a request came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// SHA-256 of its DER bytes: what a source pins.
    pub sha256: [u8; 32],
    /// When it expires, when the TLS layer said (API Gateway's `validity.notAfter`; the local
    /// runner reads it from the certificate).
    pub not_after: Option<chrono::DateTime<chrono::Utc>>,
    /// Its subject, for the operator.
    pub subject: Option<String>,
}

impl ClientCertificate {
    /// The certificate whose DER bytes are `der`.
    pub fn from_der(
        der: &[u8],
        not_after: Option<chrono::DateTime<chrono::Utc>>,
        subject: Option<String>,
    ) -> Self {
        ClientCertificate {
            sha256: Sha256::digest(der).into(),
            not_after,
            subject,
        }
    }

    /// The certificate in PEM text (API Gateway's `clientCertPem`, a file `openssl` wrote).
    pub fn from_pem(
        pem: &str,
        not_after: Option<chrono::DateTime<chrono::Utc>>,
        subject: Option<String>,
    ) -> Result<Self, PartnerConfigError> {
        Ok(Self::from_der(&pem_der(pem)?, not_after, subject))
    }

    /// Its fingerprint as a source pins it: lowercase hex.
    pub fn fingerprint(&self) -> String {
        hex::encode(self.sha256)
    }
}

/// The DER bytes of the first certificate in PEM text.
pub fn pem_der(pem: &str) -> Result<Vec<u8>, PartnerConfigError> {
    use base64::Engine as _;
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let body = pem
        .split_once(BEGIN)
        .and_then(|(_, rest)| rest.split_once(END))
        .map(|(body, _)| body)
        .ok_or(PartnerConfigError::NotPem)?;
    let text: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| PartnerConfigError::NotPem)
}

/// How API Gateway writes a client certificate's `validity.notAfter`
/// (`Aug  5 00:28:21 2120 GMT`, OpenSSL's form).
pub fn parse_not_after(text: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    chrono::NaiveDateTime::parse_from_str(&text, "%b %d %H:%M:%S %Y GMT")
        .ok()
        .map(|at| at.and_utc())
}

/// What a partner without a token is admitted as: no signature, no secret, no timestamp.
pub fn admitted_without_signature() -> crate::signature::Verified {
    static UNSIGNED: std::sync::LazyLock<crate::catalogue::SignatureSpec> =
        std::sync::LazyLock::new(|| {
            toml::from_str("kind = \"token\"\nsigned = []\nsigned_headers = []\n")
                .expect("a fixed layout (partners::tests reads it)")
        });
    crate::signature::Verified {
        secret: crate::domain::SecretVersion::Current,
        timestamp: None,
        signed_headers: &[],
        signed_digest: None,
        layout: &UNSIGNED,
    }
}

/// The layout that checks a partner's bearer token in `header`: a shared token compared in
/// constant time (as Okta's), `Bearer ` before it in an `Authorization` header.
pub fn token_layout(header: &str) -> Result<crate::catalogue::SignatureSpec, String> {
    let header = header.trim().to_ascii_lowercase();
    let prefix = if header == "authorization" {
        "Bearer "
    } else {
        ""
    };
    let text = format!(
        "kind = \"token\"\nheader = {header:?}\nprefix = {prefix:?}\n\
         signed = []\nsigned_headers = []\n"
    );
    toml::from_str(&text).map_err(|e| e.to_string())
}

/// A partner source's rules, as a sources file writes them (`[source.partner]`) and the
/// `sources` table keeps them (`partner`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerAuth {
    /// SHA-256 fingerprints of the client certificates admitted (hex, colons and case as
    /// `openssl x509 -fingerprint -sha256` prints them are accepted): one, or two while one is
    /// rotated.
    pub client_certificates: Vec<String>,
    /// The addresses it calls from, as CIDRs (`203.0.113.0/24`, `2001:db8::/48`; a bare address
    /// is one host).
    pub cidrs: Vec<String>,
    /// The header carrying a bearer token (`authorization`): its value, less `Bearer `, must be
    /// the secret at the source's `secret_ref`. None: no token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_header: Option<String>,
    /// The header carrying the partner's event id; none: the body's SHA-256 is the id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id_header: Option<String>,
    /// A header carrying the send time in Unix seconds, checked against the source's tolerance;
    /// none: no window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_header: Option<String>,
}

/// At most this many pinned certificates (two during a rotation; a few partners' systems).
pub const MAX_PINS: usize = 8;
/// At most this many CIDRs.
pub const MAX_CIDRS: usize = 64;

/// Why a `[source.partner]` table is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartnerConfigError {
    #[error("client_certificates is empty: the source would admit nobody")]
    NoPins,
    #[error(
        "client_certificates: {0:?} is not a SHA-256 fingerprint (64 hex digits; `hookctl sources fingerprint --pem FILE` prints it)"
    )]
    BadPin(String),
    #[error("cidrs is empty: the source would admit no address")]
    NoCidrs,
    #[error("cidrs: {0:?} is not an IPv4 or IPv6 CIDR")]
    BadCidr(String),
    #[error("at most {MAX_PINS} client_certificates and {MAX_CIDRS} cidrs")]
    TooMany,
    #[error("{0}: {1:?} is not a header name")]
    BadHeader(&'static str, String),
    #[error("not a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)")]
    NotPem,
}

/// A fingerprint as `openssl` or a person writes it, as 32 bytes.
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32], PartnerConfigError> {
    let digits: String = text
        .trim()
        .trim_start_matches("SHA256 Fingerprint=")
        .chars()
        .filter(|c| *c != ':')
        .collect();
    let mut out = [0u8; 32];
    hex::decode_to_slice(digits.to_ascii_lowercase(), &mut out)
        .map_err(|_| PartnerConfigError::BadPin(text.to_owned()))?;
    Ok(out)
}

/// [`PartnerAuth`] checked once, when a source is read: what ingest compares against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartnerRules {
    pub auth: PartnerAuth,
    pins: Vec<[u8; 32]>,
    cidrs: crate::address_lists::Ranges,
}

impl PartnerRules {
    pub fn new(auth: PartnerAuth) -> Result<Self, PartnerConfigError> {
        if auth.client_certificates.is_empty() {
            return Err(PartnerConfigError::NoPins);
        }
        if auth.client_certificates.len() > MAX_PINS || auth.cidrs.len() > MAX_CIDRS {
            return Err(PartnerConfigError::TooMany);
        }
        for (what, header) in [
            ("token_header", &auth.token_header),
            ("event_id_header", &auth.event_id_header),
            ("timestamp_header", &auth.timestamp_header),
        ] {
            if let Some(name) = header
                && http::HeaderName::from_bytes(name.as_bytes()).is_err()
            {
                return Err(PartnerConfigError::BadHeader(what, name.clone()));
            }
        }
        let pins: Vec<[u8; 32]> = auth
            .client_certificates
            .iter()
            .map(|p| parse_fingerprint(p))
            .collect::<Result<_, _>>()?;
        // Kept as lowercase hex, as the certificates' table and the expiry check read them.
        let mut auth = auth;
        auth.client_certificates = pins.iter().map(hex::encode).collect();
        use crate::address_lists::{AddressListError, Ranges};
        let cidrs = Ranges::parse(&auth.cidrs).map_err(|e| match e {
            AddressListError::Empty => PartnerConfigError::NoCidrs,
            AddressListError::Invalid { entry } => PartnerConfigError::BadCidr(entry),
            AddressListError::TooMany { .. } => PartnerConfigError::TooMany,
        })?;
        Ok(PartnerRules { auth, pins, cidrs })
    }

    /// Whether `certificate` is pinned.
    pub fn pins(&self, certificate: &ClientCertificate) -> bool {
        self.pins.contains(&certificate.sha256)
    }

    /// Admits a request that came with `certificate` from `address`, or says why not.
    pub fn admit(
        &self,
        certificate: Option<&ClientCertificate>,
        address: Option<IpAddr>,
        headers: &HeaderMap,
        tolerance: Duration,
        now_unix: i64,
    ) -> Result<(), PartnerRefusal> {
        let certificate = certificate.ok_or(PartnerRefusal::NoClientCertificate)?;
        if !self.pins(certificate) {
            return Err(PartnerRefusal::NotPinned {
                fingerprint: certificate.fingerprint(),
            });
        }
        let address = address.ok_or(PartnerRefusal::NoAddress)?;
        // An IPv4 client reaching an IPv6 socket shows as ::ffff:a.b.c.d: read as IPv4.
        let address = address.to_canonical();
        if !self.cidrs.contains(address) {
            return Err(PartnerRefusal::AddressNotAllowed {
                address: address.to_string(),
            });
        }
        if let Some(name) = &self.auth.timestamp_header {
            let sent = headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<i64>().ok())
                .ok_or(PartnerRefusal::NoTimestamp)?;
            let skew = now_unix.saturating_sub(sent).unsigned_abs();
            if skew > tolerance.as_secs() {
                return Err(PartnerRefusal::StaleTimestamp {
                    skew_seconds: skew,
                    tolerance_seconds: tolerance.as_secs(),
                });
            }
        }
        Ok(())
    }
}

/// Why a partner's request was refused, before anything was read or stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartnerRefusal {
    #[error(
        "no client certificate: a partner is admitted only over the partner domain's mutual TLS"
    )]
    NoClientCertificate,
    #[error("the client certificate (SHA-256 {fingerprint}) is not pinned by this source")]
    NotPinned { fingerprint: String },
    #[error("the request's source address is unknown")]
    NoAddress,
    #[error("the source address {address} is in none of this source's CIDRs")]
    AddressNotAllowed { address: String },
    #[error("no timestamp header, or not Unix seconds")]
    NoTimestamp,
    #[error("timestamp {skew_seconds} s from now, outside the tolerance of {tolerance_seconds} s")]
    StaleTimestamp {
        skew_seconds: u64,
        tolerance_seconds: u64,
    },
}

impl PartnerRefusal {
    /// A short stable label for logs, metrics and the refusal record.
    pub fn reason_code(&self) -> &'static str {
        match self {
            PartnerRefusal::NoClientCertificate => "no_client_certificate",
            PartnerRefusal::NotPinned { .. } => "certificate_not_pinned",
            PartnerRefusal::NoAddress | PartnerRefusal::AddressNotAllowed { .. } => {
                "address_not_allowed"
            }
            PartnerRefusal::NoTimestamp => "missing_timestamp",
            PartnerRefusal::StaleTimestamp { .. } => "stale_timestamp",
        }
    }

    /// The HTTP status: 401 when the request did not authenticate (no certificate, no or a
    /// stale timestamp), 403 when it did and is not allowed (not pinned, not from its
    /// addresses).
    pub fn status(&self) -> u16 {
        match self {
            PartnerRefusal::NoClientCertificate
            | PartnerRefusal::NoTimestamp
            | PartnerRefusal::StaleTimestamp { .. } => 401,
            PartnerRefusal::NotPinned { .. }
            | PartnerRefusal::NoAddress
            | PartnerRefusal::AddressNotAllowed { .. } => 403,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> PartnerRules {
        PartnerRules::new(PartnerAuth {
            client_certificates: vec![hex::encode(Sha256::digest(b"cert-a"))],
            cidrs: vec![
                "203.0.113.0/24".into(),
                "2001:db8::/32".into(),
                "127.0.0.1".into(),
            ],
            token_header: None,
            event_id_header: None,
            timestamp_header: Some("x-sent-at".into()),
        })
        .unwrap()
    }

    fn cert(der: &[u8]) -> ClientCertificate {
        ClientCertificate::from_der(der, None, None)
    }

    fn sent(at: i64) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("x-sent-at", at.to_string().parse().unwrap());
        headers
    }

    #[test]
    fn every_check_fails_closed_in_order() {
        let r = rules();
        let ok = cert(b"cert-a");
        let inside: IpAddr = "203.0.113.9".parse().unwrap();
        let t = Duration::from_secs(300);
        assert_eq!(
            r.admit(Some(&ok), Some(inside), &sent(1000), t, 1000),
            Ok(())
        );
        assert_eq!(
            r.admit(None, Some(inside), &sent(1000), t, 1000),
            Err(PartnerRefusal::NoClientCertificate)
        );
        assert_eq!(
            r.admit(Some(&cert(b"cert-b")), Some(inside), &sent(1000), t, 1000)
                .unwrap_err()
                .reason_code(),
            "certificate_not_pinned"
        );
        for outside in ["198.51.100.1", "2001:db9::1", "127.0.0.2"] {
            assert_eq!(
                r.admit(
                    Some(&ok),
                    Some(outside.parse().unwrap()),
                    &sent(1000),
                    t,
                    1000
                )
                .unwrap_err()
                .status(),
                403,
                "{outside}"
            );
        }
        let v6: IpAddr = "2001:db8:1::7".parse().unwrap();
        assert_eq!(r.admit(Some(&ok), Some(v6), &sent(1000), t, 1000), Ok(()));
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(
            r.admit(Some(&ok), Some(mapped), &sent(1000), t, 1000),
            Ok(())
        );
        assert_eq!(
            r.admit(Some(&ok), None, &sent(1000), t, 1000),
            Err(PartnerRefusal::NoAddress)
        );
        assert_eq!(
            r.admit(Some(&ok), Some(inside), &HeaderMap::new(), t, 1000),
            Err(PartnerRefusal::NoTimestamp)
        );
        assert_eq!(
            r.admit(Some(&ok), Some(inside), &sent(1000), t, 1301)
                .unwrap_err()
                .reason_code(),
            "stale_timestamp"
        );
    }

    #[test]
    fn pins_are_read_as_openssl_prints_them_and_bad_rules_are_refused() {
        let digest = Sha256::digest(b"x");
        let colons = digest
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(
            parse_fingerprint(&format!("SHA256 Fingerprint={colons}")).unwrap(),
            <[u8; 32]>::from(digest)
        );
        let auth = |pins: Vec<&str>, cidrs: Vec<&str>| PartnerAuth {
            client_certificates: pins.into_iter().map(str::to_owned).collect(),
            cidrs: cidrs.into_iter().map(str::to_owned).collect(),
            token_header: None,
            event_id_header: None,
            timestamp_header: None,
        };
        let pin = hex::encode(digest);
        assert_eq!(
            PartnerRules::new(auth(vec![], vec!["10.0.0.0/8"])).unwrap_err(),
            PartnerConfigError::NoPins
        );
        assert_eq!(
            PartnerRules::new(auth(vec![&pin], vec![])).unwrap_err(),
            PartnerConfigError::NoCidrs
        );
        assert!(matches!(
            PartnerRules::new(auth(vec!["abc"], vec!["10.0.0.0/8"])),
            Err(PartnerConfigError::BadPin(_))
        ));
        assert!(matches!(
            PartnerRules::new(auth(vec![&pin], vec!["10.0.0.0/33"])),
            Err(PartnerConfigError::BadCidr(_))
        ));
    }

    #[test]
    fn the_fixed_layouts_read() {
        assert!(admitted_without_signature().layout.name.is_none());
        let token = token_layout("Authorization").unwrap();
        assert_eq!(token.prefix, "Bearer ");
        assert!(crate::catalogue::declare(token).is_ok());
        assert_eq!(token_layout("x-partner-token").unwrap().prefix, "");
    }

    #[test]
    fn api_gateways_not_after_and_a_pem_certificate_are_read() {
        assert_eq!(
            parse_not_after("Aug  5 00:28:21 2120 GMT")
                .unwrap()
                .to_rfc3339(),
            "2120-08-05T00:28:21+00:00"
        );
        assert_eq!(parse_not_after("tomorrow"), None);
        assert_eq!(
            pem_der("not a certificate"),
            Err(PartnerConfigError::NotPem)
        );
        let pem = "-----BEGIN CERTIFICATE-----\nY2VydC1h\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_der(pem).unwrap(), b"cert-a");
    }
}
