//! Just enough ZMTP 3.x (RFC 23, with the PING/PONG of RFC 37) for the tap to relay the
//! data plane as bytes: the 64-byte greeting, the NULL mechanism's READY handshake, and
//! frame headers, so the relay can find message boundaries in the byte stream without
//! copying frames through a ZMQ socket.
//!
//! Each leg of the tap is its own ZMTP session (the tap greets the engine as the socket
//! type the frontend has, and the frontend as the engine's socket type, with the engine's
//! identity). After the handshake, data framing is the same on every leg — ROUTER and
//! DEALER add and strip identities inside the socket, never on the wire — so whole
//! messages can be forwarded byte for byte. Commands (PING/PONG) belong to one session:
//! they are answered or dropped here, never forwarded.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Frame flags (RFC 23 §"Framing").
pub const FLAG_MORE: u8 = 0x01;
pub const FLAG_LONG: u8 = 0x02;
pub const FLAG_COMMAND: u8 = 0x04;

/// The greeting's fixed length.
pub const GREETING_LEN: usize = 64;

/// Largest command the handshake accepts (a READY with a 255-byte identity is far below).
pub const MAX_COMMAND: u64 = 64 * 1024;

/// Why a ZMTP session cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("not a ZMTP 3 greeting ({0})")]
    Greeting(String),
    #[error("ZMTP protocol violation: {0}")]
    Protocol(String),
    #[error("a frame claims {claimed} bytes, more than the limit of {limit}")]
    TooLarge { claimed: u64, limit: u64 },
    #[error("the peer closed the connection during the ZMTP handshake")]
    Closed,
    #[error("the peer refused the handshake: {0}")]
    PeerError(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Our greeting: ZMTP 3.1 (we answer PINGs), mechanism NULL, as-server 0 (NULL ignores it).
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Check a peer's greeting; returns its (major, minor) version. Any 3.x is accepted (a
/// newer peer downgrades to what we announce); the mechanism must be NULL, the only one
/// vLLM uses.
pub fn check_greeting(g: &[u8]) -> Result<(u8, u8), ZmtpError> {
    if g.len() < GREETING_LEN {
        return Err(ZmtpError::Greeting(format!("{} bytes", g.len())));
    }
    if g[0] != 0xFF || g[9] & 0x01 != 0x01 {
        return Err(ZmtpError::Greeting("bad signature".into()));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting(format!(
            "version {}.{}, need 3.x",
            g[10], g[11]
        )));
    }
    let mech = &g[12..32];
    let name_len = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..name_len] != b"NULL" || mech[name_len..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Greeting(format!(
            "mechanism {:?}, only NULL is supported",
            String::from_utf8_lossy(&mech[..name_len])
        )));
    }
    Ok((g[10], g[11]))
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub flags: u8,
    /// Bytes of the header itself (2 or 9).
    pub header_len: usize,
    /// Bytes of the body the header announces.
    pub body_len: u64,
}

impl Header {
    pub fn more(&self) -> bool {
        self.flags & FLAG_MORE != 0
    }
    pub fn command(&self) -> bool {
        self.flags & FLAG_COMMAND != 0
    }
    /// Header plus body (saturating: only compared against buffered lengths).
    pub fn total(&self) -> u64 {
        self.body_len.saturating_add(self.header_len as u64)
    }
}

/// The frame header at the start of `buf`, or `None` while it is incomplete.
pub fn frame_header(buf: &[u8]) -> Result<Option<Header>, ZmtpError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Protocol(format!(
            "reserved flag bits set ({flags:#04x})"
        )));
    }
    if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
        return Err(ZmtpError::Protocol("a command frame with MORE".into()));
    }
    if flags & FLAG_LONG != 0 {
        let Some(size) = buf.get(1..9) else {
            return Ok(None);
        };
        let mut be = [0u8; 8];
        be.copy_from_slice(size);
        Ok(Some(Header {
            flags,
            header_len: 9,
            body_len: u64::from_be_bytes(be),
        }))
    } else {
        Ok(buf.get(1).map(|&n| Header {
            flags,
            header_len: 2,
            body_len: u64::from(n),
        }))
    }
}

