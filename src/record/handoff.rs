//! The queue from the relay to the observer, and what goes through it ([`Seen`]): it
//! never blocks a send, never drops, and is cheap for the relay. Waking the observer's
//! thread per message would put a futex syscall on the relay's path and a thread competing
//! for a core at the moment the next message is due, so the relay only appends under a
//! mutex; the observer takes everything queued at once and, while messages keep coming,
//! comes back on its own: [`POLL`] after a look that found some, twice as long after each
//! that found none (up to [`POLL_MAX`]), so a slow stream costs it no more looks than it
//! has messages. Only after [`IDLE`] without any does it park, and then the next message
//! wakes it: one wake-up per quiet spell, not per message.
//!
//! What the queue holds is bounded in bytes all the same: past the bound the relay stops
//! *reading* until the observer is back within it ([`Backlog`]; the observer lets go of
//! what it has decoded as it goes, [`SeenReceiver::release_some`]), so an engine that
//! outruns the observer for long is slowed to the observer's pace rather than growing the
//! tap's memory without end.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

/// How many decoded bytes the observer lets go of at a time ([`SeenReceiver::release_some`]).
pub const RELEASE_EVERY: usize = 1 << 20;

impl Seen {
    /// The bytes of the relayed messages this copy keeps alive.
    pub fn bytes(&self) -> usize {
        let frames = |f: &[Bytes]| f.iter().map(Bytes::len).sum::<usize>();
        match self {
            Seen::Ready { payload, .. } => payload.len(),
            Seen::Input { frames: f, .. } | Seen::Output { frames: f, .. } => frames(f),
            Seen::EngineGone { .. } | Seen::Streamed { .. } | Seen::Stop { .. } => 0,
        }
    }
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
    /// The bytes `items` keep alive.
    bytes: usize,
    /// The observer waits on the condvar: the next `send` must wake it.
    parked: bool,
    senders: usize,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// The bytes queued or in the batch the observer is working through: what the
    /// observer is behind the relay.
    backlog: AtomicUsize,
    /// Past this backlog the relay stops reading until it is back within it ([`Backlog`]).
    bound: usize,
    /// Whether the relay has had to wait for the observer yet (it says so once).
    warned: AtomicBool,
    /// How often, and for how long in all, the relay waited for the observer.
    waits: AtomicU64,
    waited_ns: AtomicU64,
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
    /// The bytes of the batch last handed out, released from the backlog when the
    /// observer comes back for more (it has worked through that batch then).
    held: usize,
}

/// A new queue. The relay stops reading once the observer is more than `bound` bytes
/// behind ([`Backlog::wait_for_room`]).
pub fn channel(bound: usize) -> (SeenSender, SeenReceiver) {
    let shared = Arc::new(Shared {
        bound,
        ..Shared::default()
    });
    shared.lock().senders = 1;
    (
        SeenSender(shared.clone()),
        SeenReceiver {
            shared,
            last_item: Instant::now(),
            poll: POLL,
            held: 0,
        },
    )
}

/// The relay's view of how far the observer is behind, for waiting on it.
#[derive(Clone)]
pub struct Backlog(Option<Arc<Shared>>);

impl Backlog {
    /// A relay with no observer: never waits.
    pub fn none() -> Self {
        Self(None)
    }

