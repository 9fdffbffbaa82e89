//! A TCP proxy in front of PostgreSQL that can be cut and restored: the way the fault drill and
//! the buffer's tests make the database unreachable for ingest only, while everything else
//! (the drain, the consumer, the checks) keeps reaching the same server directly.
//!
//! `cut` closes every connection through the proxy and refuses new ones, as a Multi-AZ failover
//! or a stopped server does; `restore` lets new ones in again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How long a pool through the proxy waits for a connection: short, as ingest's is, so a cut
/// database is noticed well inside the spillover bound.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_millis(500);

pub struct DatabaseProxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    /// Connections asked for through the proxy (refused ones included).
    attempts: Arc<std::sync::atomic::AtomicU64>,
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl DatabaseProxy {
    /// A proxy on 127.0.0.1 (any free port) to the server `pool` connects to.
    pub async fn to(pool: &PgPool) -> std::io::Result<Self> {
        let options = pool.connect_options();
        let target = format!("{}:{}", options.get_host(), options.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let attempts = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (generation, _) = watch::channel(0u64);
        let task = {
            let cut = cut.clone();
            let attempts = attempts.clone();
            let generation = generation.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        return;
                    };
                    attempts.fetch_add(1, Ordering::SeqCst);
                    if cut.load(Ordering::SeqCst) {
                        drop(inbound);
                        continue;
                    }
                    let target = target.clone();
                    let mut closed = generation.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(&target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = closed.changed() => {}
                        }
                    });
                }
            })
        };
        Ok(Self {
            port,
            cut,
            attempts,
            generation,
            task,
        })
    }

    /// A pool to the same database as `pool` (same user, database and options, such as a
    /// `search_path`) through the proxy, lazily connected, waiting [`ACQUIRE_TIMEOUT`] at most.
    pub fn pool(&self, pool: &PgPool) -> PgPool {
        let options: PgConnectOptions = (*pool.connect_options())
            .clone()
            .host("127.0.0.1")
            .port(self.port);
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(options)
    }

    /// The database is unreachable through the proxy from now on.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// How many connections were asked for through the proxy so far.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// New connections through the proxy reach the database again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for DatabaseProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
