//! A pipe's read buffer, and the used-up buffers it takes back once the observer is done
//! with them ([`ReadBuf`]).
//!
//! The observer gets slices of the read buffer, not copies, and holds them until it has
//! decoded them — in a burst, long after the relay has filled the buffer and moved on. A
//! new allocation for every buffer would put the relay's reads into memory the kernel must
//! fault in page by page (in `recv`'s copy; a fifth of the relay's CPU in a burst). So a pipe
//! keeps its used-up buffers (its own handle on each, emptied) and, when it needs another,
//! takes one whose every slice the observer has dropped: `bytes` counts the handles on an
//! allocation, and when the pipe's is the only one left the memory is free to refill. No
//! message passes back from the observer and the relay never waits for it: when no kept
//! buffer is free yet, it allocates one, as without the pool.
//!
//! The pool is bounded: at most [`KEPT`] buffers of [`READ_CHUNK`] bytes per pipe; a buffer
//! grown past that size for a large message is not kept, nor is one used up while the list
//! is full (it is freed when the observer drops its last slice).
//!
//! The pool pays where the observer keeps up (a lone message's round trip: most buffers
//! come back). In a burst the observer falls behind (it decodes tens of thousands of messages a second,
//! the relay forwards hundreds of thousands) and keeps every buffer until the burst is
//! over, so none comes back to be reused: a burst's bytes are new memory whatever the
//! pool. There a pipe reads into [`BURST_BUF`]-byte buffers, so that a read takes all the
//! socket holds (fewer reads and writes per message) and a new buffer is needed less often.
//! A pipe is in a burst while its reads return at least a quarter of [`READ_CHUNK`]; such
//! buffers are not kept: they are freed once the observer is done.

use std::collections::VecDeque;
use std::io;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::legs::READ_CHUNK;

/// How many used-up buffers a pipe keeps for reuse (4 MiB with [`READ_CHUNK`] of 64 KiB):
/// enough to cover the observer running some tens of milliseconds behind a burst.
pub(super) const KEPT: usize = 64;

/// The least free space a read is given, and the read size from which a pipe counts as in
/// a burst.
const MIN_READ: usize = READ_CHUNK / 4;

/// A read buffer's size in a burst.
pub(super) const BURST_BUF: usize = 4 << 20;

/// A pipe's read buffer: `buf` holds what has been read and not yet handed on.
pub(super) struct ReadBuf {
    pub(super) buf: BytesMut,
    /// `buf`'s allocation is one of [`READ_CHUNK`] bytes made here, worth keeping.
    standard: bool,
    /// Used-up buffers, oldest first, each emptied: the handle that lets it be refilled.
    spent: VecDeque<BytesMut>,
    /// The last read was a burst's (see the module's doc).
    burst: bool,
}

impl ReadBuf {
    /// Start with what the handshake read past its end.
    pub(super) fn new(pending: BytesMut) -> Self {
        Self {
            buf: pending,
            standard: false,
            spent: VecDeque::new(),
            burst: false,
        }
    }

    /// Read what `src` has into the buffer (after making room), as `read_buf` does.
    pub(super) async fn read_from<R: AsyncRead + Unpin>(
        &mut self,
        src: &mut R,
    ) -> io::Result<usize> {
        self.make_room();
        let n = src.read_buf(&mut self.buf).await?;
        self.burst = n >= MIN_READ;
        Ok(n)
    }

    /// Make room for a read of at least a quarter of [`READ_CHUNK`], keeping what `buf`
    /// holds: in place if the observer is done with the rest of this buffer, else in a
    /// kept buffer it is done with, else in a new one.
    pub(super) fn make_room(&mut self) {
        if self.buf.capacity() - self.buf.len() >= MIN_READ || self.buf.try_reclaim(MIN_READ) {
            return;
        }
        let len = self.buf.len();
        let (mut next, standard) = if self.burst && len + MIN_READ <= BURST_BUF {
            (BytesMut::with_capacity(BURST_BUF), false)
        } else if len + MIN_READ <= READ_CHUNK {
            match self.take() {
                Some(b) => (b, true),
                None => (BytesMut::with_capacity(READ_CHUNK), true),
            }
        } else {
            // a message larger than a buffer so far: grow geometrically, and do not keep it
            let cap = (len + READ_CHUNK).next_power_of_two();
            (BytesMut::with_capacity(cap), cap == READ_CHUNK)
        };
        next.extend_from_slice(&self.buf);
        let mut old = std::mem::replace(&mut self.buf, next);
        // When the list is full the observer is far behind; the buffers kept are the ones
        // it will let go of first, so this one is not kept.
        if std::mem::replace(&mut self.standard, standard) && self.spent.len() < KEPT {
            old.clear();
            self.spent.push_back(old);
        }
    }

    /// Say whether the last read was a burst's, as [`ReadBuf::read_from`] does.
    #[cfg(test)]
    fn set_burst(&mut self, burst: bool) {
        self.burst = burst;
    }

