//! The DP merge: the output connections of several engines relayed into the one stream
//! to the frontend, message by message.

use std::sync::Arc;

use sim_protocol::ENGINE_CORE_DEAD;

use crate::record::handoff::Seen;

use super::ctx::{Ctx, Event};
use super::legs::{Listener, Writer, accept_each, accepted_leg, handshake_refused};
use super::pipe::{Got, Oversize, PipeEnd, pipe_with_room};

/// Engines' output connections on client `client`: each relays into the one stream to
/// the frontend.
pub(super) async fn accept_outputs(ctx: &Arc<Ctx>, client: usize, listener: Listener, to: Writer) {
    accept_each(ctx, client, "output", listener, |stream| {
        let c = ctx.clone();
        let to = to.clone();
        async move {
            let leg = match accepted_leg(stream, "PULL", &["PUSH"]).await {
                Ok(leg) => leg,
                Err(e) => {
                    handshake_refused(client, "output", &e);
                    return;
                }
            };
            let limit = c.max_frame;
            let end = pipe_with_room(
                leg,
                Some(to),
                limit,
                Oversize::DropSource,
                &c.backlog,
                |got| match got {
                    Got::Message { t, frames } => {
                        let dead = frames.len() == 1 && frames[0].as_ref() == ENGINE_CORE_DEAD;
                        c.observe(Seen::Output { t, client, frames });
                        if dead {
                            c.event(Event::EngineDead);
                        }
                    }
                    Got::Streamed => c.observe(Seen::Streamed {
                        what: format!(
                            "an engine output message on client {client} larger than \
                             --max-frame-size"
                        ),
                    }),
                },
            )
            .await;
            match end {
                PipeEnd::WriteFailed(e) => {
                    c.event(Event::FrontendGone(format!("output socket {client} ({e})")));
                }
                PipeEnd::SourceClosed(Some(why)) => {
                    tracing::warn!(client, "an engine's output connection was dropped: {why}");
                }
                PipeEnd::SourceClosed(None) => {
                    tracing::debug!(client, "an engine's output connection closed");
                }
            }
        }
    })
    .await;
}
