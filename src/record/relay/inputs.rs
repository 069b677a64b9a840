//! Engines' input connections: each gets its own connection to the frontend carrying the
//! engine's identity, and the frontend's requests come back on it.

use std::sync::Arc;

use anyhow::Result;

use crate::record::handoff::Seen;

use super::ctx::{Ctx, Event, hex_id};
use super::legs::{Accepted, Listener, accept_each, accepted_leg, handshake_refused, open_leg};
use super::pipe::{Got, Oversize, PipeEnd, pipe, pipe_with_room};

/// Engines' input connections on client `client`: each gets its own connection to the
/// frontend's input socket, carrying the engine's identity.
pub(super) async fn accept_inputs(
    ctx: &Arc<Ctx>,
    client: usize,
    listener: Listener,
    frontend: String,
) {
    accept_each(ctx, client, "input", listener, |stream| {
        let c = ctx.clone();
        let frontend = frontend.clone();
        async move {
            if let Err(e) = engine_input(&c, client, stream, &frontend).await {
                c.event(Event::Failed(e));
            }
        }
    })
    .await;
}
/// One engine's input connection: its messages (the ready response) go to the frontend,
/// the frontend's requests come back.
async fn engine_input(
    ctx: &Arc<Ctx>,
    client: usize,
    stream: Accepted,
    frontend: &str,
) -> Result<()> {
    let engine = match accepted_leg(stream, "ROUTER", &["DEALER"]).await {
        Ok(leg) => leg,
        Err(e) => {
            handshake_refused(client, "input", &e);
            return Ok(());
        }
    };
    let identity = engine.peer.identity.clone();
    let to_engine = engine.writer.clone();
    let fe = open_leg(
        ctx,
        frontend,
        "DEALER",
        (!identity.is_empty()).then_some(identity.as_ref()),
        &["ROUTER"],
        "frontend's input socket",
    )
    .await?;
    let to_frontend = fe.writer.clone();
    let limit = ctx.max_frame;

    let c = ctx.clone();
    let id = identity.clone();
    ctx.spawn(async move {
        let end = pipe_with_room(
            fe,
            Some(to_engine),
            limit,
            Oversize::Stream,
            &c.backlog,
            |got| match got {
                Got::Message { t, frames } => c.observe(Seen::Input {
                    t,
                    client,
                    engine: id.clone(),
                    frames,
                }),
                Got::Streamed => c.observe(Seen::Streamed {
                    what: format!(
                        "a frontend message on client {client} larger than --max-frame-size"
                    ),
                }),
            },
        )
        .await;
        match end {
            PipeEnd::SourceClosed(why) => c.event(Event::FrontendGone(match why {
                Some(why) => format!("input socket {client} ({why})"),
                None => format!("input socket {client}"),
            })),
            PipeEnd::WriteFailed(e) => {
                tracing::warn!(
                    client,
                    engine = %hex_id(&id),
                    "cannot forward a request to the engine ({e}); it is gone"
                );
                c.event(Event::EngineGone(id));
            }
        }
    });

    let mut first = true;
    let end = pipe(
        engine,
        Some(to_frontend),
        limit,
        Oversize::DropSource,
        |got| {
            if let Got::Message { frames, .. } = got {
                if std::mem::take(&mut first) {
                    ctx.observe(Seen::Ready {
                        engine: identity.clone(),
                        client,
                        payload: frames.first().cloned().unwrap_or_default(),
                    });
                } else {
                    tracing::debug!(client, "relayed an engine message on an input socket");
                }
            }
        },
    )
    .await;
    match end {
        PipeEnd::SourceClosed(why) => {
            if let Some(why) = why {
                tracing::warn!(client, engine = %hex_id(&identity), "engine input connection: {why}");
            }
            ctx.observe(Seen::EngineGone {
                engine: identity.clone(),
            });
            ctx.event(Event::EngineGone(identity));
        }
        PipeEnd::WriteFailed(e) => {
            ctx.event(Event::FrontendGone(format!("input socket {client} ({e})")));
        }
    }
    Ok(())
}
