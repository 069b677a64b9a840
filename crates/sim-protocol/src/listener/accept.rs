//! Binding a `tcp://` or `ipc://` address and accepting connections on it.

use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};

use crate::transport::TransportError;

/// A bound `tcp://` or `ipc://` listener.
pub(super) enum Acceptor {
    Tcp(TcpListener),
    Ipc(UnixListener, PathBuf),
}

pub(super) type BoxStream = Box<dyn AsyncReadWrite>;
pub(super) trait AsyncReadWrite: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> AsyncReadWrite for T {}

impl Acceptor {
    pub(super) async fn bind(address: &str) -> Result<(Self, String), TransportError> {
        let bad = |reason: String| TransportError::BadAddress {
            address: address.to_string(),
            reason,
        };
        if let Some(rest) = address.strip_prefix("tcp://") {
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port".into()))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let host = if host == "*" { "0.0.0.0" } else { host };
            let port: u16 = if port == "*" {
                0
            } else {
                port.parse()
                    .map_err(|_| bad(format!("bad port `{port}`")))?
            };
            let l = TcpListener::bind((host, port))
                .await
                .map_err(|e| bad(format!("cannot listen: {e}")))?;
            let local = l
                .local_addr()
                .map_err(|e| bad(format!("cannot read the bound address: {e}")))?;
            Ok((Acceptor::Tcp(l), format!("tcp://{local}")))
        } else if let Some(path) = address.strip_prefix("ipc://") {
            let path = PathBuf::from(path);
            // a socket file left by an earlier process is replaced, as libzmq does
            if let Ok(meta) = std::fs::symlink_metadata(&path) {
                use std::os::unix::fs::FileTypeExt;
                if meta.file_type().is_socket() {
                    let _ = std::fs::remove_file(&path);
                }
            }
            let l = UnixListener::bind(&path).map_err(|e| bad(format!("cannot listen: {e}")))?;
            Ok((Acceptor::Ipc(l, path), address.to_string()))
        } else {
            Err(bad("only tcp:// and ipc:// are supported".into()))
        }
    }

    pub(super) async fn accept(&self) -> std::io::Result<(BoxStream, String)> {
        match self {
            Acceptor::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), addr.to_string()))
            }
            Acceptor::Ipc(l, path) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), path.display().to_string()))
            }
        }
    }
}
