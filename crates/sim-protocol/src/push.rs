//! The engine's output sockets with our own ZMTP: a PUSH connected to the frontend's PULL
//! whose messages are framed and written straight from the thread that encoded them.
//!
//! Through the zeromq crate each step's message crossed two tasks (the caller's send, then
//! the crate's writer task) with a wake-up each; here a message is one `write` on the
//! caller's thread. The socket is non-blocking: what the kernel does not take at once waits
//! in a per-peer backlog that [`PushWriter::flush`] writes when the socket is writable, and
//! [`PushWriter::over_bound`] tells the caller to wait for it (as a ZMQ PUSH at its
//! high-water mark blocks its sender), so a frontend that stops reading cannot grow it
//! without bound.
//!
//! Every vLLM line from 0.25 to 0.33 connects the engine's output socket as a PUSH to the
//! frontend's bound PULL, with the NULL mechanism and no identity; the greeting and READY
//! are [`crate::zmtp`]'s (the ones the tap already exchanges with both frontends).

use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::{Instant, timeout_at};

use crate::transport::{TransportError, connect_address};
use crate::zmtp::{self, FLAG_MORE};

/// How many bytes a peer's backlog may hold before the sender waits for the peer (about a
/// thousand large steps: ZMQ's default high-water mark is 1,000 messages).
pub const BACKLOG_BOUND: usize = 16 << 20;

/// Poll interval while the frontend's output port is not open yet.
const RETRY: Duration = Duration::from_millis(100);

/// A connected, handshaken ZMTP stream (non-blocking): an output PUSH, or an input
/// DEALER ([`crate::dealer`]).
#[derive(Debug)]
pub enum ZmtpStream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl AsRawFd for ZmtpStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            ZmtpStream::Tcp(s) => s.as_raw_fd(),
            ZmtpStream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl ZmtpStream {
    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ZmtpStream::Tcp(s) => (&*s).write(buf),
            ZmtpStream::Unix(s) => (&*s).write(buf),
        }
    }
}

/// Connect a PUSH to the frontend's PULL at `address` (`tcp://` or `ipc://`), retrying
/// until `total` has passed while nothing listens there, and run the ZMTP handshake.
pub async fn connect_push(address: &str, total: Duration) -> Result<ZmtpStream, TransportError> {
    let peer = Greet {
        what: "the frontend's output socket",
        socket_type: "PUSH",
        identity: None,
        accept: &["PULL"],
        first: &[],
    };
    connect_zmtp(address, total, &peer).await.map(|(s, _)| s)
}

/// How to greet a peer in [`connect_zmtp`].
pub(crate) struct Greet<'a> {
    /// The peer's socket, for errors ("the frontend's output socket").
    pub what: &'a str,
    pub socket_type: &'a str,
    pub identity: Option<&'a [u8]>,
    /// The peer socket types accepted.
    pub accept: &'a [&'a str],
    /// Framed bytes written right after the handshake (a first message), or none.
    pub first: &'a [u8],
}

/// Connect to `address`, retrying until `total` has passed while nothing listens there,
/// run the ZMTP handshake as `greet` says, and hand back the stream (non-blocking, not
/// registered with any runtime) with whatever bytes the peer sent after its READY.
pub(crate) async fn connect_zmtp(
    address: &str,
    total: Duration,
    greet: &Greet<'_>,
) -> Result<(ZmtpStream, BytesMut), TransportError> {
    let address = connect_address(address)?;
    let deadline = Instant::now() + total;
    let timed_out = |last: &io::Error| TransportError::Timeout {
        what: format!("{} at {address} (last error: {last})", greet.what),
        after: total,
    };
    loop {
        let attempt = timeout_at(deadline, try_connect(&address, greet)).await;
        let err = match attempt {
            Err(_) => {
                return Err(timed_out(&io::Error::from(io::ErrorKind::TimedOut)));
            }
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(Attempt::Refused(e))) => e,
            Ok(Err(Attempt::Fatal(e))) => return Err(e),
        };
        if timeout_at(deadline, tokio::time::sleep(RETRY))
            .await
            .is_err()
        {
            return Err(timed_out(&err));
        }
    }
}

enum Attempt {
    /// Nothing listens yet (or it went away): try again.
    Refused(io::Error),
    Fatal(TransportError),
}

