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
pub mod limiter;
pub mod routes;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;

use serde::Serialize;
use sqlx::PgPool;

use crate::drain::retry_delay;
use crate::secrets::{SecretSet, SecretStore};
use crate::store::StoreError;
use crate::store::outbox::{self, OutboxMessage};
use crate::store::subscriptions as stored_subscriptions;
use crate::subscriptions;
use destinations::{AwsDestinationEndpoints, Delivery, Destination, Destinations, Outgoing};
use routes::{RouteTable, Target};

/// How long a sender uses the routes and pauses it read before reading them again: a route
/// applied or a subscription paused reaches a staying sender within this.
const ROUTING_FRESH: Duration = Duration::from_secs(1);

/// The most payload (as stored) a batch holds, beyond its first message: a sender holds two
/// batches in memory (one in flight, the next leased), and 200 events of a mebibyte would not fit
/// a function's 256 MB.
pub const BATCH_PAYLOAD_BYTES: i64 = 8 * 1024 * 1024;

/// Beyond the last call's end, how long a lease lasts: time to commit the outcomes.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// The routes and the paused subscriptions, as a sender read them.
struct Routing {
    routes: RouteTable,
    paused: HashSet<(String, String)>,
    read_at: Instant,
}

impl Routing {
    async fn load(pool: &PgPool) -> Result<Self, StoreError> {
        let mut conn = pool.acquire().await?;
        let routes = RouteTable::load(&mut conn).await?;
        let paused = stored_subscriptions::pauses(&mut *conn)
            .await?
            .into_iter()
            .map(|p| (p.tenant_id, p.name))
            .collect();
        Ok(Self {
            routes,
            paused,
            read_at: Instant::now(),
        })
    }

    fn stale(&self) -> bool {
        self.read_at.elapsed() >= ROUTING_FRESH
    }
}

/// A batch after its calls: what each message came to, committed together.
struct Tried {
    messages: Vec<OutboxMessage>,
    /// No route sends them: (outbox id, why).
    unrouted: Vec<(i64, String)>,
    /// Their subscription is paused.
    parked: Vec<i64>,
    /// Over their subscription's rate: ids and delays in milliseconds.
    deferred: (Vec<i64>, Vec<i64>),
    /// Not sent: the deadline came first.
    untried: Vec<i64>,
    /// Delivered, per destination: (described, kind, ids).
    delivered: Vec<(String, &'static str, Vec<i64>)>,
    /// Every other outcome: (outbox id, outcome, destination described, kind).
    others: Vec<(i64, Delivery, String, &'static str)>,
    data_omitted: u64,
}

/// Who paused a subscription whose subscriber answered 410 Gone.
pub const GONE_ACTOR: &str = "outbox:410-gone";

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
    /// Calls in flight at once, all workers together (HTTP: one message a call; AWS: ten).
    pub http_concurrency: usize,
    /// Batches in hand at once: each worker leases, sends and settles its own. Above one, two
    /// workers' batches may hold messages of one entity, and a FIFO destination may then
    /// receive them out of order.
    pub workers: usize,
    /// How long a pass that found nothing due waits before looking again, when it stays in its
    /// invocation for new work ([`OutboxSender::stay_until`]); zero: it returns instead.
    pub idle_poll: Duration,
}

impl OutboxSettings {
    pub fn new(target_url: impl Into<String>) -> Self {
        Self {
            target_url: Some(target_url.into()),
            endpoints: AwsDestinationEndpoints::default(),
            // Two hundred: the database's work per batch (a lease, one commit of its outcomes)
            // is paid once for many calls, and overlaps the next batch's (benchmarks.md).
            batch_size: 200,
            max_attempts: 10,
            backoff_base: Duration::from_secs(2),
            backoff_cap: Duration::from_secs(3600),
            request_timeout: Duration::from_secs(10),
            http_concurrency: 16,
            workers: 1,
            idle_poll: Duration::from_millis(100),
        }
    }

    /// Routes only: no default target.
    pub fn routed() -> Self {
        Self {
            target_url: None,
            ..Self::new("")
        }
    }