/// Append one frame (header and body) to `out`.
pub fn put_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    let flags = flags & !FLAG_LONG;
    match u8::try_from(body.len()) {
        Ok(n) => {
            out.push(flags);
            out.push(n);
        }
        Err(_) => {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// A command frame named `name` with `data` after the name.
pub fn command_frame(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::with_capacity(body.len() + 9);
    put_frame(&mut out, FLAG_COMMAND, &body);
    out
}

/// A command body split into its name and the data after it.
pub fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let n = usize::from(
        *body
            .first()
            .ok_or_else(|| ZmtpError::Protocol("an empty command".into()))?,
    );
    if body.len() < 1 + n {
        return Err(ZmtpError::Protocol(
            "a command name longer than its frame".into(),
        ));
    }
    Ok((&body[1..1 + n], &body[1 + n..]))
}

/// The READY command for a socket of type `socket_type` with an optional identity.
pub fn ready_frame(socket_type: &str, identity: Option<&[u8]>) -> Vec<u8> {
    let mut props = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        props.push(name.len() as u8);
        props.extend_from_slice(name.as_bytes());
        props.extend_from_slice(&(value.len() as u32).to_be_bytes());
        props.extend_from_slice(value);
    };
    prop("Socket-Type", socket_type.as_bytes());
    if let Some(id) = identity {
        prop("Identity", id);
    }
    command_frame("READY", &props)
}

/// The metadata properties of a READY command's data (after the name).
pub fn parse_properties(mut data: &[u8]) -> Result<Vec<(String, Bytes)>, ZmtpError> {
    let bad = || ZmtpError::Protocol("a READY property runs past its command".into());
    let mut out = Vec::new();
    while !data.is_empty() {
        let n = usize::from(data[0]);
        let name = data.get(1..1 + n).ok_or_else(bad)?;
        let len_at = 1 + n;
        let len = data.get(len_at..len_at + 4).ok_or_else(bad)?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let value = data.get(len_at + 4..len_at + 4 + len).ok_or_else(bad)?;
        out.push((
            String::from_utf8_lossy(name).into_owned(),
            Bytes::copy_from_slice(value),
        ));
        data = &data[len_at + 4 + len..];
    }
    Ok(out)
}

/// The PONG answering a PING's data (TTL, then up to 16 bytes of context), RFC 37.
pub fn pong_for(ping_data: &[u8]) -> Vec<u8> {
    let context = ping_data.get(2..).unwrap_or_default();
    command_frame("PONG", &context[..context.len().min(16)])
}

/// What the peer said about itself in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub version: (u8, u8),
    pub socket_type: String,
    /// Its `Identity` property (empty when it sent none).
    pub identity: Bytes,
}

/// Greet the peer as a `socket_type` (with `identity`), read its greeting and READY, and
/// check that its socket type is one of `accept`. Returns the peer and whatever bytes
/// followed its READY (data the relay must not lose).
pub async fn handshake<S>(
    stream: &mut S,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<(Peer, BytesMut), ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut out = greeting().to_vec();
    out.extend_from_slice(&ready_frame(socket_type, identity));
    // Both at once: the NULL mechanism lets each side send READY without waiting, and
    // a peer that sends its greeting in two parts (libzmq) still gets all of ours.
    stream.write_all(&out).await?;
    let mut buf = BytesMut::with_capacity(4096);
    while buf.len() < GREETING_LEN {
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(ZmtpError::Closed);
        }
        // A non-ZMTP peer (an HTTP probe, say) is refused at its first bytes.
        if buf[0] != 0xFF {
            return Err(ZmtpError::Greeting("bad signature".into()));
        }
    }
    let version = check_greeting(&buf[..GREETING_LEN])?;
    buf.advance(GREETING_LEN);
    loop {
        if let Some(h) = frame_header(&buf)? {
            if !h.command() {
                return Err(ZmtpError::Protocol(
                    "a data frame before the peer's READY".into(),
                ));
            }
            if h.body_len > MAX_COMMAND {
                return Err(ZmtpError::TooLarge {
                    claimed: h.body_len,
                    limit: MAX_COMMAND,
                });
            }
            let total = h.total() as usize;
            if buf.len() >= total {
                let frame = buf.split_to(total);
                let (name, data) = split_command(&frame[h.header_len..])?;
                match name {
                    b"READY" => {
                        let mut peer = Peer {
                            version,
                            socket_type: String::new(),
                            identity: Bytes::new(),
                        };
                        for (k, v) in parse_properties(data)? {
                            // property names are case-insensitive (RFC 23)
                            if k.eq_ignore_ascii_case("Socket-Type") {
                                peer.socket_type = String::from_utf8_lossy(&v).into_owned();
                            } else if k.eq_ignore_ascii_case("Identity") {
                                peer.identity = v;
                            }
                        }
                        if !accept.iter().any(|a| *a == peer.socket_type) {
                            return Err(ZmtpError::Protocol(format!(
                                "a {} peer cannot talk to a {socket_type} socket",
                                if peer.socket_type.is_empty() {
                                    "typeless"
                                } else {
                                    &peer.socket_type
                                }
                            )));
                        }
                        return Ok((peer, buf));
                    }
                    b"ERROR" => {
                        let reason = data.get(1..).unwrap_or_default();
                        return Err(ZmtpError::PeerError(
                            String::from_utf8_lossy(reason).into_owned(),
                        ));
                    }
                    other => {
                        return Err(ZmtpError::Protocol(format!(
                            "{:?} before READY",
                            String::from_utf8_lossy(other)
                        )));
                    }
                }
            }
        }
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(ZmtpError::Closed);
        }
    }
}