async fn greet_peer<S>(s: &mut S, address: &str, greet: &Greet<'_>) -> Result<BytesMut, Attempt>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let failed = |e: zmtp::ZmtpError| {
        Attempt::Fatal(TransportError::Protocol(format!(
            "the ZMTP handshake with {} at {address}: {e}",
            greet.what
        )))
    };
    let (_, rest) = zmtp::handshake(s, greet.socket_type, greet.identity, greet.accept)
        .await
        .map_err(failed)?;
    if !greet.first.is_empty() {
        s.write_all(greet.first)
            .await
            .map_err(|e| failed(e.into()))?;
    }
    Ok(rest)
}

async fn try_connect(address: &str, greet: &Greet<'_>) -> Result<(ZmtpStream, BytesMut), Attempt> {
    let refused = Attempt::Refused;
    if let Some(rest) = address.strip_prefix("tcp://") {
        let mut s = tokio::net::TcpStream::connect(rest)
            .await
            .map_err(refused)?;
        // libzmq sets TCP_NODELAY on every connection: a step's message leaves at once
        s.set_nodelay(true).map_err(refused)?;
        let early = greet_peer(&mut s, address, greet).await?;
        let s = s.into_std().map(ZmtpStream::Tcp).map_err(refused)?;
        Ok((s, early))
    } else if let Some(path) = address.strip_prefix("ipc://") {
        let mut s = tokio::net::UnixStream::connect(path)
            .await
            .map_err(refused)?;
        let early = greet_peer(&mut s, address, greet).await?;
        let s = s.into_std().map(ZmtpStream::Unix).map_err(refused)?;
        Ok((s, early))
    } else {
        Err(Attempt::Fatal(TransportError::BadAddress {
            address: address.to_string(),
            reason: "only tcp:// and ipc:// are supported".into(),
        }))
    }
}

/// Append one message (its frames, MORE on all but the last) to `out` as ZMTP frames.
pub fn put_message(out: &mut Vec<u8>, frames: &[Bytes]) {
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        zmtp::put_frame(out, more, f);
    }
}

/// One peer's output: the stream, registered with the runtime of the thread that writes
/// it, the messages held for one write, and the bytes the kernel has not taken yet.
pub struct PushWriter {
    fd: AsyncFd<ZmtpStream>,
    /// Framed bytes not written yet; `backlog[start..]` is what is left.
    backlog: Vec<u8>,
    start: usize,
    /// Framed messages not handed to the kernel yet: the message being framed, or, while
    /// [`Self::hold`] is on, every message since (its allocation is reused).
    held: Vec<u8>,
    /// Messages in `held`.
    held_messages: usize,
    holding: bool,
}

/// Held messages are written once they reach this many bytes, or [`HOLD_MESSAGES`]
/// messages, holding or not: a burst's first outputs are not kept back for long.
pub const HOLD_LIMIT: usize = 64 << 10;
pub const HOLD_MESSAGES: usize = 32;

impl PushWriter {
    /// Register `stream` with the current tokio runtime (call it on the writing thread).
    pub fn new(stream: ZmtpStream) -> io::Result<Self> {
        // SAFETY: the stream owns its descriptor and keeps it, unchanged, until it drops
        // with the AsyncFd.
        let fd = unsafe { AsyncFd::register_with_interest(stream, Interest::WRITABLE) }
            .map_err(io::Error::from)?;
        Ok(Self {
            fd,
            backlog: Vec::new(),
            start: 0,
            held: Vec::with_capacity(4096),
            held_messages: 0,
            holding: false,
        })
    }

    /// Send one message: written at once when nothing waits before it, else queued after
    /// the backlog. An error means the peer is gone.
    pub fn send(&mut self, frames: &[Bytes]) -> io::Result<()> {
        put_message(&mut self.held, frames);
        self.held_messages += 1;
        self.release()
    }

    /// Send one message whose first frame `write_body` appends to the buffer it is given
    /// (returning the frames after it, usually none): the body is encoded where it is
    /// written from, with no copy and no allocation of its own. An `Err` of `write_body`
    /// sends nothing and is returned as is.
    pub fn send_encoded<E>(
        &mut self,
        write_body: impl FnOnce(&mut Vec<u8>) -> Result<Vec<Bytes>, E>,
    ) -> Result<io::Result<()>, E> {
        let at = self.held.len();
        // room for a long header
        self.held.extend_from_slice(&[0; 9]);
        let rest = match write_body(&mut self.held) {
            Ok(rest) => rest,
            Err(e) => {
                self.held.truncate(at);
                return Err(e);
            }
        };
        let more = if rest.is_empty() { 0 } else { FLAG_MORE };
        let len = self.held.len() - at - 9;
        match u8::try_from(len) {
            Ok(n) => {
                // a short header: move the (short) body up against it
                self.held.copy_within(at + 9.., at + 2);
                self.held.truncate(at + 2 + len);
                self.held[at] = more;
                self.held[at + 1] = n;
            }
            Err(_) => {
                self.held[at] = more | zmtp::FLAG_LONG;
                self.held[at + 1..at + 9].copy_from_slice(&(len as u64).to_be_bytes());
            }
        }
        put_message(&mut self.held, &rest);
        self.held_messages += 1;
        Ok(self.release())
    }

