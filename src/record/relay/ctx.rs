//! What every relay task shares: the configuration, the queue to the observer, the
//! supervisor's events and the tasks to stop.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::record::handoff::{Backlog, Seen, SeenSender};

/// Where the tap sits.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The frontend's handshake address (the tap connects to it, as an engine would).
    pub frontend_handshake: String,
    /// Where engines connect (the tap binds it, as a frontend would).
    pub engine_handshake: String,
    /// Host advertised to engines for the tap's data sockets (default: the engine
    /// handshake host, or 127.0.0.1 when that is a wildcard).
    pub advertise_host: Option<String>,
    /// Where to bind Unix-domain data sockets for engines instead of TCP ones.
    pub engine_ipc_dir: Option<std::path::PathBuf>,
    /// How long to wait for the frontend's sockets to accept a connection.
    pub connect_timeout: Duration,
    /// Largest message (bytes) the data relay buffers whole, for the observer and for
    /// merging DP engines' outputs; a larger one is streamed through and not observed.
    pub max_message_bytes: u64,
}

/// Lifecycle events for the supervisor.
#[derive(Debug)]
pub enum Event {
    /// An engine's READY was relayed: it is attached.
    EngineReady(Bytes),
    /// An engine's data connection closed.
    EngineGone(Bytes),
    /// A connection to the frontend closed (what closed).
    FrontendGone(String),
    /// `ENGINE_CORE_DEAD` was relayed.
    EngineDead,
    /// The relay cannot go on.
    Failed(anyhow::Error),
}

pub(super) struct Ctx {
    pub(super) cfg: RelayConfig,
    /// `cfg.max_message_bytes`, at least enough for any frame header.
    pub(super) max_frame: u64,
    pub(super) frontend_handshake: String,
    pub(super) bind_host: String,
    pub(super) advertise_host: String,
    pub(super) seen: SeenSender,
    /// How far the observer is behind: the pipes whose messages it decodes wait on it.
    pub(super) backlog: Backlog,
    pub(super) events: mpsc::UnboundedSender<Event>,
    pub(super) tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// Turns true when every engine is gone: the output relays tell the frontend with
    /// `ENGINE_CORE_DEAD`, as an engine that dies does, so its clients do not hang.
    pub(super) engines_gone: tokio::sync::watch::Sender<bool>,
}

impl Ctx {
    pub(super) fn spawn<F>(&self, f: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let handle = tokio::spawn(f);
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(handle);
        }
    }

    pub(super) fn event(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// Hand a copy to the observer; never blocks (the pipes wait for room before they
    /// read, see [`Backlog`]).
    pub(super) fn observe(&self, s: Seen) {
        self.seen.send(s);
    }
}

pub(super) fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}
