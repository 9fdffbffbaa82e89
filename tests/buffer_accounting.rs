//! The buffer's accounting against moto's SQS: a buffer queue whose RedrivePolicy sends a
//! message received past `maxReceiveCount` to its dead-letter queue. Counted, listed without
//! bodies (and left in place), and re-driven back exactly once; what is not a buffered delivery
//! stays in the dead-letter queue.

use std::collections::{BTreeMap, HashMap};

use aws_sdk_sqs::types::QueueAttributeName;
use pipeline_tests::*;
use shared::aws::AwsEndpoint;
use shared::buffer::{
    BufferDepth, BufferQueue, BufferedDelivery, ENVELOPE_VERSION, Envelope, QueueSettings,
};

/// A body marker and a header value the listing must never show.
const BODY_MARKER: &str = "body-secret-7f3a";
const HEADER_VALUE: &str = "header-secret-91c2";

fn endpoint() -> AwsEndpoint {
    AwsEndpoint {
        endpoint_url: Some(moto_endpoint()),
        region: Some("us-east-1".into()),
    }
}

async fn sqs() -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&shared::aws::sdk_config(&endpoint()).await)
}

/// A buffer queue and its dead-letter queue (maxReceiveCount 1), named uniquely (moto keeps
/// state across tests).
async fn queues(sqs: &aws_sdk_sqs::Client) -> BufferQueue {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let unique = format!(
        "{}-{}-{}",
        std::process::id(),
        now(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let dlq = sqs
        .create_queue()
        .queue_name(format!("buffer-dlq-{unique}"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let arn = sqs
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone();
    let queue = sqs
        .create_queue()
        .queue_name(format!("buffer-{unique}"))
        .attributes(
            QueueAttributeName::RedrivePolicy,
            serde_json::json!({"deadLetterTargetArn": arn, "maxReceiveCount": "1"}).to_string(),
        )
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    BufferQueue::connect(&QueueSettings {
        queue_url: queue,
        dead_letter_queue_url: Some(dlq),
        endpoint: endpoint(),
        metrics_endpoint_url: Some(moto_endpoint()),
    })
    .await
}

fn delivery(n: u32) -> BufferedDelivery {
    BufferedDelivery {
        envelope: Envelope {
            v: ENVELOPE_VERSION,
            delivery_id: format!("delivery-{n}"),
            verified_layout: None,
            source_id: "stripe".into(),
            received_at_micros: 1_764_000_000_000_000 + i64::from(n),
            verified_with: "current".into(),
            headers: BTreeMap::from([("stripe-signature".to_owned(), HEADER_VALUE.to_owned())]),
            signed_headers: vec![],
            signed_digest: None,
            element_digests: Vec::new(),
        },
        body: format!("{{\"id\":\"evt_{n}\",\"note\":\"{BODY_MARKER}\"}}").into_bytes(),
    }
}

/// Receives the queue until every message in it has been moved to the dead-letter queue (each
/// received once, visible again at once, then moved on its next receive).
async fn fail_everything(queue: &BufferQueue) {
    for _ in 0..50 {
        let got = queue
            .receive_from(queue.queue_url(), 10, 0, 0)
            .await
            .unwrap();
        let depth = queue.depth().await.unwrap();
        if got.is_empty() && depth.waiting == 0 && depth.in_flight == 0 {
            return;
        }
    }
    panic!("the messages never reached the dead-letter queue");
}

/// Everything in the buffer queue, by delivery id, deleted as read.
async fn drain_buffer(queue: &BufferQueue) -> HashMap<String, (usize, BufferedDelivery)> {
    let mut seen: HashMap<String, (usize, BufferedDelivery)> = HashMap::new();
    loop {
        let got = queue
            .receive_from(queue.queue_url(), 10, 30, 1)
            .await
            .unwrap();
        if got.is_empty() {
            return seen;
        }
        for m in got {
            let d = m.delivery.unwrap();
            seen.entry(d.envelope.delivery_id.clone())
                .or_insert((0, d))
                .0 += 1;
            queue
                .delete_from(queue.queue_url(), &m.receipt_handle)
                .await
                .unwrap();
        }
    }
}

#[tokio::test]
async fn dead_letters_are_counted_listed_without_bodies_and_redriven_once() {
    let sqs = sqs().await;
    let queue = queues(&sqs).await;

    // Three deliveries the consumer failed on, and one message that is no delivery at all.
    for n in 1..=3 {
        queue.send(delivery(n)).await.unwrap();
    }
    fail_everything(&queue).await;
    sqs.send_message()
        .queue_url(queue.dead_letter_queue_url().unwrap())
        .message_body(format!("{{\"v\":\"{HEADER_VALUE}\"}}"))
        .send()
        .await
        .unwrap();
    // Two still waiting for the consumer.
    for n in 4..=5 {
        queue.send(delivery(n)).await.unwrap();
    }

    assert_eq!(
        queue.depth().await.unwrap(),
        BufferDepth {
            waiting: 2,
            in_flight: 0,
            delayed: 0,
            dead_letters: 4,
        }
    );

    // Listed: what each is, never its body or its headers' values; and left in place.
    let listed = queue.list_dead_letters(10).await.unwrap();
    assert_eq!(listed.len(), 4, "{listed:?}");
    let shown = serde_json::to_string(&listed).unwrap();
    assert!(
        !shown.contains(BODY_MARKER) && !shown.contains(HEADER_VALUE),
        "{shown}"
    );
    let mut ids: Vec<_> = listed
        .iter()
        .filter_map(|d| d.delivery_id.clone())
        .collect();
    ids.sort();
    assert_eq!(ids, ["delivery-1", "delivery-2", "delivery-3"]);
    for d in listed.iter().filter(|d| d.delivery_id.is_some()) {
        let n: i64 = d.delivery_id.as_ref().unwrap()["delivery-".len()..]
            .parse()
            .unwrap();
        assert_eq!(d.source_id.as_deref(), Some("stripe"));
        assert_eq!(d.received_at_micros, Some(1_764_000_000_000_000 + n));
        assert_eq!(d.body_bytes, Some(delivery(n as u32).body.len()));
        assert!(d.sent_at_millis.is_some());
        assert!(d.receive_count >= 1);
        assert_eq!(d.unreadable, None);
    }
    let poison: Vec<_> = listed.iter().filter(|d| d.delivery_id.is_none()).collect();
    assert_eq!(poison.len(), 1);
    assert!(poison[0].unreadable.is_some() && poison[0].source_id.is_none());
    // Visible again at once: counted, and listed again whole.
    let depth = queue.depth().await.unwrap();
    assert_eq!(depth.dead_letters, 4);
    assert_eq!(queue.list_dead_letters(10).await.unwrap().len(), 4);
    // A limit is a limit.
    assert_eq!(queue.list_dead_letters(2).await.unwrap().len(), 2);

    // Redriven: the three deliveries back to the buffer queue, the poison left where it is.
    let redriven = queue.redrive(10).await.unwrap();
    assert_eq!((redriven.moved, redriven.skipped), (3, 1));
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.waiting, depth.dead_letters), (5, 1), "{depth:?}");
    // Again: nothing more to move.
    let again = queue.redrive(10).await.unwrap();
    assert_eq!((again.moved, again.skipped), (0, 1));

    // Each delivery is in the buffer exactly once, exactly as it was buffered.
    let back = drain_buffer(&queue).await;
    assert_eq!(back.len(), 5);
    for n in 1..=5 {
        let (count, d) = &back[&format!("delivery-{n}")];
        assert_eq!(*count, 1, "delivery-{n}");
        assert_eq!(*d, delivery(n));
    }
    let left = queue.list_dead_letters(10).await.unwrap();
    assert_eq!(left.len(), 1);
    assert!(left[0].unreadable.is_some());
}

#[tokio::test]
async fn a_redrive_stops_at_its_limit() {
    let sqs = sqs().await;
    let queue = queues(&sqs).await;
    for n in 1..=4 {
        queue.send(delivery(n)).await.unwrap();
    }
    fail_everything(&queue).await;
    assert_eq!(queue.depth().await.unwrap().dead_letters, 4);
    let redriven = queue.redrive(3).await.unwrap();
    assert_eq!((redriven.moved, redriven.skipped), (3, 0));
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.waiting, depth.dead_letters), (3, 1));
}

#[tokio::test]
async fn without_a_dead_letter_queue_the_accounting_says_so() {
    let queue = BufferQueue::connect(&QueueSettings {
        queue_url: format!("{}/123456789012/nowhere", moto_endpoint()),
        dead_letter_queue_url: None,
        endpoint: endpoint(),
        metrics_endpoint_url: Some(moto_endpoint()),
    })
    .await;
    let error = queue.depth().await.unwrap_err().to_string();
    assert!(error.contains("BUFFER_DEAD_LETTER_QUEUE_URL"), "{error}");
}
