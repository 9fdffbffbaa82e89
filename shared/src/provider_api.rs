//! The provider's own API, as gap detection and backfill use it: Stripe-style
//! `GET /v1/events?created[gte]=..&created[lt]=..&limit=100&types[]=..&starting_after=..`
//! (newest first, `has_more` paging) and `GET /v1/events/{id}`, authenticated with a bearer API
//! key.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

/// What fetching one event by ID found.
#[derive(Debug)]
pub enum Fetched {
    /// The event exactly as the provider sent it (checked for JSON when its fields are read).
    Found(Vec<u8>),
    /// The provider says the ID does not exist (HTTP 404).
    NotFound,
    /// Anything else: try again on a later pass.
    Failed(String),
}

pub struct ProviderApi {
    http: reqwest::Client,
    base_url: String,
    api_key: SecretString,
}

impl ProviderApi {
    pub fn new(base_url: &str, api_key: &str, timeout: Duration) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(crate::redirects::never())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            api_key: SecretString::from(api_key.to_owned()),
        })
    }

    pub async fn fetch(&self, id: &str) -> Fetched {
        let url = format!("{}/v1/events/{}", self.base_url, percent_encode(id));
        match self
            .http
            .get(url)
            .bearer_auth(self.api_key.expose_secret())
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => match r.bytes().await {
                Ok(body) => Fetched::Found(body.to_vec()),
                Err(e) => Fetched::Failed(format!("reading the event failed: {e}")),
            },
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => Fetched::NotFound,
            Ok(r) if r.status().is_redirection() => {
                Fetched::Failed(crate::redirects::reason("provider", &r))
            }
            Ok(r) => Fetched::Failed(format!("provider answered {}", r.status())),
            Err(e) => Fetched::Failed(format!("request failed: {e}")),
        }
    }

    /// IDs of events created in `[from, to)` (Unix seconds) of the given types (all types when
    /// `None`), following the cursor for at most `max_pages` pages of 100 in all. Stripe takes up
    /// to 20 `types[]` per listing; more are listed in groups of 20. Past `max_pages` the listing
    /// stops and says so: the IDs listed are still good (newest first, so what is missing is the
    /// oldest part of the window).
    pub async fn list_ids(
        &self,
        from: i64,
        to: i64,
        max_pages: usize,
        types: Option<&[String]>,
    ) -> Result<Listing, String> {
        let groups: Vec<&[String]> = match types {
            Some(types) => types.chunks(MAX_TYPES_PER_LISTING).collect(),
            None => vec![&[]],
        };
        let mut listing = Listing::default();
        let mut pages = 0;
        for group in groups {
            let more = self
                .list_group(from, to, group, max_pages - pages, &mut listing.ids)
                .await?;
            match more {
                Some(used) => pages += used,
                None => {
                    listing.truncated = true;
                    return Ok(listing);
                }
            }
        }
        Ok(listing)
    }

    /// One listing (one group of types): `Some(pages used)` when it reached its end, `None`
    /// when `max_pages` ran out first.
    async fn list_group(
        &self,
        from: i64,
        to: i64,
        types: &[String],
        max_pages: usize,
        ids: &mut Vec<String>,
    ) -> Result<Option<usize>, String> {
        let mut after: Option<String> = None;
        for page_number in 1..=max_pages {
            let mut query = vec![
                ("created[gte]", from.to_string()),
                ("created[lt]", to.to_string()),
                ("limit", "100".to_owned()),
            ];
            query.extend(types.iter().map(|t| ("types[]", t.clone())));
            if let Some(a) = &after {
                query.push(("starting_after", a.clone()));
            }
            let response = self
                .http
                .get(format!("{}/v1/events", self.base_url))
                .bearer_auth(self.api_key.expose_secret())
                .query(&query)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(|e| format!("listing events: {e}"))?;
            if response.status().is_redirection() {
                let why = crate::redirects::reason("provider", &response);
                return Err(format!("listing events: {why}"));
            }
            let page: Value = response
                .json()
                .await
                .map_err(|e| format!("listing events: {e}"))?;
            let data = page["data"]
                .as_array()
                .ok_or("listing events: no data array")?;
            let listed: Vec<String> = data
                .iter()
                .filter_map(|e| e["id"].as_str().map(str::to_owned))
                .collect();
            after = listed.last().cloned();
            ids.extend(listed);
            if page["has_more"] != Value::Bool(true) || data.is_empty() {
                return Ok(Some(page_number));
            }
        }
        Ok(None)
    }
}

/// Stripe's `types[]` takes up to 20 event types.
pub const MAX_TYPES_PER_LISTING: usize = 20;

/// What a listing found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    pub ids: Vec<String>,
    /// The page limit ran out before the listing's end.
    pub truncated: bool,
}

fn percent_encode(id: &str) -> String {
    id.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
