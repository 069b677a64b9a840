//! A data connection's socket as the relay reads and writes it: the reader registered with
//! the reactor for readability only, the writer sending without any registration until a
//! send finds the peer's buffer full.
//!
//! A tokio stream registers both readability and writability with epoll for its whole
//! life. On a Unix-domain socket the kernel signals writability each time the peer
//! consumes what was sent, so every message the relay forwarded came back as a wake-up of
//! the relay's thread with nothing to do: a context switch per hop, paid by the relay, and
//! a wake-up paid by the peer in its read. Here writability is waited for only while a send
//! cannot go through (the peer is not reading), and the registration is dropped after.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// The reading end: readability only.
pub(super) struct SockReader(AsyncFd<OwnedFd>);

/// The writing end: a duplicate of the socket's descriptor, registered for writability
/// only while a send waits for room. Dropping it shuts the socket down for writing (as a
/// tokio stream's write half does), whoever still reads from it.
pub(super) struct SockWriter {
    fd: OwnedFd,
    waiting: Option<AsyncFd<OwnedFd>>,
}

/// Split a connected, non-blocking stream socket (a TCP or Unix-domain stream taken out of
/// tokio) into the relay's two ends. Must run inside the runtime.
pub(super) fn split(fd: OwnedFd) -> io::Result<(SockReader, SockWriter)> {
    let writer = SockWriter {
        fd: fd.try_clone()?,
        waiting: None,
    };
    let reader = SockReader(register(fd, Interest::READABLE)?);
    Ok((reader, writer))
}

fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` keeps its descriptor open, and the same, until it is dropped,
    // which happens only with the `AsyncFd` that owns it.
    unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

impl AsyncRead for SockReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            // SAFETY: `recv` writes at most `want` bytes into the unfilled part of the
            // buffer, which is valid for writes of that many bytes; only the `n` bytes it
            // reports are marked initialised and filled.
            let (n, want) = unsafe {
                let dst = buf.unfilled_mut();
                let want = dst.len();
                let n = libc::recv(
                    guard.get_inner().as_raw_fd(),
                    dst.as_mut_ptr().cast(),
                    want,
                    0,
                );
                (n, want)
            };
            if n < 0 {
                let e = last_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        guard.clear_ready();
                        continue;
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => return Poll::Ready(Err(e)),
                }
            }
            let n = n as usize;
            // A read that did not fill the buffer drained the socket: with edge-triggered
            // epoll the next data is a new event, so skip the read that would find nothing
            // (as tokio's own streams do).
            if n > 0 && n < want {
                guard.clear_ready();
            }
            // SAFETY: `recv` initialised the first `n` bytes of the unfilled part.
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            return Poll::Ready(Ok(()));
        }
    }
}

impl AsyncWrite for SockWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            // SAFETY: `data` is valid for reads of its length.
            let n = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    data.as_ptr().cast(),
                    data.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                // room again: stop hearing about every byte the peer consumes
                self.waiting = None;
                return Poll::Ready(Ok(n as usize));
            }
            let e = last_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Poll::Ready(Err(e)),
            }
            if self.waiting.is_none() {
                // Registering reports the socket writable at once if room appeared since
                // the send: no wake-up is lost between the two.
                let dup = self.fd.as_fd().try_clone_to_owned()?;
                self.waiting = Some(register(dup, Interest::WRITABLE)?);
            }
            let Some(waiting) = &self.waiting else {
                continue;
            };
            let mut guard = ready!(waiting.poll_write_ready(cx))?;
            guard.clear_ready();
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(shutdown_write(&self.fd))
    }
}

fn shutdown_write(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: `shutdown` on a descriptor we own; no memory is passed.
    if unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_WR) } < 0 {
        return Err(last_error());
    }
    Ok(())
}

impl Drop for SockWriter {
    fn drop(&mut self) {
        let _ = shutdown_write(&self.fd);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Far more than a socket buffer holds: the writer must wait for the reader.
    const BYTES: usize = 8 << 20;

    /// The writer finds the peer's buffer full and waits (it does not finish while nobody
    /// reads), then everything arrives in order once the reader reads, and dropping the
    /// writer ends the stream.
    async fn full_buffer_waits_and_loses_nothing(a: OwnedFd, b: OwnedFd) {
        let (_ra, mut wa) = split(a).unwrap();
        let (mut rb, _wb) = split(b).unwrap();
        let data: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            wa.write_all(&sent).await.unwrap();
            drop(wa);
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!writer.is_finished(), "8 MiB fit in the socket's buffers");
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), rb.read_to_end(&mut got))
            .await
            .expect("the writer resumes when the reader drains the socket")
            .unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "bytes changed or reordered");
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn over_a_unix_socket() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        full_buffer_waits_and_loses_nothing(a.into(), b.into()).await;
    }

    #[tokio::test]
    async fn over_tcp() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        full_buffer_waits_and_loses_nothing(a.into(), b.into()).await;
    }
}