/// What [`Scanner::scan`] found in the buffered bytes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// The first `complete` bytes hold only whole messages and commands: forward them (less
    /// the commands) and drop them from the buffer before the next scan.
    pub complete: usize,
    pub items: Vec<Item>,
    /// The message in progress would grow past the limit with this frame: relay it without
    /// buffering (see [`Scanner::streamed`]). `at` is where its header starts, counted
    /// after the `complete` bytes are dropped.
    pub oversize: Option<(usize, Header)>,
}

/// One thing found in the complete bytes; ranges are into the scanned buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Item {
    /// A whole message: the byte range it occupies and its frames' bodies.
    Message {
        span: std::ops::Range<usize>,
        frames: Vec<std::ops::Range<usize>>,
    },
    /// The end of a message whose beginning was streamed (no frames to observe).
    Tail { span: std::ops::Range<usize> },
    /// A command: the range of the whole frame and of its body.
    Command {
        span: std::ops::Range<usize>,
        body: std::ops::Range<usize>,
    },
}

/// Finds message boundaries in a byte stream fed in arbitrary chunks. The buffer it scans
/// always starts at the beginning of the message in progress; the caller drops
/// `Scan::complete` bytes after each scan.
#[derive(Debug)]
pub struct Scanner {
    /// Largest message (headers included) buffered before it is streamed instead.
    limit: u64,
    /// Where the next frame header starts.
    pos: usize,
    /// Body ranges of the message in progress.
    frames: Vec<std::ops::Range<usize>>,
    /// The message in progress began with a streamed frame.
    tail: bool,
}

