//! GitHub's webhook deliveries API, as backfill uses it. GitHub never retries a failed
//! delivery; its documented recovery is to list the hook's deliveries and ask for the failed
//! ones again:
//!
//! - `GET {hook}/deliveries?per_page=100[&cursor=…]`: the hook's deliveries, newest first, each
//!   with its numeric `id` (one delivery attempt) and its `guid` (the event: the
//!   `X-GitHub-Delivery` header, shared by every delivery of it, redeliveries included), paged by
//!   the `Link` header's `rel="next"` URL;
//! - `POST {hook}/deliveries/{id}/attempts`: redeliver (202); GitHub then POSTs the event again,
//!   signed, with the same GUID, and it arrives through ingest like any delivery.
//!
//! `{hook}` is a repository hook (`/repos/{owner}/{repo}/hooks/{hook_id}`), an organisation hook
//! (`/orgs/{org}/hooks/{hook_id}`) or a GitHub App's (`/app/hook`). Repository and organisation
//! hooks authenticate with a token (bearer); an App's hook only with a JSON Web Token the App
//! signs with its private key (RS256, at most 10 minutes), minted here for each pass.

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// GitHub's REST API version this client speaks.
const API_VERSION: &str = "2022-11-28";
/// GitHub refuses requests without a User-Agent.
const USER_AGENT: &str = "webhook-receiver-backfill";
/// The most deliveries GitHub returns per page.
const PER_PAGE: usize = 100;

/// Where a hook's deliveries are, as a source's `gaps.hook` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookPath(String);

impl HookPath {
    /// `/repos/{owner}/{repo}/hooks/{id}`, `/orgs/{org}/hooks/{id}` or `/app/hook`.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let name = |s: &str| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.len() <= 100
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let id = |s: &str| !s.is_empty() && s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit());
        let parts: Vec<&str> = raw.trim_end_matches('/').split('/').collect();
        let ok = match parts.as_slice() {
            ["", "app", "hook"] => true,
            ["", "repos", owner, repo, "hooks", hook] => name(owner) && name(repo) && id(hook),
            ["", "orgs", org, "hooks", hook] => name(org) && id(hook),
            _ => false,
        };
        if ok {
            Ok(Self(parts.join("/")))
        } else {
            Err(format!(
                "gaps.hook {raw:?} is none of /repos/{{owner}}/{{repo}}/hooks/{{hook_id}}, \
                 /orgs/{{org}}/hooks/{{hook_id}}, /app/hook"
            ))
        }
    }

    /// A GitHub App's hook: reached only with the App's JSON Web Token.
    pub fn is_app(&self) -> bool {
        self.0 == "/app/hook"
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How backfill proves itself to GitHub.
pub enum Credential {
    /// A token allowed to read the hook and redeliver (`admin:repo_hook` / `admin:org_hook`, or
    /// a fine-grained token with the Webhooks permission).
    Token(SecretString),
    /// A GitHub App: its id (or client id) and private key.
    App {
        app_id: String,
        key: Box<ring::signature::RsaKeyPair>,
    },
}

impl Credential {
    /// The App's credential from its private key as GitHub hands it out (PEM, PKCS#1 `RSA PRIVATE
    /// KEY`, or PKCS#8 `PRIVATE KEY`). The error never contains the key.
    pub fn app(app_id: &str, private_key_pem: &str) -> Result<Self, String> {
        let der = pem_body(private_key_pem)
            .ok_or("the GitHub App private key is not a PEM private key")?;
        let key = if private_key_pem.contains("BEGIN RSA PRIVATE KEY") {
            ring::signature::RsaKeyPair::from_der(&der)
        } else {
            ring::signature::RsaKeyPair::from_pkcs8(&der)
        }
        .map_err(|e| format!("the GitHub App private key is not a usable RSA key ({e})"))?;
        Ok(Self::App {
            app_id: app_id.to_owned(),
            key: Box::new(key),
        })
    }

    fn bearer(&self, now: i64) -> Result<SecretString, String> {
        match self {
            Credential::Token(token) => Ok(token.clone()),
            Credential::App { app_id, key } => app_jwt(app_id, key, now).map(SecretString::from),
        }
    }
}

/// The base64 body of a PEM block.
fn pem_body(pem: &str) -> Option<Vec<u8>> {
    let body: String = pem
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("-----"))
        .collect();
    if !pem.contains("-----BEGIN") || body.is_empty() {
        return None;
    }
    base64::engine::general_purpose::STANDARD.decode(body).ok()
}

