//! A small client thread pool for legs that send many requests at once.

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;

/// Run `f(0..n)` on `workers` threads (each takes the next index); results in index order.
pub(crate) fn run_pool<T: Send>(
    n: usize,
    workers: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let next = AtomicUsize::new(0);
    let mut slots: Vec<Option<Result<T>>> = (0..n).map(|_| None).collect();
    let done = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1).min(n.max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let r = f(i);
                    done.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a client thread panicked"))))
        .collect()
}