impl Scanner {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            pos: 0,
            frames: Vec::new(),
            tail: false,
        }
    }

    /// Whether a message is partly scanned (its end not seen yet).
    pub fn mid_message(&self) -> bool {
        self.tail || !self.frames.is_empty()
    }

    /// Scan what `buf` holds beyond what was scanned before.
    pub fn scan(&mut self, buf: &[u8]) -> Result<Scan, ZmtpError> {
        let mut scan = Scan::default();
        // where the message in progress starts
        let mut start = 0;
        while let Some(h) = frame_header(&buf[self.pos..])? {
            let at = self.pos;
            if h.command() {
                if self.mid_message() {
                    return Err(ZmtpError::Protocol("a command inside a message".into()));
                }
                if h.body_len > MAX_COMMAND {
                    return Err(ZmtpError::TooLarge {
                        claimed: h.body_len,
                        limit: MAX_COMMAND,
                    });
                }
            } else if (at - start) as u64 + h.total() > self.limit {
                scan.oversize = Some((at - start, h));
                break;
            }
            let end = at as u64 + h.total();
            if (buf.len() as u64) < end {
                break;
            }
            let end = end as usize;
            let body = at + h.header_len..end;
            self.pos = end;
            if h.command() {
                scan.items.push(Item::Command {
                    span: at..end,
                    body,
                });
                start = end;
            } else {
                self.frames.push(body);
                if !h.more() {
                    let span = start..end;
                    let frames = std::mem::take(&mut self.frames);
                    scan.items.push(if std::mem::take(&mut self.tail) {
                        Item::Tail { span }
                    } else {
                        Item::Message { span, frames }
                    });
                    start = end;
                }
            }
        }
        scan.complete = start;
        self.pos -= start;
        for f in &mut self.frames {
            *f = f.start - start..f.end - start;
        }
        Ok(scan)
    }

    /// The caller relayed the message in progress up to the end of the oversize frame
    /// without buffering it and dropped those bytes: go on after that frame.
    pub fn streamed(&mut self, more: bool) {
        self.pos = 0;
        self.frames.clear();
        self.tail = more;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[(&[u8], bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (body, more) in parts {
            put_frame(&mut out, if *more { FLAG_MORE } else { 0 }, body);
        }
        out
    }

    /// Feed `stream` in chunks of `step` bytes; return the messages found (frame bodies)
    /// and check that the complete spans tile the stream.
    fn scan_in_chunks(stream: &[u8], step: usize, limit: u64) -> Vec<Vec<Vec<u8>>> {
        let mut sc = Scanner::new(limit);
        let mut buf: Vec<u8> = Vec::new();
        let mut consumed = Vec::new();
        let mut msgs = Vec::new();
        for chunk in stream.chunks(step) {
            buf.extend_from_slice(chunk);
            let scan = sc.scan(&buf).unwrap();
            assert!(scan.oversize.is_none());
            let mut next = 0;
            for item in &scan.items {
                match item {
                    Item::Message { span, frames } => {
                        assert_eq!(span.start, next);
                        next = span.end;
                        msgs.push(frames.iter().map(|r| buf[r.clone()].to_vec()).collect());
                    }
                    Item::Command { span, .. } | Item::Tail { span } => next = span.end,
                }
            }
            assert_eq!(next, scan.complete);
            consumed.extend_from_slice(&buf[..scan.complete]);
            buf.drain(..scan.complete);
        }
        assert!(buf.is_empty() && !sc.mid_message());
        assert_eq!(consumed, stream);
        msgs
    }

    #[test]
    fn boundaries_survive_any_chunking() {
        let big = vec![9u8; 70_000];
        let mut stream = frames(&[(b"abc", true), (&big, true), (b"", false)]);
        stream.extend(command_frame("PING", &[0, 1]));
        stream.extend(frames(&[(b"x", false)]));
        stream.extend(frames(&[(&[1u8; 300], false)]));
        let want: Vec<Vec<Vec<u8>>> = vec![
            vec![b"abc".to_vec(), big.clone(), vec![]],
            vec![b"x".to_vec()],
            vec![vec![1u8; 300]],
        ];
        for step in [1, 2, 3, 7, 9, 64, 1000, 65_536, stream.len()] {
            assert_eq!(scan_in_chunks(&stream, step, 1 << 20), want, "step {step}");
        }
    }

    #[test]
    fn a_command_inside_a_message_is_refused() {
        let mut stream = frames(&[(b"a", true)]);
        stream.extend(command_frame("PING", &[0, 1]));
        assert!(Scanner::new(1 << 20).scan(&stream).is_err());
    }

    #[test]
    fn oversize_frames_are_reported_before_buffering() {
        let mut stream = frames(&[(b"small", false), (b"head", true)]);
        let head_at = 7;
        let mut big = Vec::new();
        put_frame(&mut big, FLAG_MORE, &[5u8; 1000]);
        stream.extend_from_slice(&big[..20]); // only part of the big frame has arrived
        let mut sc = Scanner::new(512);
        let scan = sc.scan(&stream).unwrap();
        assert_eq!(scan.complete, head_at);
        assert_eq!(scan.items.len(), 1);
        let (at, h) = scan.oversize.unwrap();
        assert_eq!(
            at, 6,
            "after the 6-byte head frame of the message in progress"
        );
        assert_eq!(h.body_len, 1000);
        // the caller streams the rest of that frame, then the message's last frame follows
        sc.streamed(h.more());
        assert!(sc.mid_message());
        let rest = frames(&[(b"end", false), (b"next", false)]);
        let scan = sc.scan(&rest).unwrap();
        assert_eq!(scan.items[0], Item::Tail { span: 0..5 });
        assert!(matches!(scan.items[1], Item::Message { .. }));
        assert_eq!(scan.complete, rest.len());
        assert!(!sc.mid_message());
    }

    #[test]
    fn greeting_round_trip() {
        let g = greeting();
        assert_eq!(g.len(), 64);
        assert_eq!(check_greeting(&g).unwrap(), (3, 1));
        let mut v30 = g;
        v30[11] = 0;
        assert_eq!(check_greeting(&v30).unwrap(), (3, 0));
        let mut v2 = g;
        v2[10] = 2;
        assert!(check_greeting(&v2).is_err());
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&curve).is_err());
        assert!(check_greeting(&g[..10]).is_err());
    }

    #[test]
    fn ready_round_trip() {
        let f = ready_frame("DEALER", Some(&[1, 0]));
        let h = frame_header(&f).unwrap().unwrap();
        assert!(h.command() && !h.more());
        assert_eq!(h.total() as usize, f.len());
        let (name, data) = split_command(&f[h.header_len..]).unwrap();
        assert_eq!(name, b"READY");
        let props = parse_properties(data).unwrap();
        assert_eq!(
            props[0],
            ("Socket-Type".into(), Bytes::from_static(b"DEALER"))
        );
        assert_eq!(props[1], ("Identity".into(), Bytes::from_static(&[1, 0])));
        // truncated property
        assert!(parse_properties(&data[..data.len() - 1]).is_err());
    }

    #[test]
    fn headers_short_long_and_incomplete() {
        let mut f = Vec::new();
        put_frame(&mut f, FLAG_MORE, &[7u8; 255]);
        let h = frame_header(&f).unwrap().unwrap();
        assert_eq!((h.flags, h.header_len, h.body_len), (FLAG_MORE, 2, 255));
        let mut long = Vec::new();
        put_frame(&mut long, 0, &[7u8; 256]);
        let h = frame_header(&long).unwrap().unwrap();
        assert_eq!((h.flags, h.header_len, h.body_len), (FLAG_LONG, 9, 256));
        assert_eq!(h.total() as usize, long.len());
        // incomplete headers
        assert_eq!(frame_header(&[]).unwrap(), None);
        assert_eq!(frame_header(&[0]).unwrap(), None);
        assert_eq!(frame_header(&long[..5]).unwrap(), None);
        // reserved bits and a command with MORE are refused
        assert!(frame_header(&[0x08, 0]).is_err());
        assert!(frame_header(&[FLAG_COMMAND | FLAG_MORE, 0]).is_err());
    }

    #[test]
    fn pong_echoes_context() {
        let ping = command_frame("PING", &[0, 10, b'a', b'b']);
        let h = frame_header(&ping).unwrap().unwrap();
        let (name, data) = split_command(&ping[h.header_len..]).unwrap();
        assert_eq!(name, b"PING");
        let pong = pong_for(data);
        let h = frame_header(&pong).unwrap().unwrap();
        assert_eq!(
            split_command(&pong[h.header_len..]).unwrap(),
            (&b"PONG"[..], &b"ab"[..])
        );
    }

    #[tokio::test]
    async fn handshake_over_a_socket_pair_keeps_early_data() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let engine = tokio::spawn(async move {
            let r = handshake(&mut b, "DEALER", Some(b"\x01\x00"), &["ROUTER"]).await;
            // data right behind READY, before the other side answers
            b.write_all(&[0, 3, b'a', b'b', b'c']).await.unwrap();
            (r, b)
        });
        let (peer, mut rest) = handshake(&mut a, "ROUTER", None, &["DEALER"])
            .await
            .unwrap();
        assert_eq!(peer.socket_type, "DEALER");
        assert_eq!(peer.identity.as_ref(), b"\x01\x00");
        assert_eq!(peer.version, (3, 1));
        let (r, _b) = engine.await.unwrap();
        let (other, _) = r.unwrap();
        assert_eq!(other.socket_type, "ROUTER");
        assert!(other.identity.is_empty());
        while rest.len() < 5 {
            a.read_buf(&mut rest).await.unwrap();
        }
        assert_eq!(&rest[..], &[0, 3, b'a', b'b', b'c']);
    }

    #[tokio::test]
    async fn handshake_refuses_wrong_socket_type_and_garbage() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let other = tokio::spawn(async move { handshake(&mut b, "PUB", None, &["SUB"]).await });
        assert!(handshake(&mut a, "PULL", None, &["PUSH"]).await.is_err());
        drop(a);
        let _ = other.await;
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        b.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(matches!(
            handshake(&mut a, "PULL", None, &["PUSH"]).await,
            Err(ZmtpError::Greeting(_))
        ));
    }
}