    /// Return at once while the observer is within its bound; past it, wait until it is
    /// back within it (a read may then overshoot it by one read). Keeping up with the
    /// relay is the observer's job, but memory is not unlimited: an engine that outruns the
    /// observer for long (a simulated engine with no latency behind a fast frontend,
    /// thousands of outputs a step) would otherwise grow the tap without end, where a relay
    /// that stops reading only slows that engine down, as a slow frontend would. Nothing is
    /// dropped either way.
    pub async fn wait_for_room(&self) {
        let Some(s) = &self.0 else {
            return;
        };
        if s.backlog.load(Ordering::Relaxed) <= s.bound {
            return;
        }
        if !s.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                backlog_mib = s.backlog.load(Ordering::Relaxed) >> 20,
                "the trace's observer is more than --max-observer-backlog behind the relay: \
                 the tap reads more only as the observer catches up, so the engine now \
                 waits for the capture (said once)"
            );
        }
        let start = Instant::now();
        while s.backlog.load(Ordering::Relaxed) > s.bound {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        s.waits.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        s.waited_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

impl SeenSender {
    /// How far the observer is behind, for the relay to wait on.
    pub fn backlog(&self) -> Backlog {
        Backlog(Some(self.0.clone()))
    }

    /// How often the relay waited for the observer, and for how long in all.
    pub fn waited(&self) -> (u64, Duration) {
        (
            self.0.waits.load(Ordering::Relaxed),
            Duration::from_nanos(self.0.waited_ns.load(Ordering::Relaxed)),
        )
    }

    /// Queue `s` for the observer; never blocks beyond the mutex (held by the other side
    /// only to swap the queue out), and wakes the observer only if it parked.
    pub fn send(&self, s: Seen) {
        let bytes = s.bytes();
        self.0.backlog.fetch_add(bytes, Ordering::Relaxed);
        let mut st = self.0.lock();
        st.bytes += bytes;
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
        self.release();
        {
            let mut st = self.shared.lock();
            if !st.items.is_empty() {
                self.held = take(&mut st, into);
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
                self.held = take(&mut st, into);
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
        self.held = take(&mut st, into);
        if !into.is_empty() {
            self.last_item = Instant::now();
            self.poll = POLL;
        }
        Recv::Items
    }

    /// Move whatever is queued into `into` without waiting.
    pub fn try_recv_all(&mut self, into: &mut Vec<Seen>) {
        self.release();
        let mut st = self.shared.lock();
        into.append(&mut st.items);
        self.held = std::mem::take(&mut st.bytes);
    }

    /// The batch handed out last has been worked through: its bytes leave the backlog.
    fn release(&mut self) {
        let held = std::mem::take(&mut self.held);
        self.shared.backlog.fetch_sub(held, Ordering::Relaxed);
    }

    /// `bytes` of the batch in hand have been worked through (the observer says so every
    /// [`RELEASE_EVERY`] or so): they leave the backlog now, so a relay waiting at the
    /// bound goes on at the pace the observer decodes rather than after the whole batch.
    pub fn release_some(&mut self, bytes: usize) {
        let n = bytes.min(self.held);
        self.held -= n;
        self.shared.backlog.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Swap the queue into `into` (empty); returns the bytes it keeps alive, which the
/// receiver holds in the backlog until its next look.
fn take(st: &mut State, into: &mut Vec<Seen>) -> usize {
    std::mem::swap(&mut st.items, into);
    std::mem::take(&mut st.bytes)
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
        let (tx, mut rx) = channel(usize::MAX);
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

    fn output(bytes: usize) -> Seen {
        Seen::Output {
            t: 0.0,
            client: 0,
            frames: vec![Bytes::from(vec![0u8; bytes])],
        }
    }

    fn backlog(tx: &SeenSender) -> usize {
        tx.0.backlog.load(Ordering::Relaxed)
    }

    /// The backlog counts what is queued and the batch the observer is working through,
    /// and lets go of a batch when the observer comes back for more.
    #[test]
    fn the_backlog_holds_a_batch_until_the_observer_comes_back() {
        let (tx, mut rx) = channel(1000);
        tx.send(output(300));
        tx.send(output(500));
        assert_eq!(backlog(&tx), 800);
        let mut batch = Vec::new();
        rx.recv_batch(&mut batch, Duration::from_millis(10));
        assert_eq!(batch.len(), 2);
        assert_eq!(backlog(&tx), 800, "still being decoded");
        tx.send(output(100));
        batch.clear();
        rx.recv_batch(&mut batch, Duration::from_millis(10));
        assert_eq!(backlog(&tx), 100, "the first batch was let go");
        batch.clear();
        rx.try_recv_all(&mut batch);
        assert_eq!(backlog(&tx), 0);
    }

    /// Past its bound the relay's wait lasts until the observer is back within it (here
    /// when it lets go of part of its batch), and is counted; within the bound it returns
    /// at once.
    #[tokio::test(flavor = "current_thread")]
    async fn the_relay_waits_past_the_bound_until_the_observer_is_back_within_it() {
        let (tx, mut rx) = channel(1000);
        let room = tx.backlog();
        tx.send(output(1000));
        tokio::time::timeout(Duration::from_millis(100), room.wait_for_room())
            .await
            .expect("at the bound: no wait");
        assert_eq!(tx.waited().0, 0);
        tx.send(output(200));
        let observer = std::thread::spawn(move || {
            let mut batch = Vec::new();
            rx.recv_batch(&mut batch, Duration::from_millis(10));
            std::thread::sleep(Duration::from_millis(50)); // decoding the first message
            rx.release_some(1000);
            std::thread::sleep(Duration::from_millis(200)); // and the second
            rx
        });
        let start = Instant::now();
        room.wait_for_room().await;
        let waited_for = start.elapsed();
        assert!(
            waited_for >= Duration::from_millis(40),
            "waited for the first message"
        );
        assert!(
            waited_for < Duration::from_millis(200),
            "not for the whole batch: {waited_for:?}"
        );
        assert_eq!(backlog(&tx), 200);
        let (waits, waited) = tx.waited();
        assert_eq!(waits, 1);
        assert!(waited >= Duration::from_millis(40));
        drop(observer.join().unwrap());
    }

    /// A parked receiver wakes for a message at once, not at the end of its wait.
    #[test]
    fn a_parked_receiver_is_woken() {
        let (tx, mut rx) = channel(usize::MAX);
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
