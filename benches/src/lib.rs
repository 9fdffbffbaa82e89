//! Measurement helpers shared by the benchmarks.

use std::time::{Duration, Instant};

/// Median nanoseconds per call of `f`, over `batches` batches sized to last about `batch_time`.
/// Two closures are measured in alternating batches so machine noise hits both alike.
pub fn paired_ns_per_op(
    mut a: impl FnMut(),
    mut b: impl FnMut(),
    batches: usize,
    batch_time: Duration,
) -> (f64, f64) {
    let calibrate = |f: &mut dyn FnMut()| {
        let mut n = 1u64;
        loop {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            if start.elapsed() >= batch_time / 4 {
                return n * 4;
            }
            n *= 2;
        }
    };
    let (na, nb) = (calibrate(&mut a), calibrate(&mut b));
    let mut ta = Vec::with_capacity(batches);
    let mut tb = Vec::with_capacity(batches);
    for _ in 0..batches {
        let start = Instant::now();
        for _ in 0..na {
            a();
        }
        ta.push(start.elapsed().as_nanos() as f64 / na as f64);
        let start = Instant::now();
        for _ in 0..nb {
            b();
        }
        tb.push(start.elapsed().as_nanos() as f64 / nb as f64);
    }
    (median(&mut ta), median(&mut tb))
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|x, y| x.partial_cmp(y).expect("no NaN"));
    values[values.len() / 2]
}

/// Where pgbench is: `PGBENCH`, PostgreSQL's bin directories, or the PATH.
pub fn pgbench() -> Option<std::path::PathBuf> {
    if let Ok(path) = std::env::var("PGBENCH") {
        return Some(path.into());
    }
    let mut dirs: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"))
        .filter(|p| p.exists())
        .collect();
    dirs.sort();
    dirs.pop().or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("pgbench"))
                .find(|p| p.exists())
        })
    })
}
