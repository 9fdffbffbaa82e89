//! The outbox sender: delivers side effects written by the drain to where their route sends
//! them (issue 24): an HTTP target, with an `Idempotency-Key` header so the target can make it
//! exactly once, an EventBridge bus, an SQS queue or an SNS topic, in those services' batch
//! calls, each message carrying its idempotency key. Messages are leased (their next attempt
//! pushed ahead and committed) before delivery, so no transaction is open while waiting on the
//! network and a crashed sender's lease expires.
//!
//! Attempts count tries, not leases: the deadline is checked before each call, a call never
//! outlives it, what was leased and not sent is handed back at once, and an attempt is spent
//! only on a message a call carried. Each message of a batch call has its own outcome: one
//! entry failing inside a call that succeeded is retried (or failed) alone.
//!
//! A message no route covers, when no default target is configured, fails at once with the
//! reason and without spending an attempt: the operator sees it (`hookctl outbox list`,
//! `status`), adds the route and resends it.

pub mod destinations;
pub mod routes;

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;

use crate::drain::retry_delay;
use crate::store::StoreError;
use crate::store::outbox::{self, OutboxMessage};
use destinations::{AwsDestinationEndpoints, Delivery, Destination, Destinations, Outgoing};
use routes::RouteTable;

#[derive(Debug, Clone)]
pub struct OutboxSettings {
    /// Where a message no route covers is POSTed (`OUTBOX_TARGET_URL`, today's single
    /// target); `None` (`OUTBOX_TARGET_URL=none`): routes only, an unrouted message fails.
    pub target_url: Option<String>,
    /// Endpoint overrides of the AWS destinations.
    pub endpoints: AwsDestinationEndpoints,
    pub batch_size: i64,
    pub max_attempts: i32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub request_timeout: Duration,
}

impl OutboxSettings {
    pub fn new(target_url: impl Into<String>) -> Self {
        Self {
            target_url: Some(target_url.into()),
            endpoints: AwsDestinationEndpoints::default(),
            batch_size: 50,
            max_attempts: 10,
            backoff_base: Duration::from_secs(2),
            backoff_cap: Duration::from_secs(3600),
            request_timeout: Duration::from_secs(10),
        }
    }

    /// Routes only: no default target.
    pub fn routed() -> Self {
        Self {
            target_url: None,
            ..Self::new("")
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
    /// Failed at once: no route covers them (no attempt spent).
    #[serde(default)]
    pub unrouted: u64,
}

pub struct OutboxSender {
    pool: PgPool,
    destinations: Destinations,
    settings: OutboxSettings,
}

impl OutboxSender {
    pub fn new(pool: PgPool, settings: OutboxSettings) -> Result<Self, reqwest::Error> {
        let destinations = Destinations::new(settings.request_timeout, settings.endpoints.clone())?;
        Ok(Self {
            pool,
            destinations,
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
            total.unrouted += batch.unrouted;
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
                unrouted = total.unrouted,
                handed_back = total.handed_back,
                "outbox pass finished"
            );
        } else {
            tracing::debug!("outbox pass: nothing due");
        }
        Ok(total)
    }

    /// Where a message goes: its source's route, its tenant's, else the default target.
    fn route(&self, routes: &RouteTable, m: &OutboxMessage) -> Result<Destination, String> {
        match routes.find(&m.tenant_id, m.source_id.as_deref(), &m.action) {
            Some(Ok(destination)) => Ok(destination.clone()),
            Some(Err(reason)) => Err(format!(
                "the stored route for {} of tenant {} is invalid ({reason}): apply the route file again, then resend",
                m.action, m.tenant_id
            )),
            None => match &self.settings.target_url {
                Some(url) => Ok(Destination::Http { url: url.clone() }),
                None => Err(routes::unrouted_reason(
                    &m.tenant_id,
                    m.source_id.as_deref(),
                    &m.action,
                )),
            },
        }
    }

    /// Leases one batch and delivers it, destination by destination, one call at a time, until
    /// `deadline`: what is left when it passes is handed back untried.
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
        if messages.is_empty() {
            return Ok(outcome);
        }
        let routes = RouteTable::load(&self.pool).await?;
        // Grouped by destination, in the order leased (the oldest due first).
        let mut groups: Vec<(Destination, Vec<Outgoing<'_>>)> = Vec::new();
        for message in &messages {
            match self.route(&routes, message) {
                Ok(destination) => match groups.iter_mut().find(|(d, _)| *d == destination) {
                    Some((_, group)) => group.push(Outgoing::new(message)),
                    None => groups.push((destination, vec![Outgoing::new(message)])),
                },
                Err(why) => {
                    tracing::warn!(outbox_id = message.outbox_id, action = %message.action, %why, "outbox message has no route");
                    outbox::mark_unrouted(&self.pool, message.outbox_id, &why).await?;
                    crate::metrics::outbox_delivery("none", "unrouted", 1);
                    outcome.unrouted += 1;
                }
            }
        }
        let plan: Vec<(&Destination, &[Outgoing<'_>])> = groups
            .iter()
            .flat_map(|(d, group)| {
                destinations::calls(d, group)
                    .into_iter()
                    .map(move |c| (d, c))
            })
            .collect();
        for (j, (destination, call)) in plan.iter().enumerate() {
            let Some(left) = deadline
                .checked_duration_since(Instant::now())
                .filter(|left| !left.is_zero())
            else {
                let untried: Vec<i64> = plan[j..]
                    .iter()
                    .flat_map(|(_, c)| c.iter().map(|o| o.message.outbox_id))
                    .collect();
                outcome.handed_back = outbox::release(&self.pool, &untried).await?;
                break;
            };
            let outcomes = self
                .destinations
                .deliver(destination, call, left.min(self.settings.request_timeout))
                .await;
            let described = destination.describe();
            let kind = destination.kind().as_str();
            // The call's delivered entries in one statement; each other entry on its own.
            let mut delivered = Vec::new();
            for (o, delivery) in call.iter().zip(outcomes) {
                match delivery {
                    Delivery::Delivered => delivered.push(o.message.outbox_id),
                    other => {
                        self.settle(o.message, other, &described, kind, &mut outcome)
                            .await?
                    }
                }
            }
            if !delivered.is_empty() {
                outbox::mark_delivered_many(&self.pool, &delivered, &described).await?;
                crate::metrics::outbox_delivery(kind, "delivered", delivered.len() as u64);
                outcome.delivered += delivered.len() as u64;
            }
        }
        Ok(outcome)
    }

    /// Records one message's try.
    async fn settle(
        &self,
        message: &OutboxMessage,
        delivery: Delivery,
        destination: &str,
        kind: &'static str,
        outcome: &mut OutboxOutcome,
    ) -> Result<(), StoreError> {
        // This try is attempt number `attempts + 1`.
        let tries = message.attempts + 1;
        match delivery {
            Delivery::Delivered => {
                outbox::mark_delivered(&self.pool, message.outbox_id, destination).await?;
                crate::metrics::outbox_delivery(kind, "delivered", 1);
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
                    destination,
                )
                .await?;
                crate::metrics::outbox_delivery(kind, "retried", 1);
                outcome.retried += 1;
            }
            Delivery::Transient(why) | Delivery::Refused(why) => {
                tracing::warn!(outbox_id = message.outbox_id, action = %message.action, destination, %why, "outbox message failed for good");
                outbox::mark_failed(&self.pool, message.outbox_id, &why, destination).await?;
                crate::metrics::outbox_delivery(kind, "failed", 1);
                outcome.failed += 1;
            }
        }
        Ok(())
    }
}