/// A GitHub App's JSON Web Token: RS256, issued a minute in the past (clock drift, as GitHub
/// advises) and valid for nine minutes (GitHub allows ten).
pub fn app_jwt(
    app_id: &str,
    key: &ring::signature::RsaKeyPair,
    now: i64,
) -> Result<String, String> {
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let header = b64(br#"{"alg":"RS256","typ":"JWT"}"#);
    let claims = serde_json::json!({"iat": now - 60, "exp": now + 540, "iss": app_id});
    let signed = format!("{header}.{}", b64(claims.to_string().as_bytes()));
    let mut signature = vec![0; key.public().modulus_len()];
    key.sign(
        &ring::signature::RSA_PKCS1_SHA256,
        &ring::rand::SystemRandom::new(),
        signed.as_bytes(),
        &mut signature,
    )
    .map_err(|_| "signing the GitHub App token failed".to_owned())?;
    Ok(format!("{signed}.{}", b64(&signature)))
}

/// One delivery of the hook, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HookDelivery {
    /// This delivery attempt: what a redelivery is asked for by.
    pub id: i64,
    /// The event: `X-GitHub-Delivery`, the source's event id.
    pub guid: String,
    pub delivered_at: DateTime<Utc>,
    #[serde(default)]
    pub redelivery: bool,
    #[serde(default)]
    pub status_code: Option<i64>,
    #[serde(default)]
    pub event: Option<String>,
}

/// What a listing found: per event (GUID), its newest delivery's id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryListing {
    pub events: Vec<(String, i64)>,
    /// The page limit ran out before the window's start.
    pub truncated: bool,
}

/// What asking for a redelivery came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redelivery {
    /// GitHub accepted (202): the event will arrive through ingest.
    Requested,
    /// GitHub no longer has the delivery (404): it keeps deliveries for a few days only.
    Gone,
    /// Anything else: try again on a later pass.
    Failed(String),
}

pub struct GithubApi {
    http: reqwest::Client,
    /// `https://api.github.com` followed by the hook path.
    hook_url: String,
    base_url: String,
    credential: Credential,
}

impl GithubApi {
    pub fn new(
        base_url: &str,
        hook: &HookPath,
        credential: Credential,
        timeout: Duration,
    ) -> Result<Self, String> {
        // No redirect is followed: GitHub answers a renamed repository's hook path with a 301,
        // which would turn a redelivery POST into a GET (read as "gone"); the 3xx names the new
        // path for the operator to configure.
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .user_agent(USER_AGENT)
            .redirect(crate::redirects::never())
            .build()
            .map_err(|e| e.to_string())?;
        let base_url = base_url.trim_end_matches('/').to_owned();
        Ok(Self {
            http,
            hook_url: format!("{base_url}{}", hook.as_str()),
            base_url,
            credential,
        })
    }

    fn request(
        &self,
        method: reqwest::Method,
        url: &str,
    ) -> Result<reqwest::RequestBuilder, String> {
        let bearer = self.credential.bearer(Utc::now().timestamp())?;
        Ok(self
            .http
            .request(method, url)
            .bearer_auth(bearer.expose_secret())
            .header("accept", "application/vnd.github+json")
            .header("x-github-api-version", API_VERSION))
    }

    /// The events delivered since `since` (of `event_types`, when given), each with its newest
    /// delivery id, following `Link: rel="next"` for at most `max_pages` pages. GitHub lists
    /// newest first: the listing ends at the first delivery older than `since`.
    pub async fn list_deliveries(
        &self,
        since: DateTime<Utc>,
        max_pages: usize,
        event_types: Option<&[String]>,
    ) -> Result<DeliveryListing, String> {
        let mut newest: std::collections::HashMap<String, i64> = Default::default();
        let mut order = Vec::new();
        let mut next = Some(format!("{}/deliveries?per_page={PER_PAGE}", self.hook_url));
        let mut pages = 0;
        while let Some(url) = next.take() {
            if pages == max_pages {
                return Ok(listing(order, newest, true));
            }
            pages += 1;
            let response = self
                .request(reqwest::Method::GET, &url)?
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(|e| format!("listing deliveries: {e}"))?;
            if response.status().is_redirection() {
                let why = crate::redirects::reason("GitHub", &response);
                return Err(format!("listing deliveries: {why}"));
            }
            next = next_link(response.headers(), &self.base_url);
            let page: Vec<HookDelivery> = response
                .json()
                .await
                .map_err(|e| format!("listing deliveries: {e}"))?;
            let mut reached_since = page.is_empty();
            for d in page {
                if d.delivered_at < since {
                    reached_since = true;
                    continue;
                }
                let wanted = match (event_types, &d.event) {
                    (None, _) => true,
                    (Some(types), Some(event)) => types.iter().any(|t| t == event),
                    (Some(_), None) => false,
                };
                if !wanted {
                    continue;
                }
                let id = newest.entry(d.guid.clone()).or_insert_with(|| {
                    order.push(d.guid.clone());
                    d.id
                });
                *id = (*id).max(d.id);
            }
            if reached_since {
                break;
            }
        }
        Ok(listing(order, newest, false))
    }