    /// How long a leased message is hidden from other senders at most: long enough for the
    /// whole batch, delivered one by one, to time out, so a slow batch is never leased twice.
    /// A pass leases for less when its deadline comes first: no call outlives the deadline.
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
    /// Subscriptions' messages parked: their subscription is paused (no attempt spent).
    #[serde(default)]
    pub parked: u64,
    /// Subscriptions' messages handed back for later: over their rate limit (no attempt spent).
    #[serde(default)]
    pub deferred: u64,
    /// Subscriptions paused because their subscriber answered 410 Gone.
    #[serde(default)]
    pub paused: u64,
    /// Subscriptions' messages sent without their data: over the destination's limit.
    #[serde(default)]
    pub data_omitted: u64,
}

impl OutboxOutcome {
    pub fn add(&mut self, other: &OutboxOutcome) {
        self.leased += other.leased;
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.failed += other.failed;
        self.handed_back += other.handed_back;
        self.unrouted += other.unrouted;
        self.parked += other.parked;
        self.deferred += other.deferred;
        self.paused += other.paused;
        self.data_omitted += other.data_omitted;
    }
}

pub struct OutboxSender {
    pool: PgPool,
    destinations: Destinations,
    settings: OutboxSettings,
    /// Where routes' signing secrets are read (`signing_secret_ref`).
    secrets: Option<Arc<SecretStore>>,
    limiter: limiter::RateLimiter,
    /// `http_concurrency` permits: the calls in flight, all workers together.
    in_flight: tokio::sync::Semaphore,
}

impl OutboxSender {
    pub fn new(pool: PgPool, settings: OutboxSettings) -> Result<Self, reqwest::Error> {
        let destinations = Destinations::new(settings.request_timeout, settings.endpoints.clone())?;
        Ok(Self {
            pool,
            destinations,
            secrets: None,
            limiter: limiter::RateLimiter::default(),
            in_flight: tokio::sync::Semaphore::new(settings.http_concurrency.max(1)),
            settings,
        })
    }

    /// Reads routes' signing secrets from `secrets`.
    pub fn with_secrets(mut self, secrets: Arc<SecretStore>) -> Self {
        self.secrets = Some(secrets);
        self
    }

    /// Sends until a batch comes back short or `deadline` passes; no request outlives it.
    #[tracing::instrument(skip_all, err)]
    pub async fn send_until(&self, deadline: Instant) -> Result<OutboxOutcome, StoreError> {
        self.pass(deadline, false).await
    }

    /// Sends until `deadline`, waiting for new work when none is due (a poll of the
    /// `outbox_due` index every `idle_poll`) instead of returning: a scheduled
    /// invocation stays in its minute, so a message written meanwhile goes out within a poll,
    /// not at the next schedule.
    #[tracing::instrument(skip_all, err)]
    pub async fn stay_until(&self, deadline: Instant) -> Result<OutboxOutcome, StoreError> {
        self.pass(deadline, true).await
    }

    async fn pass(&self, deadline: Instant, stay: bool) -> Result<OutboxOutcome, StoreError> {
        // `workers` loops (one by default), each leasing its own batches: with more, one
        // commits its outcomes and leases again while another's calls are in flight. Their
        // calls share one bound (`http_concurrency`).
        let workers = (0..self.settings.workers.max(1)).map(|_| self.work(deadline, stay));
        let mut total = OutboxOutcome::default();
        for done in futures_util::future::join_all(workers).await {
            total.add(&done?);
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
                parked = total.parked,
                deferred = total.deferred,
                paused = total.paused,
                data_omitted = total.data_omitted,
                "outbox pass finished"
            );
        } else {
            tracing::debug!("outbox pass: nothing due");
        }
        Ok(total)
    }

