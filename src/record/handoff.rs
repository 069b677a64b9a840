//! The queue from the relay to the observer, and what goes through it ([`Seen`]):
//! unbounded (the relay never waits, nothing is dropped) and cheap for the relay. Waking
//! the observer's thread per message would put a futex syscall on the relay's path and a
//! thread competing for a core at the moment the next message is due, so the relay only
//! appends under a mutex; the observer takes everything queued at once and, while
//! messages keep coming, comes back on its own: [`POLL`] after a look that found some,
//! twice as long after each that found none (up to [`POLL_MAX`]), so a slow stream costs
//! it no more looks than it has messages. Only after [`IDLE`] without any does it park,
//! and then the next message wakes it: one wake-up per quiet spell, not per message.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// A copy of what crossed the tap, for the observer. `t` is the tap's receive time on the
/// monotonic clock (seconds), taken before the frame is forwarded.
#[derive(Debug)]
pub enum Seen {
    /// An engine's ready response on client `client`'s input socket.
    Ready {
        engine: Bytes,
        client: usize,
        payload: Bytes,
    },
    /// A frontend → engine message `[type, payload, aux…]`.
    Input {
        t: f64,
        client: usize,
        engine: Bytes,
        frames: Vec<Bytes>,
    },
    /// An engine → frontend message `[payload, aux…]`.
    Output {
        t: f64,
        client: usize,
        frames: Vec<Bytes>,
    },
    /// An engine's connection closed.
    EngineGone { engine: Bytes },
    /// A message larger than `--max-frame-size` was relayed without being buffered, so it
    /// cannot be decoded.
    Streamed { what: String },
    /// The capture ends; in-flight requests are written as incomplete with this reason.
    Stop { reason: String },
}

/// How long the observer sleeps after a look at the queue that found messages.
pub const POLL: Duration = Duration::from_millis(1);

/// The longest it sleeps between two looks before parking.
pub const POLL_MAX: Duration = Duration::from_millis(16);

/// How long the queue must stay empty before the observer parks until woken.
pub const IDLE: Duration = Duration::from_millis(50);

#[derive(Default)]
struct State {
    items: Vec<Seen>,
    /// The observer waits on the condvar: the next `send` must wake it.
    parked: bool,
    senders: usize,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The relay's end. Clones share the queue; when the last is dropped the receiver sees the
/// queue disconnected (after taking what is left in it).
pub struct SeenSender(Arc<Shared>);

/// The observer's end.
pub struct SeenReceiver {
    shared: Arc<Shared>,
    last_item: Instant,
    /// The next sleep between looks.
    poll: Duration,
}

/// A new queue.
pub fn channel() -> (SeenSender, SeenReceiver) {
    let shared = Arc::new(Shared::default());
    shared.lock().senders = 1;
    (
        SeenSender(shared.clone()),
        SeenReceiver {
            shared,
            last_item: Instant::now(),
            poll: POLL,
        },
    )
}

impl SeenSender {
    /// Queue `s` for the observer; never blocks beyond the mutex (held by the other side
    /// only to swap the queue out), and wakes the observer only if it parked.
    pub fn send(&self, s: Seen) {
        let mut st = self.0.lock();
        st.items.push(s);
        if st.parked {
            st.parked = false;
            drop(st);
            self.0.wake.notify_one();
        }
    }
}

impl Clone for SeenSender {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Self(self.0.clone())
    }
}

impl Drop for SeenSender {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.senders -= 1;
        if st.senders == 0 {
            st.parked = false;
            drop(st);
            self.0.wake.notify_one();
        }
    }
}

/// What [`SeenReceiver::recv_batch`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Recv {
    /// `into` holds what was queued (possibly nothing, after a timeout).
    Items,
    /// Every sender is gone and the queue is empty.
    Disconnected,
}

impl SeenReceiver {
    /// Move everything queued into `into` (which should be empty). When nothing is queued,
    /// wait: a sleep while messages came recently (see [`POLL`]), else park for up to
    /// `wait`.
    pub fn recv_batch(&mut self, into: &mut Vec<Seen>, wait: Duration) -> Recv {
        {
            let mut st = self.shared.lock();
            if !st.items.is_empty() {
                std::mem::swap(&mut st.items, into);
                self.last_item = Instant::now();
                self.poll = POLL;
                return Recv::Items;
            }
            if st.senders == 0 {
                return Recv::Disconnected;
            }
            if self.last_item.elapsed() >= IDLE {
                st.parked = true;
                let (mut st, _) = self
                    .shared
                    .wake
                    .wait_timeout_while(st, wait, |st| st.parked && st.items.is_empty())
                    .unwrap_or_else(PoisonError::into_inner);
                st.parked = false;
                std::mem::swap(&mut st.items, into);
                if !into.is_empty() {
                    self.last_item = Instant::now();
                    self.poll = POLL;
                }
                return Recv::Items;
            }
        }
        std::thread::sleep(self.poll.min(wait));
        self.poll = (self.poll * 2).min(POLL_MAX);
        let mut st = self.shared.lock();
        std::mem::swap(&mut st.items, into);
        if !into.is_empty() {
            self.last_item = Instant::now();
            self.poll = POLL;
        }
        Recv::Items
    }

    /// Move whatever is queued into `into` without waiting.
    pub fn try_recv_all(&mut self, into: &mut Vec<Seen>) {
        let mut st = self.shared.lock();
        into.append(&mut st.items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop(i: usize) -> Seen {
        Seen::Stop {
            reason: i.to_string(),
        }
    }

    fn reasons(v: &[Seen]) -> Vec<String> {
        v.iter()
            .map(|s| match s {
                Seen::Stop { reason } => reason.clone(),
                _ => unreachable!(),
            })
            .collect()
    }

    /// Everything sent arrives, in order, from several threads' worth of senders, whether
    /// the receiver was polling or parked; the receiver sees the end once the last sender
    /// is gone and the queue is empty.
    #[test]
    fn delivers_everything_in_order_then_disconnects() {
        let (tx, mut rx) = channel();
        let tx2 = tx.clone();
        let producer = std::thread::spawn(move || {
            for i in 0..1000 {
                tx2.send(stop(i));
                if i % 100 == 0 {
                    // long enough for the receiver to park
                    std::thread::sleep(IDLE + Duration::from_millis(20));
                }
            }
        });
        drop(tx);
        let mut got = Vec::new();
        let mut batch = Vec::new();
        while rx.recv_batch(&mut batch, Duration::from_secs(5)) == Recv::Items {
            got.append(&mut batch);
        }
        producer.join().unwrap();
        let want: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
        assert_eq!(reasons(&got), want);
    }

    /// A parked receiver wakes for a message at once, not at the end of its wait.
    #[test]
    fn a_parked_receiver_is_woken() {
        let (tx, mut rx) = channel();
        std::thread::sleep(IDLE + Duration::from_millis(10));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            tx.send(stop(7));
            tx
        });
        let start = Instant::now();
        let mut batch = Vec::new();
        assert_eq!(
            rx.recv_batch(&mut batch, Duration::from_secs(10)),
            Recv::Items
        );
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(reasons(&batch), ["7"]);
        drop(t.join().unwrap());
        batch.clear();
        assert_eq!(
            rx.recv_batch(&mut batch, Duration::from_secs(10)),
            Recv::Disconnected
        );
    }
}
