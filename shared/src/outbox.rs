//! The outbox sender: delivers side effects written by the drain to the configured HTTP
//! target, at least once, with an `Idempotency-Key` header so the target can make it exactly
//! once. Messages are leased (their next attempt pushed ahead and committed) before delivery,
//! so no transaction is open while waiting on the network and a crashed sender's lease expires.
//!
//! Attempts count tries, not leases: the deadline is checked before each message, a request
//! never outlives it, what was leased and not sent is handed back at once, and an attempt is
//! spent only when a request was sent.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;

use crate::drain::retry_delay;
use crate::store::StoreError;
use crate::store::outbox::{self, OutboxMessage};

#[derive(Debug, Clone)]
pub struct OutboxSettings {
    /// Where messages are POSTed.
    pub target_url: String,
    pub batch_size: i64,
    pub max_attempts: i32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub request_timeout: Duration,
}

impl OutboxSettings {
    pub fn new(target_url: impl Into<String>) -> Self {
        Self {
            target_url: target_url.into(),
            batch_size: 50,
            max_attempts: 10,
            backoff_base: Duration::from_secs(2),
            backoff_cap: Duration::from_secs(3600),
            request_timeout: Duration::from_secs(10),
        }
    }

    /// How long a leased message is hidden from other senders: long enough for the whole
    /// batch, delivered one by one, to time out, so a slow batch is never leased twice.
    pub fn lease(&self) -> Duration {
        self.request_timeout
            .saturating_mul(u32::try_from(self.batch_size + 1).unwrap_or(u32::MAX))
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(1..=1000).contains(&self.batch_size) {
            return Err(format!(
                "batch size {} is outside 1..=1000",
                self.batch_size
            ));
        }
        if self.max_attempts < 1 {
            return Err("max attempts must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return Err("the request timeout must be positive".into());
        }
        if self.backoff_base.is_zero() || self.backoff_cap < self.backoff_base {
            return Err("backoff base must be positive and not above the cap".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OutboxOutcome {
    pub leased: u64,
    pub delivered: u64,
    pub retried: u64,
    pub failed: u64,
    /// Leased, then handed back untried: the deadline came first.
    pub handed_back: u64,
}

pub struct OutboxSender {
    pool: PgPool,
    http: reqwest::Client,
    settings: OutboxSettings,
}

enum Delivery {
    Delivered,
    /// Worth trying again (timeouts, 408, 429, 5xx, connection errors).
    Transient(String),
    /// The target refused the message for good (other 4xx), or redirected it (3xx).
    Refused(String),
}

impl OutboxSender {
    pub fn new(pool: PgPool, settings: OutboxSettings) -> Result<Self, reqwest::Error> {
        // Never follow a redirect: reqwest would turn a 301/302/303 POST into a bodiless GET,
        // and the 200 of the page it lands on (a login page, the same path with a trailing
        // slash) would mark the message delivered while nothing arrived.
        let http = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .redirect(crate::redirects::never())
            .build()?;
        Ok(Self {
            pool,
            http,
            settings,
        })
    }

    /// Sends until a batch comes back short or `deadline` passes; no request outlives it.
    #[tracing::instrument(skip_all, err)]
    pub async fn send_until(&self, deadline: Instant) -> Result<OutboxOutcome, StoreError> {
        let mut total = OutboxOutcome::default();
        while Instant::now() < deadline {
            let batch = self.run_once(deadline).await?;
            total.leased += batch.leased;
            total.delivered += batch.delivered;
            total.retried += batch.retried;
            total.failed += batch.failed;
            total.handed_back += batch.handed_back;
            if batch.leased < self.settings.batch_size as u64 || batch.handed_back > 0 {
                break;
            }
        }
        // Measured after sending, so a healthy pass reports what it could not deliver (issue 23:
        // a target going down shows here within minutes, long before the retry budget ends).
        let oldest = outbox::oldest_undelivered_age(&self.pool).await?;
        crate::metrics::outbox(total.retried, oldest);
        if total.leased > 0 {
            tracing::info!(
                leased = total.leased,
                delivered = total.delivered,
                retried = total.retried,
                failed = total.failed,
                handed_back = total.handed_back,
                "outbox pass finished"
            );
        } else {
            tracing::debug!("outbox pass: nothing due");
        }
        Ok(total)
    }

    /// Leases one batch and delivers it, one message at a time, until `deadline`: what is left
    /// when it passes is handed back untried.
    pub async fn run_once(&self, deadline: Instant) -> Result<OutboxOutcome, StoreError> {
        let messages = outbox::lease(
            &self.pool,
            self.settings.batch_size,
            self.settings.lease().as_secs_f64(),
        )
        .await?;
        let mut outcome = OutboxOutcome {
            leased: messages.len() as u64,
            ..OutboxOutcome::default()
        };
        for (i, message) in messages.iter().enumerate() {
            let Some(left) = deadline
                .checked_duration_since(Instant::now())
                .filter(|left| !left.is_zero())
            else {
                let untried: Vec<i64> = messages[i..].iter().map(|m| m.outbox_id).collect();
                outcome.handed_back = outbox::release(&self.pool, &untried).await?;
                break;
            };
            // This try is attempt number `attempts + 1`.
            let tries = message.attempts + 1;
            match self
                .deliver(message, left.min(self.settings.request_timeout))
                .await
            {
                Delivery::Delivered => {
                    outbox::mark_delivered(&self.pool, message.outbox_id).await?;
                    outcome.delivered += 1;
                }
                Delivery::Transient(why) if tries < self.settings.max_attempts => {
                    let delay = retry_delay(
                        tries - 1,
                        self.settings.backoff_base,
                        self.settings.backoff_cap,
                    );
                    outbox::retry_later(
                        &self.pool,
                        message.outbox_id,
                        delay.as_millis() as i64,
                        &why,
                    )
                    .await?;
                    outcome.retried += 1;
                }
                Delivery::Transient(why) | Delivery::Refused(why) => {
                    tracing::warn!(outbox_id = message.outbox_id, action = %message.action, %why, "outbox message failed for good");
                    outbox::mark_failed(&self.pool, message.outbox_id, &why).await?;
                    outcome.failed += 1;
                }
            }
        }
        Ok(outcome)
    }

    async fn deliver(&self, message: &OutboxMessage, timeout: Duration) -> Delivery {
        let body = serde_json::json!({
            "action": message.action,
            "tenant_id": message.tenant_id,
            "event_id": message.external_id,
            "payload": message.payload,
        });
        let sent = self
            .http
            .post(&self.settings.target_url)
            .header("Idempotency-Key", &message.idempotency_key)
            .timeout(timeout)
            .json(&body)
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => Delivery::Delivered,
            Ok(response) if response.status().is_redirection() => {
                // Permanent: the target sends every message to the same place (single sign-on,
                // a moved URL), and retrying cannot change that. The message waits, failed,
                // for an operator who fixes the target URL and resends it.
                Delivery::Refused(crate::redirects::reason("target", &response))
            }
            Ok(response) => {
                let status = response.status();
                let why = format!("target answered {status}");
                if status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429 {
                    Delivery::Transient(why)
                } else {
                    Delivery::Refused(why)
                }
            }
            Err(error) => Delivery::Transient(format!("request failed: {error}")),
        }
    }
}
