//! A pipe's read buffer ([`ReadBuf`]): how big the next one is.
//!
//! The observer gets slices of the read buffer, not copies, and holds them until it has
//! decoded them. A buffer the observer is done with is read into again in place
//! (`try_reclaim`); one it still holds part of is left to it, and the pipe reads into a new
//! one: [`READ_CHUNK`] bytes, a message larger than that so far growing geometrically,
//! and, while the pipe is in a burst (its reads return at least a quarter of
//! [`READ_CHUNK`]), [`BURST_BUF`] bytes, so that a read takes all the socket holds (fewer
//! reads and writes per message) and a new buffer is needed less often. In a burst the
//! observer falls behind (it decodes tens of thousands of messages a second, the relay
//! forwards hundreds of thousands) and holds every buffer until the burst is over, so a
//! burst's bytes are new memory whatever the pipe does: keeping used-up buffers to take
//! back later would not save an allocation.

use std::io;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::legs::READ_CHUNK;

/// The least free space a read is given, and the read size from which a pipe counts as in
/// a burst.
const MIN_READ: usize = READ_CHUNK / 4;

/// A read buffer's size in a burst.
pub(super) const BURST_BUF: usize = 4 << 20;

/// A pipe's read buffer: `buf` holds what has been read and not yet handed on.
pub(super) struct ReadBuf {
    pub(super) buf: BytesMut,
    /// The last read was a burst's (see the module's doc).
    burst: bool,
}

impl ReadBuf {
    /// Start with what the handshake read past its end.
    pub(super) fn new(pending: BytesMut) -> Self {
        Self {
            buf: pending,
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
    /// holds: in place if the observer is done with the rest of this buffer, else in a new
    /// one.
    pub(super) fn make_room(&mut self) {
        if self.buf.capacity() - self.buf.len() >= MIN_READ || self.buf.try_reclaim(MIN_READ) {
            return;
        }
        let len = self.buf.len();
        let cap = if self.burst && len + MIN_READ <= BURST_BUF {
            BURST_BUF
        } else if len + MIN_READ <= READ_CHUNK {
            READ_CHUNK
        } else {
            // a message larger than a buffer so far
            (len + READ_CHUNK).next_power_of_two()
        };
        let mut next = BytesMut::with_capacity(cap);
        next.extend_from_slice(&self.buf);
        self.buf = next;
    }

    /// Say whether the last read was a burst's, as [`ReadBuf::read_from`] does.
    #[cfg(test)]
    fn set_burst(&mut self, burst: bool) {
        self.burst = burst;
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

    /// What the observer holds is never overwritten; a buffer it let go of is read into
    /// again.
    #[test]
    fn reads_never_overwrite_what_the_observer_holds() {
        let mut r = ReadBuf::new(BytesMut::new());
        let mut held = Vec::new();
        for i in 0..84 {
            held.push(fill_and_hand_on(&mut r, READ_CHUNK, i as u8));
        }
        for (i, h) in held.iter().enumerate() {
            assert!(h.iter().all(|&b| b == i as u8), "slice {i} was overwritten");
        }
        let last = held.last().map(|h| h.as_ptr() as usize);
        drop(held);
        let again = fill_and_hand_on(&mut r, READ_CHUNK, 9);
        assert_eq!(
            Some(again.as_ptr() as usize),
            last,
            "the let-go buffer is read into"
        );
        assert!(again.iter().all(|&b| b == 9));
    }

    /// An unfinished message's bytes move into the next buffer unchanged, whether that
    /// buffer is the same one reclaimed or a new larger one (a message bigger than a buffer).
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

    /// In a burst a new buffer is a burst-sized one (reads take what the socket holds); out
    /// of it the pipe goes back to small buffers.
    #[test]
    fn a_burst_reads_into_large_buffers() {
        let mut r = ReadBuf::new(BytesMut::new());
        let mut held = vec![fill_and_hand_on(&mut r, READ_CHUNK, 1)];
        r.set_burst(true);
        held.push(fill_and_hand_on(&mut r, READ_CHUNK, 2));
        assert!(r.buf.capacity() + READ_CHUNK >= BURST_BUF);
        // the burst buffer filled up: the next is another
        held.push(fill_and_hand_on(&mut r, BURST_BUF, 3));
        held.push(fill_and_hand_on(&mut r, READ_CHUNK, 4));
        assert!(r.buf.capacity() + READ_CHUNK >= BURST_BUF);
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
