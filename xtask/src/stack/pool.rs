//! Threads for the legs: a small client pool for legs that send many requests at once, and
//! the stacks of several legs booted together.

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

/// Run `boot(item)` for every item at once, one thread each; results in the items' order
/// (a boot whose thread panicked is an error). Legs boot their stacks together because a
/// boot is mostly a Python frontend importing on one core; their workloads then run one
/// after the other, each on a quiet machine.
pub(crate) fn boot_together<I: Send, T: Send>(
    items: impl IntoIterator<Item = I>,
    boot: impl Fn(I) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let boot = &boot;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|item| s.spawn(move || boot(item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a boot thread panicked")))
            })
            .collect()
    })
}
