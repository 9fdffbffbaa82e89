//! The provider's own API, as gap detection and backfill use it: Stripe-style
//! `GET /v1/events?created[gte]=..&created[lt]=..&limit=100&starting_after=..` (newest first,
//! `has_more` paging) and `GET /v1/events/{id}`, authenticated with a bearer API key.

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
            Ok(r) => Fetched::Failed(format!("provider answered {}", r.status())),
            Err(e) => Fetched::Failed(format!("request failed: {e}")),
        }
    }

    /// IDs of events created in `[from, to)` (Unix seconds), following the cursor for at most
    /// `max_pages` pages of 100.
    pub async fn list_ids(
        &self,
        from: i64,
        to: i64,
        max_pages: usize,
    ) -> Result<Vec<String>, String> {
        let mut ids = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..max_pages {
            let mut query = vec![
                ("created[gte]", from.to_string()),
                ("created[lt]", to.to_string()),
                ("limit", "100".to_owned()),
            ];
            if let Some(a) = &after {
                query.push(("starting_after", a.clone()));
            }
            let page: Value = self
                .http
                .get(format!("{}/v1/events", self.base_url))
                .bearer_auth(self.api_key.expose_secret())
                .query(&query)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(|e| format!("listing events: {e}"))?
                .json()
                .await
                .map_err(|e| format!("listing events: {e}"))?;
            let data = page["data"]
                .as_array()
                .ok_or("listing events: no data array")?;
            ids.extend(
                data.iter()
                    .filter_map(|e| e["id"].as_str().map(str::to_owned)),
            );
            after = ids.last().cloned();
            if page["has_more"] != Value::Bool(true) || data.is_empty() {
                return Ok(ids);
            }
        }
        Err(format!(
            "listing events: more than {max_pages} pages; narrow the window"
        ))
    }
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
