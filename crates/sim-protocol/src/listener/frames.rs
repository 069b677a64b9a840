//! ZMTP frames read from a peer under its [`PeerLimits`]: a frame's declared length is
//! checked before its body is read, and the buffer grows only as bytes arrive.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::zmtp::{self, ZmtpError};

/// What one peer of an accepting socket may make it hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Largest message a peer may send: every frame's header and body, in bytes. A frame
    /// that would take its message past this closes the peer's connection before any of
    /// the frame is read.
    pub max_message: u64,
    /// Most frames in one message (each frame costs a handle even when empty).
    pub max_frames: usize,
    /// Most peers connected at once; a connection beyond them is closed at once.
    pub max_peers: usize,
    /// How long a new connection may take to send its greeting and READY.
    pub handshake_timeout: Duration,
    /// Messages queued towards one peer; further ones to it are dropped until it reads.
    pub send_queue: usize,
}

impl PeerLimits {
    /// Limits for a control socket whose messages are small (`max_message` bytes at most).
    pub fn control(max_message: u64) -> Self {
        Self {
            max_message,
            max_frames: 64,
            max_peers: 256,
            handshake_timeout: Duration::from_secs(10),
            send_queue: 1024,
        }
    }
}

/// Growth of a peer's read buffer per read: a peer gets memory as its bytes arrive, never
/// on the strength of a header alone.
const READ_CHUNK: usize = 64 * 1024;

/// One thing a peer sent.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A whole message's frame bodies.
    Message(Vec<Bytes>),
    /// A command: its name and data.
    Command(Bytes, Bytes),
}

/// Reads one peer's frames with the limits applied before any allocation.
pub(crate) struct FrameReader {
    pub(super) buf: BytesMut,
    pub(super) limits: PeerLimits,
}

impl FrameReader {
    pub(crate) fn new(pending: BytesMut, limits: PeerLimits) -> Self {
        Self {
            buf: pending,
            limits,
        }
    }

    /// The next message or command, or `None` when the peer closed (a message it left
    /// unfinished is dropped whole).
    pub(crate) async fn next<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<Incoming>, ZmtpError> {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut message_bytes: u64 = 0;
        loop {
            let want = match zmtp::frame_header(&self.buf)? {
                Some(h) => {
                    if h.command() {
                        if !frames.is_empty() {
                            return Err(ZmtpError::Protocol("a command inside a message".into()));
                        }
                        if h.body_len > zmtp::MAX_COMMAND {
                            return Err(ZmtpError::TooLarge {
                                claimed: h.body_len,
                                limit: zmtp::MAX_COMMAND,
                            });
                        }
                    } else {
                        let claimed = message_bytes.saturating_add(h.total());
                        if claimed > self.limits.max_message {
                            return Err(ZmtpError::TooLarge {
                                claimed,
                                limit: self.limits.max_message,
                            });
                        }
                        if frames.len() >= self.limits.max_frames {
                            return Err(ZmtpError::Protocol(format!(
                                "a message of more than {} frames",
                                self.limits.max_frames
                            )));
                        }
                    }
                    // bounded by the checks above
                    let total = h.total() as usize;
                    if self.buf.len() >= total {
                        let frame = self.buf.split_to(total).freeze();
                        let body = frame.slice(h.header_len..);
                        if h.command() {
                            let (name, data) = zmtp::split_command(&body)?;
                            let name = body.slice_ref(name);
                            let data = body.slice_ref(data);
                            return Ok(Some(Incoming::Command(name, data)));
                        }
                        frames.push(body);
                        message_bytes += total as u64;
                        if !h.more() {
                            return Ok(Some(Incoming::Message(frames)));
                        }
                        continue;
                    }
                    (total - self.buf.len()).min(READ_CHUNK)
                }
                None => 16,
            };
            if self.buf.capacity() - self.buf.len() < want {
                self.buf.reserve(want);
            }
            if r.read_buf(&mut self.buf).await? == 0 {
                return Ok(None);
            }
        }
    }
}

/// Encode a message's frames for the wire (MORE on every frame but the last).
pub fn encode_message(frames: &[Bytes]) -> Bytes {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        let flags = if i + 1 < frames.len() {
            zmtp::FLAG_MORE
        } else {
            0
        };
        zmtp::put_frame(&mut out, flags, f);
    }
    Bytes::from(out)
}
