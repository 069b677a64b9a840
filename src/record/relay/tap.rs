//! Starting the relay and the handle that stops it ([`Tap`]).

use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use sim_protocol::listener::ZmtpRouter;
use sim_protocol::transport::{bind_address, connect_address, tcp_host};
use tokio::sync::mpsc;

use crate::record::handoff::SeenSender;

use super::ctx::{Ctx, Event, RelayConfig};
use super::handshake::{handshake_limits, handshake_loop};

/// The running relay. Dropping it (or [`Tap::stop`]) stops every relay task.
pub struct Tap {
    pub(super) ctx: Arc<Ctx>,
    pub(super) engine_handshake: String,
}

impl Tap {
    /// The resolved address engines connect to.
    pub fn engine_handshake(&self) -> &str {
        &self.engine_handshake
    }

    /// Every engine is gone: send the frontend `ENGINE_CORE_DEAD` on every output socket
    /// (vLLM's own signal of a dead engine; the frontend fails its requests instead of
    /// waiting forever). Give it a moment to go out before [`Tap::stop`].
    pub fn tell_frontend_engine_dead(&self) {
        let _ = self.ctx.engines_gone.send(true);
    }

    /// Stop relaying: abort every task (closing the sockets they own).
    pub fn stop(&self) {
        if let Ok(mut tasks) = self.ctx.tasks.lock() {
            for t in tasks.drain(..) {
                t.abort();
            }
        }
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.stop();
    }
}

fn is_wildcard(host: &str) -> bool {
    matches!(host, "0.0.0.0" | "[::]" | "::" | "*")
}

/// Bind the engine handshake socket and start relaying.
pub async fn start(
    cfg: RelayConfig,
    seen: SeenSender,
    events: mpsc::UnboundedSender<Event>,
) -> Result<Tap> {
    let frontend_handshake =
        connect_address(&cfg.frontend_handshake).context("--frontend-handshake")?;
    let bind = bind_address(&cfg.engine_handshake).context("--engine-handshake")?;
    let bind_host = tcp_host(&bind)
        .ok_or_else(|| anyhow!("--engine-handshake must be a tcp:// address, got {bind}"))?
        .to_string();
    let eh = ZmtpRouter::bind(&bind, "engine handshake", handshake_limits())
        .await
        .with_context(|| format!("binding the engine handshake socket at {bind}"))?;
    let resolved = eh.endpoint().to_string();
    let advertise_host = match &cfg.advertise_host {
        Some(h) => h.clone(),
        None if is_wildcard(&bind_host) => "127.0.0.1".to_string(),
        None => bind_host.clone(),
    };
    let ctx = Arc::new(Ctx {
        max_frame: cfg.max_message_bytes.max(1024),
        cfg,
        frontend_handshake,
        bind_host,
        advertise_host,
        backlog: seen.backlog(),
        seen,
        events,
        tasks: std::sync::Mutex::new(Vec::new()),
        engines_gone: tokio::sync::watch::channel(false).0,
    });
    let c = ctx.clone();
    ctx.spawn(async move {
        if let Err(e) = handshake_loop(&c, eh).await {
            c.event(Event::Failed(e.context("the handshake relay failed")));
        }
    });
    Ok(Tap {
        ctx,
        engine_handshake: resolved,
    })
}