    /// One worker of a pass: batches until one comes back short (or, staying, until the
    /// deadline). Pipelined: while one batch's calls are in flight, the batch before has its
    /// outcomes committed and the next is leased, so the database's work and the calls overlap
    /// instead of taking turns. The calls themselves still go one batch after another, in the
    /// order leased (a FIFO destination keeps its order).
    async fn work(&self, deadline: Instant, stay: bool) -> Result<OutboxOutcome, StoreError> {
        let mut total = OutboxOutcome::default();
        let mut routing: Option<Routing> = None;
        let mut leased = self.lease_batch(deadline).await?;
        let mut tried: Option<Tried> = None;
        loop {
            total.leased += leased.len() as u64;
            if leased.is_empty() {
                if let Some(t) = tried.take() {
                    total.add(&self.commit_outcomes(t).await?);
                }
                // An idle poll of zero: return when nothing is ready, as a pass without `stay`.
                if !stay || self.settings.idle_poll.is_zero() || Instant::now() >= deadline {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(self.settings.idle_poll.min(left)).await;
                leased = self.lease_batch(deadline).await?;
                continue;
            }
            if routing.as_ref().is_none_or(Routing::stale) {
                routing = Some(Routing::load(&self.pool).await?);
            }
            let routing_now = routing.as_ref().expect("loaded above");
            // Leased ahead even after a short batch (the payload bound cuts batches short too):
            // nothing due is a cheap answer, and the pass then ends or waits as above.
            let ahead = Instant::now() < deadline;
            let batch = std::mem::take(&mut leased);
            let (delivered, committed, next) = futures_util::join!(
                self.deliver(batch, routing_now, deadline),
                async {
                    match tried.take() {
                        Some(t) => self.commit_outcomes(t).await.map(Some),
                        None => Ok(None),
                    }
                },
                async {
                    if ahead {
                        self.lease_batch(deadline).await
                    } else {
                        Ok(Vec::new())
                    }
                },
            );
            if let Some(c) = committed? {
                total.add(&c);
            }
            let mut delivered = delivered?;
            leased = next?;
            if !delivered.untried.is_empty() {
                // The deadline came: what was leased ahead goes back untried too.
                total.leased += leased.len() as u64;
                delivered
                    .untried
                    .extend(leased.drain(..).map(|m| m.outbox_id));
                total.add(&self.commit_outcomes(delivered).await?);
                break;
            }
            tried = Some(delivered);
        }
        Ok(total)
    }

    /// Where a message goes: its source's route, its tenant's, else the default target (never
    /// for a subscription's message: its subscription names where).
    fn route(&self, routes: &RouteTable, m: &OutboxMessage) -> Result<Target, String> {
        match routes.find(&m.tenant_id, m.source_id.as_deref(), &m.action) {
            Some(Ok(target)) => Ok(target.clone()),
            Some(Err(reason)) => Err(format!(
                "the stored route for {} of tenant {} is invalid ({reason}): apply the route file again, then resend",
                m.action, m.tenant_id
            )),
            None => match (&self.settings.target_url, subscriptions::name_of(&m.action)) {
                (_, Some(name)) => Err(format!(
                    "subscription {name} of tenant {} is not in the route file: add it back (hookctl routes apply), then resend",
                    m.tenant_id
                )),
                (Some(url), None) => Ok(Target {
                    destination: Destination::Http { url: url.clone() },
                    signing_secret_ref: None,
                    rate_limit: None,
                }),
                (None, None) => Err(routes::unrouted_reason(
                    &m.tenant_id,
                    m.source_id.as_deref(),
                    &m.action,
                )),
            },
        }
    }

    /// The signing secrets a route names, or the outcome of every message it would sign.
    async fn signing(&self, secret_ref: &str) -> Result<Arc<SecretSet>, Delivery> {
        let Some(store) = &self.secrets else {
            return Err(Delivery::Refused(format!(
                "the route signs with {secret_ref:?} but this sender has no secret store"
            )));
        };
        match store.secrets(secret_ref).await {
            Ok(set) => Ok(set),
            Err(e) if e.is_misconfiguration() => Err(Delivery::Refused(format!("not sent: {e}"))),
            Err(e) => Err(Delivery::Transient(format!("not sent: {e}"))),
        }
    }

    /// Leases one batch and delivers it: routed, paused subscriptions' messages parked, those
    /// over a subscription's rate deferred, then every call made, up to `http_concurrency` at
    /// once, until `deadline`: what is left when it passes is handed back untried. Outcomes are
    /// committed together, in one transaction (the delivered messages of a destination in one
    /// statement); it and the lease commit without waiting for the WAL flush
    /// ([`outbox::relaxed`]: a crash can only make a message go again, with its key).
    pub async fn run_once(&self, deadline: Instant) -> Result<OutboxOutcome, StoreError> {
        let messages = self.lease_batch(deadline).await?;
        let leased = messages.len() as u64;
        if messages.is_empty() {
            return Ok(OutboxOutcome::default());
        }
        let routing = Routing::load(&self.pool).await?;
        let tried = self.deliver(messages, &routing, deadline).await?;
        let mut outcome = self.commit_outcomes(tried).await?;
        outcome.leased = leased;
        Ok(outcome)
    }

    /// Leases a batch, held until the calls that may carry it are over: none starts after
    /// `deadline` nor lasts longer than the request timeout, so the lease ends a request
    /// timeout after the deadline, or sooner when the batch, sent call after call, would take
    /// less ([`OutboxSettings::lease`]). A sender that died mid-pass frees its messages then.
    async fn lease_batch(&self, deadline: Instant) -> Result<Vec<OutboxMessage>, StoreError> {
        let until_deadline = deadline
            .saturating_duration_since(Instant::now())
            .saturating_add(self.settings.request_timeout)
            .saturating_add(LEASE_MARGIN);
        let lease = self.settings.lease().min(until_deadline);
        let mut tx = outbox::relaxed(&self.pool).await?;
        let leased = outbox::lease(
            &mut *tx,
            self.settings.batch_size,
            BATCH_PAYLOAD_BYTES,
            lease.as_secs_f64(),
        )
        .await?;
        tx.commit().await?;
        Ok(leased)
    }

    /// Routes, pauses, rate limits and every call of one leased batch, up to `http_concurrency`
    /// in flight, until `deadline`: what each message came to, not yet committed.
    async fn deliver(
        &self,
        messages: Vec<OutboxMessage>,
        routing: &Routing,
        deadline: Instant,
    ) -> Result<Tried, StoreError> {
        let mut data_omitted = 0;
        // Grouped by target, in the order leased (the oldest due first).
        let mut groups: Vec<(Target, Vec<Outgoing<'_>>)> = Vec::new();
        let (mut parked, mut deferred) = (Vec::new(), (Vec::new(), Vec::new()));
        let mut unrouted: Vec<(i64, String)> = Vec::new();
        for message in &messages {
            let target = match self.route(&routing.routes, message) {
                Ok(target) => target,
                Err(why) => {
                    tracing::warn!(outbox_id = message.outbox_id, action = %message.action, %why, "outbox message has no route");
                    unrouted.push((message.outbox_id, why));
                    continue;
                }
            };
            if let Some(name) = subscriptions::name_of(&message.action) {
                if routing
                    .paused
                    .contains(&(message.tenant_id.clone(), name.to_owned()))
                {
                    parked.push(message.outbox_id);
                    continue;
                }
                if let Some(rate) = target.rate_limit
                    && let Some(wait) = self.limiter.wait(&message.tenant_id, name, rate)
                {
                    deferred.0.push(message.outbox_id);
                    deferred.1.push(wait.as_millis() as i64);
                    continue;
                }
            }
            let o = Outgoing::to(message, &target.destination);
            match groups.iter_mut().find(|(t, _)| *t == target) {
                Some((_, group)) => group.push(o),
                None => groups.push((target, vec![o])),
            }
        }
        // A route's signing secrets, read once per batch; a route whose secret cannot be read
        // sends nothing unsigned: its messages are settled with the reason.
        let mut unsignable: Vec<(usize, Delivery)> = Vec::new();
        for (i, (target, group)) in groups.iter_mut().enumerate() {
            if let Some(secret_ref) = &target.signing_secret_ref {
                match self.signing(secret_ref).await {
                    Ok(set) => group.iter_mut().for_each(|o| o.signing = Some(set.clone())),
                    Err(why) => unsignable.push((i, why)),
                }
            }
        }
        let plan: Vec<(&Destination, &[Outgoing<'_>])> = groups
            .iter()
            .enumerate()
            .filter(|(i, _)| !unsignable.iter().any(|(u, _)| u == i))
            .flat_map(|(_, (t, group))| {
                destinations::calls(&t.destination, group)
                    .into_iter()
                    .map(move |c| (&t.destination, c))
            })
            .collect();
        // Every call, up to `http_concurrency` in flight; one that would start after the
        // deadline is not made (`None`). A FIFO destination's calls go one after another in
        // one lane, so one entity's messages reach it in the order leased; every other call is
        // a lane of its own. Each lane's future is boxed with its type named: a spawned task
        // (the local runner's pipeline, the function's handler) must see it as `Send` for
        // every lifetime.
        let mut lanes: Vec<Vec<usize>> = Vec::new();
        let mut fifo_lanes: Vec<(&Destination, usize)> = Vec::new();
        for (i, (destination, _)) in plan.iter().enumerate() {
            if !destination.is_fifo() {
                lanes.push(vec![i]);
                continue;
            }
            match fifo_lanes.iter().find(|(d, _)| d == destination) {
                Some((_, lane)) => lanes[*lane].push(i),
                None => {
                    fifo_lanes.push((destination, lanes.len()));
                    lanes.push(vec![i]);
                }
            }
        }
        type Lane<'f> =
            Pin<Box<dyn Future<Output = Vec<(usize, Option<Vec<Delivery>>)>> + Send + 'f>>;
        let plan_ref = &plan;
        let lanes: Vec<Lane<'_>> = lanes
            .into_iter()
            .map(|lane| -> Lane<'_> {
                Box::pin(async move {
                    let mut tried = Vec::with_capacity(lane.len());
                    for i in lane {
                        let (destination, call) = plan_ref[i];
                        tried.push((i, self.try_call(destination, call, deadline).await));
                    }
                    tried
                })
            })
            .collect();
        let mut tries: Vec<Option<Vec<Delivery>>> = vec![None; plan.len()];
        for (i, tried) in futures_util::stream::iter(lanes)
            .buffer_unordered(self.settings.http_concurrency.max(1))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .flatten()
        {
            tries[i] = tried;
        }
        let mut untried = Vec::new();
        let mut delivered: Vec<(String, &'static str, Vec<i64>)> = Vec::new();
        let mut others: Vec<(i64, Delivery, String, &'static str)> = Vec::new();
        for (i, why) in unsignable {
            let (t, group) = &groups[i];
            for o in group {
                others.push((
                    o.message.outbox_id,
                    why.clone(),
                    t.destination.describe(),
                    t.destination.kind().as_str(),
                ));
            }
        }
        for ((destination, call), tried) in plan.iter().zip(tries) {
            let Some(outcomes) = tried else {
                untried.extend(call.iter().map(|o| o.message.outbox_id));
                continue;
            };
            let (described, kind) = (destination.describe(), destination.kind().as_str());
            for (o, delivery) in call.iter().zip(outcomes) {
                if o.data_omitted {
                    data_omitted += 1;
                    crate::metrics::outbox_delivery(kind, "data_omitted", 1);
                }
                match delivery {
                    Delivery::Delivered => {
                        match delivered.iter_mut().find(|(d, _, _)| *d == described) {
                            Some((_, _, ids)) => ids.push(o.message.outbox_id),
                            None => {
                                delivered.push((described.clone(), kind, vec![o.message.outbox_id]))
                            }
                        }
                    }
                    other => others.push((o.message.outbox_id, other, described.clone(), kind)),
                }
            }
        }
        drop(plan);
        drop(groups);
        Ok(Tried {
            messages,
            unrouted,
            parked,
            deferred,
            untried,
            delivered,
            others,
            data_omitted,
        })
    }

    /// Commits what a batch came to, in one transaction that does not wait for the WAL flush
    /// ([`outbox::relaxed`]), and counts it once committed.
    async fn commit_outcomes(&self, tried: Tried) -> Result<OutboxOutcome, StoreError> {
        let Tried {
            unrouted,
            delivered,
            deferred,
            ..
        } = &tried;
        let mut outcome = OutboxOutcome {
            data_omitted: tried.data_omitted,
            ..OutboxOutcome::default()
        };
        let mut tx = outbox::relaxed(&self.pool).await?;
        for (outbox_id, why) in unrouted {
            outbox::mark_unrouted(&mut *tx, *outbox_id, why).await?;
        }
        outcome.parked = outbox::park(&mut *tx, &tried.parked).await?;
        outcome.deferred = outbox::defer(&mut *tx, &deferred.0, &deferred.1).await?;
        outcome.handed_back = outbox::release(&mut *tx, &tried.untried).await?;
        for (described, _, ids) in delivered {
            outbox::mark_delivered_many(&mut *tx, ids, described).await?;
        }
        let mut settled = OutboxOutcome::default();
        for (outbox_id, delivery, described, kind) in &tried.others {
            let Some(message) = tried.messages.iter().find(|m| m.outbox_id == *outbox_id) else {
                continue;
            };
            self.settle(
                &mut tx,
                message,
                delivery.clone(),
                described,
                kind,
                &mut settled,
            )
            .await?;
        }
        tx.commit().await?;
        if !unrouted.is_empty() {
            crate::metrics::outbox_delivery("none", "unrouted", unrouted.len() as u64);
        }
        outcome.unrouted = unrouted.len() as u64;
        for (_, kind, ids) in delivered {
            crate::metrics::outbox_delivery(kind, "delivered", ids.len() as u64);
            outcome.delivered += ids.len() as u64;
        }
        outcome.add(&settled);
        Ok(outcome)
    }

    /// One call, once a slot of `http_concurrency` is free; `None` when the deadline came
    /// first (the call is not made).
    async fn try_call(
        &self,
        destination: &Destination,
        call: &[Outgoing<'_>],
        deadline: Instant,
    ) -> Option<Vec<Delivery>> {
        let _slot = self.in_flight.acquire().await.ok()?;
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())?;
        Some(
            self.destinations
                .deliver(destination, call, left.min(self.settings.request_timeout))
                .await,
        )
    }

    /// Records one message's try.
    async fn settle(
        &self,
        conn: &mut sqlx::PgConnection,
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
                outbox::mark_delivered(&mut *conn, message.outbox_id, destination).await?;
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
                    &mut *conn,
                    message.outbox_id,
                    delay.as_millis() as i64,
                    &why,
                    destination,
                )
                .await?;
                crate::metrics::outbox_delivery(kind, "retried", 1);
                outcome.retried += 1;
            }
            Delivery::Gone(why) if subscriptions::name_of(&message.action).is_some() => {
                // The subscriber wants no more: the subscription is paused, its message parked
                // with the rest, nothing dropped and no attempt spent.
                let name = subscriptions::name_of(&message.action).unwrap_or_default();
                tracing::warn!(outbox_id = message.outbox_id, subscription = name, destination, %why, "subscriber answered 410 Gone: subscription paused");
                let reason = format!("{why} from {destination}");
                stored_subscriptions::pause(
                    &mut *conn,
                    &message.tenant_id,
                    name,
                    &reason,
                    GONE_ACTOR,
                )
                .await?;
                outbox::park(&mut *conn, &[message.outbox_id]).await?;
                crate::metrics::outbox_delivery(kind, "paused", 1);
                outcome.parked += 1;
                outcome.paused += 1;
            }
            Delivery::Transient(why) | Delivery::Refused(why) | Delivery::Gone(why) => {
                tracing::warn!(outbox_id = message.outbox_id, action = %message.action, destination, %why, "outbox message failed for good");
                outbox::mark_failed(&mut *conn, message.outbox_id, &why, destination).await?;
                crate::metrics::outbox_delivery(kind, "failed", 1);
                outcome.failed += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_gone_check_counts_the_pauses_the_sender_makes() {
        let check = crate::store::anomaly::GLOBAL_CHECKS
            .iter()
            .find(|c| c.name == "subscriptions_paused_by_gone")
            .expect("the check exists");
        assert!(check.sql.contains(&format!("'{}'", super::GONE_ACTOR)));
    }
}