    /// Asks GitHub to deliver delivery `id` again.
    pub async fn redeliver(&self, id: i64) -> Redelivery {
        let url = format!("{}/deliveries/{id}/attempts", self.hook_url);
        let request = match self.request(reqwest::Method::POST, &url) {
            Ok(request) => request,
            Err(why) => return Redelivery::Failed(why),
        };
        match request.send().await {
            Ok(r) if r.status().is_success() => Redelivery::Requested,
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => Redelivery::Gone,
            Ok(r) if r.status().is_redirection() => {
                Redelivery::Failed(crate::redirects::reason("GitHub", &r))
            }
            Ok(r) => Redelivery::Failed(format!("GitHub answered {}", r.status())),
            Err(e) => Redelivery::Failed(format!("request failed: {e}")),
        }
    }
}

fn listing(
    order: Vec<String>,
    newest: std::collections::HashMap<String, i64>,
    truncated: bool,
) -> DeliveryListing {
    let events = order
        .into_iter()
        .filter_map(|guid| newest.get(&guid).map(|id| (guid, *id)))
        .collect();
    DeliveryListing { events, truncated }
}

/// The `rel="next"` URL of a `Link` header, when it points at the same API (the token is never
/// sent anywhere else).
fn next_link(headers: &reqwest::header::HeaderMap, base_url: &str) -> Option<String> {
    let link = headers.get(reqwest::header::LINK)?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        let url = url.trim().strip_prefix('<')?.strip_suffix('>')?;
        let is_next = params
            .split(';')
            .any(|p| p.trim().replace(' ', "") == "rel=\"next\"");
        (is_next && url.starts_with(&format!("{base_url}/"))).then(|| url.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_paths_are_the_three_github_shapes() {
        for ok in [
            "/repos/acme/api/hooks/12345",
            "/orgs/acme/hooks/7",
            "/app/hook",
            "/app/hook/",
        ] {
            assert!(HookPath::parse(ok).is_ok(), "{ok}");
        }
        assert!(HookPath::parse("/app/hook").unwrap().is_app());
        for bad in [
            "repos/acme/api/hooks/1",
            "/repos/acme/hooks/1",
            "/repos/acme/api/hooks/x",
            "/orgs/acme/hooks/1/deliveries",
            "/repos/../api/hooks/1",
            "/users/me/hooks/1",
        ] {
            assert!(HookPath::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_a_next_link_to_the_same_api_is_followed() {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::LINK,
            reqwest::header::HeaderValue::from_static(
                "<https://api.github.com/app/hook/deliveries?per_page=100&cursor=v1_7>; rel=\"next\", \
                 <https://api.github.com/app/hook/deliveries?per_page=100>; rel=\"first\"",
            ),
        );
        assert_eq!(
            next_link(&headers, "https://api.github.com").as_deref(),
            Some("https://api.github.com/app/hook/deliveries?per_page=100&cursor=v1_7")
        );
        assert_eq!(next_link(&headers, "https://evil.example"), None);
        headers.insert(
            reqwest::header::LINK,
            reqwest::header::HeaderValue::from_static(
                "<https://api.github.com/app/hook/deliveries?per_page=100>; rel=\"first\"",
            ),
        );
        assert_eq!(next_link(&headers, "https://api.github.com"), None);
    }

    #[test]
    fn a_private_key_that_is_not_one_is_refused_without_echoing_it() {
        for bad in [
            "",
            "not a key",
            "-----BEGIN RSA PRIVATE KEY-----\nc2VjcmV0\n-----END RSA PRIVATE KEY-----",
        ] {
            let Err(why) = Credential::app("1", bad) else {
                panic!("accepted {bad:?}")
            };
            assert!(!why.contains("c2VjcmV0"), "{why}");
        }
    }
}
