//! The byte relay: whole messages forwarded as the bytes they arrived as, one write for
//! all a read brought in, each handed to the observer.

use bytes::{Buf, Bytes};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::OwnedMutexGuard;

use sim_protocol::zmtp;

use super::bufs::ReadBuf;
use super::legs::{Leg, Writer};
use crate::play::engine::timer::now_monotonic;
use crate::record::handoff::Backlog;

/// What a pipe hands its owner.
pub(super) enum Got {
    /// A whole message, with the time its last bytes were read (before forwarding).
    Message { t: f64, frames: Vec<Bytes> },
    /// A message over the size limit, forwarded without being buffered (or observed).
    Streamed,
}

/// Why a pipe stopped.
pub(super) enum PipeEnd {
    /// The source closed its connection (or broke the protocol: `Some(why)`).
    SourceClosed(Option<String>),
    /// Forwarding failed: the destination is gone.
    WriteFailed(String),
}

/// Write `data` to the destination, through the held guard if a streamed message holds it.
async fn write_to(
    held: &mut Option<OwnedMutexGuard<Box<dyn AsyncWrite + Send + Unpin>>>,
    to: &Writer,
    data: &[u8],
) -> std::io::Result<()> {
    match held {
        Some(g) => g.write_all(data).await,
        None => to.lock().await.write_all(data).await,
    }
}

/// What a pipe does with a message larger than its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Oversize {
    /// Stream it through with the destination held until it ends: for a destination only
    /// this source writes to, from a peer we connected to (the frontend).
    Stream,
    /// Close the source's connection before any byte of that message is relayed: for a
    /// destination shared by several sources (DP engines' outputs merge into one stream)
    /// or a source that connected to us. A streamed message whose source dies halfway
    /// would leave a partial message in the shared stream, and every later message on it
    /// would be misread.
    DropSource,
}

/// Relay whole messages from `src` to `to` (or drop them when `to` is `None`): read, find
/// the message boundaries, write every complete message of the read at once, then hand
/// copies to `on`. PINGs from the source are answered on its own connection; commands are
/// never forwarded. Messages are only ever written whole, so several pipes can share one
/// destination (DP engines into one output stream) without interleaving mid-message, and a
/// message the source leaves unfinished is never written. A message larger than `limit` is
/// handled as `oversize` says.
pub(super) async fn pipe<F: FnMut(Got)>(
    src: Leg,
    to: Option<Writer>,
    limit: u64,
    oversize: Oversize,
    on: F,
) -> PipeEnd {
    pipe_with_room(src, to, limit, oversize, &Backlog::none(), on).await
}

/// [`pipe`] for a source whose messages go to the observer: before each read it waits
/// while the observer is past its bound ([`Backlog::wait_for_room`]).
pub(super) async fn pipe_with_room<F: FnMut(Got)>(
    mut src: Leg,
    to: Option<Writer>,
    limit: u64,
    oversize: Oversize,
    room: &Backlog,
    mut on: F,
) -> PipeEnd {
    let mut rb = ReadBuf::new(std::mem::take(&mut src.pending));
    let mut scanner = zmtp::Scanner::new(limit);
    let mut held: Option<OwnedMutexGuard<Box<dyn AsyncWrite + Send + Unpin>>> = None;
    let mut t = now_monotonic();
    let end = 'relay: loop {
        let buf = &mut rb.buf;
        let scan = match scanner.scan(buf) {
            Ok(s) => s,
            Err(e) => break PipeEnd::SourceClosed(Some(e.to_string())),
        };
        if scan.complete > 0 {
            // Forward the complete bytes less any commands: one write in the usual case.
            if let Some(to) = &to {
                let mut from = 0;
                for item in &scan.items {
                    if let zmtp::Item::Command { span, .. } = item {
                        if span.start > from
                            && let Err(e) = write_to(&mut held, to, &buf[from..span.start]).await
                        {
                            break 'relay PipeEnd::WriteFailed(e.to_string());
                        }
                        from = span.end;
                    }
                }
                if scan.complete > from
                    && let Err(e) = write_to(&mut held, to, &buf[from..scan.complete]).await
                {
                    break 'relay PipeEnd::WriteFailed(e.to_string());
                }
            }
            // The observer gets slices of the bytes just relayed, not copies: they share
            // the read buffer's allocation (the next reads fill the rest of it; another
            // is taken once it is used up, see `ReadBuf`).
            let chunk = buf.split_to(scan.complete).freeze();
            for item in scan.items {
                match item {
                    zmtp::Item::Message { frames, .. } => {
                        let frames = frames.into_iter().map(|f| chunk.slice(f)).collect();
                        on(Got::Message { t, frames });
                    }
                    zmtp::Item::Tail { .. } => {}
                    zmtp::Item::Command { body, .. } => {
                        if let Ok((b"PING", data)) = zmtp::split_command(&chunk[body]) {
                            let pong = zmtp::pong_for(data);
                            if let Err(e) = src.writer.lock().await.write_all(&pong).await {
                                break 'relay PipeEnd::SourceClosed(Some(e.to_string()));
                            }
                        }
                    }
                }
            }
            if !scanner.mid_message() {
                held = None;
            }
        }
        if let Some((at, h)) = scan.oversize {
            if oversize == Oversize::DropSource {
                break 'relay PipeEnd::SourceClosed(Some(format!(
                    "a message of more than {limit} bytes (--max-frame-size); nothing of it was relayed and the connection is dropped"
                )));
            }
            on(Got::Streamed);
            if held.is_none()
                && let Some(to) = &to
            {
                held = Some(to.clone().lock_owned().await);
            }
            // the message so far and the whole oversize frame, as it arrives
            let mut remaining = at as u64 + h.total();
            loop {
                let n = usize::try_from(remaining)
                    .unwrap_or(usize::MAX)
                    .min(rb.buf.len());
                if n > 0 {
                    if let Some(g) = held.as_mut()
                        && let Err(e) = g.write_all(&rb.buf[..n]).await
                    {
                        break 'relay PipeEnd::WriteFailed(e.to_string());
                    }
                    rb.buf.advance(n);
                    remaining -= n as u64;
                }
                if remaining == 0 {
                    break;
                }
                match rb.read_from(&mut src.reader).await {
                    Ok(0) => break 'relay PipeEnd::SourceClosed(None),
                    Ok(_) => {}
                    Err(e) => break 'relay PipeEnd::SourceClosed(Some(e.to_string())),
                }
            }
            scanner.streamed(h.more());
            if !h.more() {
                held = None;
            }
            t = now_monotonic();
            continue;
        }
        room.wait_for_room().await;
        match rb.read_from(&mut src.reader).await {
            Ok(0) => break PipeEnd::SourceClosed(None),
            Ok(_) => t = now_monotonic(),
            Err(e) => break PipeEnd::SourceClosed(Some(e.to_string())),
        }
    };
    if let Some(mut g) = held {
        // The source died inside a streamed message: what follows on this connection
        // would be read as the rest of it. Close it rather than corrupt the stream.
        tracing::warn!("a streamed message was cut off; closing the connection it went to");
        let _ = g.shutdown().await;
    }
    end
}
