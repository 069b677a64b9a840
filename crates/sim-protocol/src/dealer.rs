//! The engine's input sockets with our own ZMTP: a DEALER connected to the frontend's
//! ROUTER, read on the runtime of the thread that consumes its messages.
//!
//! Through the zeromq crate each request crossed the crate's reader task on the io
//! runtime, then a channel into the engine thread, with a cross-thread wake-up each; here
//! the stream is registered with the engine thread's own runtime, so a message is read,
//! decoded and handed over on that thread. A frame's declared length is checked against
//! the reader's bound before any of it is read (the buffer grows only as bytes arrive), so
//! a peer cannot make the engine allocate what it merely announces: a message past the
//! bound closes the socket with an error. PINGs are answered here, never delivered.
//!
//! Every vLLM line from 0.25 to 0.33 connects the engine's input socket as a DEALER with
//! the rank's identity to the frontend's bound ROUTER, sends the ready response once (the
//! message that registers it with the ROUTER), then only reads.

use std::io;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;

use crate::ReadyResponse;
use crate::listener::PeerLimits;
use crate::listener::frames::{FrameReader, Incoming};
use crate::push::{Greet, ZmtpStream, connect_push, connect_zmtp};
use crate::transport::{ConnectOptions, EngineSockets, TransportError, connect_engine};
use crate::zmtp::{self, ZmtpError};

/// A handshaken input DEALER, not yet registered with a runtime (move it to the thread
/// that reads it, then make a [`DealerReader`] there).
#[derive(Debug)]
pub struct DealerConn {
    stream: ZmtpStream,
    /// Bytes the frontend sent right behind its READY.
    early: BytesMut,
}

/// The handshake of [`crate::transport::connect_to_frontend`], with each output socket our
/// own PUSH (write it with a [`crate::push::PushWriter`]) and each input socket our own
/// DEALER (read it with a [`DealerReader`]).
pub async fn connect_to_frontend_direct(
    handshake_address: &str,
    rank: u16,
    ready: &ReadyResponse,
    opts: &ConnectOptions,
) -> Result<EngineSockets<ZmtpStream, DealerConn>, TransportError> {
    connect_engine(
        handshake_address,
        rank,
        ready,
        opts,
        async |output, opts| connect_push(&output, opts.connect_timeout).await,
        connect_dealer,
    )
    .await
}

/// Connect a DEALER with `identity` to the frontend's ROUTER at `address`, retrying for
/// `opts.connect_timeout` while nothing listens there, and send `ready` (one frame) as its
/// first message.
pub async fn connect_dealer(
    address: String,
    identity: Bytes,
    ready: Bytes,
    opts: ConnectOptions,
) -> Result<DealerConn, TransportError> {
    let mut first = Vec::with_capacity(ready.len() + 9);
    zmtp::put_frame(&mut first, 0, &ready);
    let greet = Greet {
        what: "the frontend's input socket",
        socket_type: "DEALER",
        identity: Some(&identity),
        accept: &["ROUTER"],
        first: &first,
    };
    let (stream, early) = connect_zmtp(&address, opts.connect_timeout, &greet).await?;
    Ok(DealerConn { stream, early })
}

impl DealerConn {
    /// A connection over an already handshaken stream (tests, and callers that connect
    /// their own way).
    pub fn from_stream(stream: ZmtpStream) -> Self {
        Self {
            stream,
            early: BytesMut::new(),
        }
    }
}

/// Most frames in one input message: a request's type and payload, then one frame per
/// tensor it carries. Bounded because each frame costs a handle even when empty (a 2-byte
/// empty frame would otherwise cost 16 times its size).
pub const MAX_FRAMES: usize = 4096;

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// Reads one input DEALER's messages on the current runtime.
pub struct DealerReader {
    stream: Stream,
    frames: FrameReader,
}

impl DealerReader {
    /// Register `conn` with the current tokio runtime (call it on the reading thread);
    /// messages over `max_message` bytes (headers included) close the socket.
    pub fn new(conn: DealerConn, max_message: u64) -> io::Result<Self> {
        let stream = match conn.stream {
            ZmtpStream::Tcp(s) => Stream::Tcp(tokio::net::TcpStream::from_std(s)?),
            ZmtpStream::Unix(s) => Stream::Unix(tokio::net::UnixStream::from_std(s)?),
        };
        let limits = PeerLimits {
            max_message,
            max_frames: MAX_FRAMES,
            ..PeerLimits::control(max_message)
        };
        Ok(Self {
            stream,
            frames: FrameReader::new(conn.early, limits),
        })
    }