    /// Hold the messages sent from now on for one write (up to [`HOLD_LIMIT`] bytes or
    /// [`HOLD_MESSAGES`] messages), or,
    /// with `false`, write what is held now. For a burst of messages produced back to back
    /// (an engine whose steps are due at once): one system call instead of one each.
    pub fn hold(&mut self, on: bool) -> io::Result<()> {
        self.holding = on;
        self.release()
    }

    /// Write the held messages unless they are to be held longer.
    fn release(&mut self) -> io::Result<()> {
        let full = self.held.len() >= HOLD_LIMIT || self.held_messages >= HOLD_MESSAGES;
        if self.held.is_empty() || (self.holding && !full) {
            return Ok(());
        }
        self.held_messages = 0;
        let result = if self.backlogged() {
            self.backlog.extend_from_slice(&self.held);
            Ok(())
        } else {
            self.write_now(&self.held).map(|n| {
                let rest = &self.held[n..];
                self.backlog.extend_from_slice(rest);
            })
        };
        self.held.clear();
        result
    }

    /// Write what the kernel takes without waiting.
    fn write_now(&self, buf: &[u8]) -> io::Result<usize> {
        let mut n = 0;
        while n < buf.len() {
            match self.fd.get_ref().write(&buf[n..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }

    /// Bytes waiting for the peer (not counting held ones).
    pub fn backlog(&self) -> usize {
        self.backlog.len() - self.start
    }

    pub fn backlogged(&self) -> bool {
        self.backlog() > 0
    }

    /// Whether the sender should wait for [`Self::flush`] before sending more.
    pub fn over_bound(&self) -> bool {
        self.backlog() > BACKLOG_BOUND
    }

    /// Wait until the socket is writable and write as much of the backlog as it takes.
    /// Cancel-safe: nothing is lost when the future is dropped.
    pub async fn flush(&mut self) -> io::Result<()> {
        while self.backlogged() {
            let mut guard = self.fd.writable().await?;
            let (buf, start) = (&self.backlog, self.start);
            match guard.try_io(|fd| fd.get_ref().write(&buf[start..])) {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => {
                    self.start += n;
                    if self.start == self.backlog.len() {
                        // all written: give back a big buffer, keep a small one
                        self.backlog.clear();
                        self.backlog.shrink_to(1 << 16);
                        self.start = 0;
                    }
                    return Ok(());
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    /// Forget the backlog (the peer is gone).
    pub fn discard(&mut self) {
        self.backlog = Vec::new();
        self.held = Vec::new();
        self.held_messages = 0;
        self.start = 0;
    }
}

/// Addresses to bind a test's peer socket on, one per transport: an ephemeral TCP port on
/// loopback, and a Unix socket `sock` in a directory of this process named after `tag`
/// (returned too, for the test to remove).
#[cfg(test)]
pub(crate) fn tcp_and_ipc_binds(tag: &str, sock: &str) -> (std::path::PathBuf, [String; 2]) {
    let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ipc = format!("ipc://{}", dir.join(sock).display());
    (dir, ["tcp://127.0.0.1:0".to_string(), ipc])
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::{PullSocket, Socket, SocketRecv};

    /// Our PUSH talks to the zeromq crate's PULL (the same greeting and READY as libzmq's):
    /// multi-frame messages arrive whole and in order, over tcp and ipc.
    #[tokio::test(flavor = "current_thread")]
    async fn a_zmq_pull_receives_our_messages() {
        let (dir, binds) = tcp_and_ipc_binds("vcr-push", "out.sock");
        for bind in binds {
            let mut pull = PullSocket::new();
            let ep = pull.bind(&bind).await.unwrap().to_string();
            let stream = connect_push(&ep, Duration::from_secs(5)).await.unwrap();
            let mut w = PushWriter::new(stream).unwrap();
            let big = Bytes::from(vec![7u8; 300]);
            w.send(&[Bytes::from_static(b"one")]).unwrap();
            w.send(&[Bytes::from_static(b"two"), big.clone()]).unwrap();
            w.flush().await.unwrap();
            let m1 = pull.recv().await.unwrap().into_vec();
            assert_eq!(m1, vec![Bytes::from_static(b"one")]);
            let m2 = pull.recv().await.unwrap().into_vec();
            assert_eq!(m2, vec![Bytes::from_static(b"two"), big]);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A peer that does not read: what the kernel does not take waits in the backlog, which
    /// reports when it passes its bound and is written in order once the peer reads.
    #[tokio::test(flavor = "current_thread")]
    async fn a_slow_peer_fills_the_backlog_then_gets_everything_in_order() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut w = PushWriter::new(ZmtpStream::Unix(ours)).unwrap();
        let chunk = Bytes::from(vec![1u8; 64 << 10]);
        let mut sent = 0usize;
        while !w.over_bound() {
            w.send(std::slice::from_ref(&chunk)).unwrap();
            sent += 1;
        }
        assert!(w.backlog() > BACKLOG_BOUND);
        let reader = std::thread::spawn(move || {
            use std::io::Read;
            let mut theirs = theirs;
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).unwrap();
            got
        });
        while w.backlogged() {
            w.flush().await.unwrap();
        }
        drop(w);
        let got = reader.join().unwrap();
        // each message: a 9-byte long-frame header, then the body
        assert_eq!(got.len(), sent * (9 + chunk.len()));
        assert_eq!(&got[..9], &[zmtp::FLAG_LONG, 0, 0, 0, 0, 0, 1, 0, 0]);
    }

    /// A body encoded in place goes out as the same frames as the body sent whole: short
    /// and long headers, with and without frames after it.
    #[tokio::test(flavor = "current_thread")]
    async fn an_encoded_body_is_framed_like_a_whole_one() {
        let cases: [(usize, Vec<Bytes>); 4] = [
            (5, vec![]),
            (300, vec![]),
            (5, vec![Bytes::from_static(b"aux")]),
            (70_000, vec![Bytes::from(vec![9u8; 400])]),
        ];
        for (len, rest) in cases {
            let body = Bytes::from((0..len).map(|i| i as u8).collect::<Vec<u8>>());
            let mut expected = Vec::new();
            let whole: Vec<Bytes> = std::iter::once(body.clone())
                .chain(rest.iter().cloned())
                .collect();
            put_message(&mut expected, &whole);
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            ours.set_nonblocking(true).unwrap();
            let mut w = PushWriter::new(ZmtpStream::Unix(ours)).unwrap();
            w.send_encoded(|buf| {
                buf.extend_from_slice(&body);
                Ok::<_, ()>(rest.clone())
            })
            .unwrap()
            .unwrap();
            let failed: Result<io::Result<()>, &str> = w.send_encoded(|buf| {
                buf.extend_from_slice(b"half-written");
                Err("cannot encode")
            });
            assert_eq!(failed.err(), Some("cannot encode"));
            drop(w);
            let mut got = Vec::new();
            use std::io::Read;
            let mut theirs = theirs;
            theirs.read_to_end(&mut got).unwrap();
            assert_eq!(
                got,
                expected,
                "body of {len} bytes, {} frames after",
                rest.len()
            );
        }
    }

    /// Held messages reach the peer only when released (or past the limit), whole and in
    /// order.
    #[tokio::test(flavor = "current_thread")]
    async fn held_messages_leave_together_when_released() {
        use std::io::Read;
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let mut w = PushWriter::new(ZmtpStream::Unix(ours)).unwrap();
        w.hold(true).unwrap();
        for m in [&b"a"[..], b"bb", b"ccc"] {
            w.send_encoded(|buf| {
                buf.extend_from_slice(m);
                Ok::<_, ()>(vec![])
            })
            .unwrap()
            .unwrap();
        }
        let mut got = [0u8; 64];
        let nothing = theirs.read(&mut got);
        assert_eq!(
            nothing.map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock)
        );
        w.hold(false).unwrap();
        let n = theirs.read(&mut got).unwrap();
        assert_eq!(&got[..n], b"\x00\x01a\x00\x02bb\x00\x03ccc");
        // past the limit, held bytes go out without a release
        w.hold(true).unwrap();
        let big = Bytes::from(vec![5u8; HOLD_LIMIT]);
        w.send(std::slice::from_ref(&big)).unwrap();
        let n = theirs.read(&mut got).unwrap();
        assert!(n > 0);
    }

    /// A peer that went away: the send fails, so the caller can stop sending to it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_closed_peer_fails_the_send() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        drop(theirs);
        let mut w = PushWriter::new(ZmtpStream::Unix(ours)).unwrap();
        assert!(w.send(&[Bytes::from_static(b"x")]).is_err());
    }
}