    /// A kept buffer no slice of which is left elsewhere, emptied to its full size.
    fn take(&mut self) -> Option<BytesMut> {
        // Oldest first: the observer lets go of buffers in the order they were filled. A
        // slice held for longer only costs a look here.
        let i = self
            .spent
            .iter_mut()
            .position(|b| b.try_reclaim(READ_CHUNK))?;
        self.spent.remove(i)
    }

    /// How many used-up buffers are kept.
    #[cfg(test)]
    pub(super) fn kept(&self) -> usize {
        self.spent.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fill the buffer with `n` bytes of `b` and hand it all on, as the pipe hands a read's
    /// complete messages to the observer.
    fn fill_and_hand_on(r: &mut ReadBuf, n: usize, b: u8) -> bytes::Bytes {
        r.make_room();
        let take = n.min(r.buf.capacity() - r.buf.len());
        r.buf.extend_from_slice(&vec![b; take]);
        r.buf.split_to(r.buf.len()).freeze()
    }

    /// Buffers come back once the observer drops its slices (the same memory is read into
    /// again), not while it holds them; what the observer holds is never overwritten; the
    /// list of kept buffers stays within its bound.
    #[test]
    fn reuses_only_what_the_observer_let_go_and_stays_bounded() {
        let mut r = ReadBuf::new(BytesMut::new());
        // The observer holds everything: every buffer is new, the slices keep their bytes.
        let mut held = Vec::new();
        for i in 0..(KEPT + 20) {
            held.push(fill_and_hand_on(&mut r, READ_CHUNK, i as u8));
        }
        assert!(r.kept() <= KEPT);
        for (i, h) in held.iter().enumerate() {
            assert!(h.iter().all(|&b| b == i as u8), "slice {i} was overwritten");
        }
        let held_ptrs: Vec<usize> = held.iter().map(|h| h.as_ptr() as usize).collect();
        // The observer lets go: the next buffers are ones it held, kept ones.
        drop(held);
        let mut again = Vec::new();
        for i in 0..KEPT {
            again.push(fill_and_hand_on(&mut r, READ_CHUNK, !(i as u8)));
        }
        let reused = again
            .iter()
            .filter(|s| held_ptrs.contains(&(s.as_ptr() as usize)))
            .count();
        assert_eq!(reused, KEPT, "buffers reused");
        for (i, s) in again.iter().enumerate() {
            assert!(
                s.iter().all(|&b| b == !(i as u8)),
                "slice {i} was overwritten"
            );
        }
        assert!(r.kept() <= KEPT);
    }

    /// An unfinished message's bytes move into the next buffer unchanged, whether that
    /// buffer is a kept one or a new larger one (a message bigger than a buffer).
    #[test]
    fn keeps_an_unfinished_message_across_buffers() {
        let mut r = ReadBuf::new(BytesMut::new());
        let first = fill_and_hand_on(&mut r, READ_CHUNK, 1);
        drop(first);
        // a partial message of 40 KiB spans into the next buffer (which may be the first)
        r.make_room();
        let part: Vec<u8> = (0..40 * 1024).map(|i| (i % 251) as u8).collect();
        r.buf.extend_from_slice(&part);
        r.make_room();
        assert_eq!(&r.buf[..], &part[..]);
        // it keeps growing past a buffer: still the same bytes, room for more
        let mut all = part.clone();
        while all.len() < 3 * READ_CHUNK {
            r.make_room();
            let n = r.buf.capacity() - r.buf.len();
            assert!(n >= MIN_READ);
            let more = vec![7u8; n.min(5000)];
            r.buf.extend_from_slice(&more);
            all.extend_from_slice(&more);
        }
        assert_eq!(&r.buf[..], &all[..]);
    }

    /// In a burst a new buffer is a burst-sized one (reads take what the socket holds),
    /// never kept for reuse; out of it the pipe goes back to small kept buffers.
    #[test]
    fn a_burst_reads_into_large_buffers_that_are_not_kept() {
        let mut r = ReadBuf::new(BytesMut::new());
        let mut held = vec![fill_and_hand_on(&mut r, READ_CHUNK, 1)];
        r.set_burst(true);
        held.push(fill_and_hand_on(&mut r, READ_CHUNK, 2));
        assert!(r.buf.capacity() + READ_CHUNK >= BURST_BUF);
        let kept = r.kept();
        // the burst buffer filled up: the next is another, and the full one is not kept
        held.push(fill_and_hand_on(&mut r, BURST_BUF, 3));
        held.push(fill_and_hand_on(&mut r, READ_CHUNK, 4));
        assert!(r.buf.capacity() + READ_CHUNK >= BURST_BUF);
        assert_eq!(r.kept(), kept);
        r.set_burst(false);
        held.push(fill_and_hand_on(&mut r, BURST_BUF, 5));
        held.push(fill_and_hand_on(&mut r, READ_CHUNK, 6));
        assert!(r.buf.capacity() <= READ_CHUNK);
        for (i, h) in held.iter().enumerate() {
            assert!(
                h.iter().all(|&b| b == i as u8 + 1),
                "slice {i} was overwritten"
            );
        }
    }
}