    /// The next message's frames; `None` once the frontend closed the socket. An error
    /// (a protocol violation, a message past the bound) leaves the socket unusable: drop
    /// the reader to close it.
    pub async fn recv(&mut self) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        loop {
            let next = match &mut self.stream {
                Stream::Tcp(s) => self.frames.next(s).await?,
                Stream::Unix(s) => self.frames.next(s).await?,
            };
            match next {
                None => return Ok(None),
                Some(Incoming::Message(frames)) => return Ok(Some(frames)),
                Some(Incoming::Command(name, data)) => match name.as_ref() {
                    b"PING" => {
                        let pong = zmtp::pong_for(&data);
                        match &mut self.stream {
                            Stream::Tcp(s) => s.write_all(&pong).await?,
                            Stream::Unix(s) => s.write_all(&pong).await?,
                        }
                    }
                    b"ERROR" => {
                        let reason = data.get(1..).unwrap_or_default();
                        return Err(ZmtpError::PeerError(
                            String::from_utf8_lossy(reason).into_owned(),
                        ));
                    }
                    // PONG and commands of later ZMTP versions concern no message
                    _ => {}
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

    /// Our reader (a 1 MiB bound) on one end of a socket pair, the frontend's side the
    /// other.
    fn reader_and_peer() -> (DealerReader, tokio::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let conn = DealerConn::from_stream(ZmtpStream::Unix(ours));
        let reader = DealerReader::new(conn, 1 << 20).unwrap();
        (reader, tokio::net::UnixStream::from_std(theirs).unwrap())
    }

    fn opts() -> ConnectOptions {
        ConnectOptions {
            connect_timeout: Duration::from_secs(5),
            ..Default::default()
        }
    }

    /// Our DEALER against the zeromq crate's ROUTER: the ROUTER sees our identity and the
    /// ready payload first, and what it sends us (one frame, several frames, back to back)
    /// arrives whole and in order, over tcp and ipc.
    #[tokio::test(flavor = "current_thread")]
    async fn a_zmq_router_exchanges_messages_with_our_dealer() {
        let (dir, binds) = crate::push::tcp_and_ipc_binds("vcr-dealer", "in.sock");
        for bind in binds {
            let mut router = RouterSocket::new();
            let ep = router.bind(&bind).await.unwrap().to_string();
            let id = Bytes::from_static(&[1, 0]);
            let ready = Bytes::from_static(b"ready payload");
            let conn = connect_dealer(ep, id.clone(), ready.clone(), opts())
                .await
                .unwrap();
            let mut reader = DealerReader::new(conn, 1 << 20).unwrap();
            let first = router.recv().await.unwrap().into_vec();
            assert_eq!(first, vec![id.clone(), ready]);
            let big = Bytes::from(vec![3u8; 70_000]);
            let sends = [
                vec![Bytes::from_static(&[0])],
                vec![Bytes::from_static(&[0]), Bytes::from_static(b"add"), big],
                vec![Bytes::from_static(&[1]), Bytes::from_static(b"abort")],
            ];
            for m in &sends {
                let mut frames = vec![id.clone()];
                frames.extend(m.iter().cloned());
                router
                    .send(ZmqMessage::try_from(frames).unwrap())
                    .await
                    .unwrap();
            }
            for m in &sends {
                assert_eq!(&reader.recv().await.unwrap().unwrap(), m);
            }
            drop(router);
            assert!(reader.recv().await.unwrap().is_none(), "closed by the peer");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A PING is answered with a PONG carrying its context and is not delivered; the
    /// message after it is.
    #[tokio::test(flavor = "current_thread")]
    async fn a_ping_is_answered_not_delivered() {
        let (mut reader, mut theirs) = reader_and_peer();
        let mut out = zmtp::command_frame("PING", &[0, 30, b'c', b't', b'x']);
        zmtp::put_frame(&mut out, 0, b"after");
        theirs.write_all(&out).await.unwrap();
        let got = reader.recv().await.unwrap().unwrap();
        assert_eq!(got, vec![Bytes::from_static(b"after")]);
        let pong = zmtp::command_frame("PONG", b"ctx");
        let mut back = vec![0u8; pong.len()];
        theirs.read_exact(&mut back).await.unwrap();
        assert_eq!(back, pong);
    }

    /// A frame announcing more than the bound is refused from its header alone (the
    /// announced 2^62 bytes are never allocated) with an error naming both sizes, and no
    /// message is delivered.
    #[tokio::test(flavor = "current_thread")]
    async fn an_oversized_frame_or_too_many_frames_are_refused() {
        let (mut reader, mut theirs) = reader_and_peer();
        let mut header = vec![zmtp::FLAG_MORE | zmtp::FLAG_LONG];
        header.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let mut out = Vec::new();
        zmtp::put_frame(&mut out, zmtp::FLAG_MORE, &[0]);
        out.extend_from_slice(&header);
        theirs.write_all(&out).await.unwrap();
        match reader.recv().await {
            Err(ZmtpError::TooLarge { claimed, limit }) => {
                assert!(claimed > 1 << 62);
                assert_eq!(limit, 1 << 20);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        // a message of more empty frames than the bound is refused too
        let (mut reader, mut theirs) = reader_and_peer();
        let empties = [zmtp::FLAG_MORE, 0].repeat(MAX_FRAMES + 1);
        let writer = tokio::spawn(async move { theirs.write_all(&empties).await });
        assert!(matches!(reader.recv().await, Err(ZmtpError::Protocol(_))));
        drop(reader);
        let _ = writer.await;
    }
}
