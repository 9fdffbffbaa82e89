//! How long the oldest buffered delivery has waited. No SQS call says: it is CloudWatch's
//! `ApproximateAgeOfOldestMessage` (namespace `AWS/SQS`, dimension `QueueName`), which SQS
//! publishes once a minute while the queue is active, the metric the stack's
//! `BufferOldestMessageAgeAlarm` watches. `hookctl status` shows the newest datapoint of the last
//! 15 minutes, with when it was measured.
//!
//! Only the operator's readers build the CloudWatch client (ingest never does): see
//! [`BufferQueue::oldest_age`].

use std::time::{Duration, SystemTime};

use aws_sdk_cloudwatch::error::DisplayErrorContext;
use aws_sdk_cloudwatch::primitives::DateTime;
use aws_sdk_cloudwatch::types::{Dimension, Metric, MetricDataQuery, MetricStat, ScanBy};
use chrono::{TimeZone, Utc};
use serde::{Deserialize, Serialize};

use super::queue::{BufferQueue, QueueError};

/// How far back a datapoint counts: SQS publishes every minute, CloudWatch shows it a few
/// minutes late; older than this, the queue has been inactive (SQS stops publishing for a queue
/// idle six hours) or the metric cannot be read.
const LOOKBACK: Duration = Duration::from_secs(15 * 60);

/// The age of the oldest message in the buffer queue, as CloudWatch last measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OldestAge {
    pub seconds: f64,
    pub measured_at: chrono::DateTime<Utc>,
}

/// The queue's name, the metric's `QueueName`: the last segment of its URL.
pub fn queue_name(queue_url: &str) -> &str {
    queue_url
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(queue_url)
}

impl BufferQueue {
    /// The newest `ApproximateAgeOfOldestMessage` of the buffer queue in the last 15 minutes
    /// (the maximum over its minute); `None` when CloudWatch holds no datapoint that recent.
    pub async fn oldest_age(&self) -> Result<Option<OldestAge>, QueueError> {
        let mut config = aws_sdk_cloudwatch::config::Builder::from(self.sdk_config())
            .timeout_config(super::queue::timeouts());
        // Never the SQS endpoint override: CloudWatch has its own (`CLOUDWATCH_ENDPOINT`).
        config.set_endpoint_url(self.metrics_endpoint_url().map(str::to_owned));
        let client = aws_sdk_cloudwatch::Client::from_conf(config.build());
        let metric = Metric::builder()
            .namespace("AWS/SQS")
            .metric_name("ApproximateAgeOfOldestMessage")
            .dimensions(
                Dimension::builder()
                    .name("QueueName")
                    .value(queue_name(self.queue_url()))
                    .build(),
            )
            .build();
        let query = MetricDataQuery::builder()
            .id("oldest")
            .metric_stat(
                MetricStat::builder()
                    .metric(metric)
                    .period(60)
                    .stat("Maximum")
                    .build(),
            )
            .return_data(true)
            .build();
        let now = SystemTime::now();
        let output = client
            .get_metric_data()
            .metric_data_queries(query)
            .start_time(DateTime::from(now - LOOKBACK))
            .end_time(DateTime::from(now))
            .scan_by(ScanBy::TimestampDescending)
            .send()
            .await
            .map_err(|error| QueueError::CloudWatch {
                operation: "GetMetricData",
                reason: DisplayErrorContext(error).to_string(),
            })?;
        let newest = output
            .metric_data_results()
            .iter()
            .flat_map(|r| r.timestamps().iter().zip(r.values()))
            .max_by_key(|(at, _)| (at.secs(), at.subsec_nanos()));
        Ok(newest.and_then(|(at, seconds)| {
            let measured_at = Utc.timestamp_opt(at.secs(), at.subsec_nanos()).single()?;
            Some(OldestAge {
                seconds: *seconds,
                measured_at,
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::queue_name;

    #[test]
    fn the_metric_names_the_queue_by_the_last_segment_of_its_url() {
        assert_eq!(
            queue_name("https://sqs.eu-west-1.amazonaws.com/123456789012/hooks-buffer"),
            "hooks-buffer"
        );
        assert_eq!(
            queue_name("http://127.0.0.1:5000/000000000000/webhooks-buffer/"),
            "webhooks-buffer"
        );
        assert_eq!(queue_name("buffer"), "buffer");
    }
}
