//! Binding the tap's data plane for an INIT: a listener per frontend client and socket,
//! and the connections to the frontend's output sockets.

use std::sync::Arc;

use anyhow::Result;
use sim_protocol::ENGINE_CORE_DEAD;
use sim_protocol::ready::HandshakeInit;
use sim_protocol::transport::connect_address;
use tokio::io::AsyncWriteExt;

use sim_protocol::zmtp;

use super::ctx::{Ctx, Event};
use super::inputs::accept_inputs;
use super::legs::{data_listener, open_leg};
use super::merge::accept_outputs;
use super::pipe::{Oversize, PipeEnd, pipe};

/// The addresses of the data plane: the frontend's, and the tap's that replace them in
/// INIT.
pub(super) struct Plane {
    pub(super) frontend_inputs: Vec<String>,
    pub(super) frontend_outputs: Vec<String>,
    pub(super) tap_inputs: Vec<String>,
    pub(super) tap_outputs: Vec<String>,
}

/// Bind the tap's data listeners (one input and one output per frontend client), connect
/// to the frontend's output sockets and start relaying.
pub(super) async fn build_plane(ctx: &Arc<Ctx>, init: &HandshakeInit) -> Result<Plane> {
    let mut plane = Plane {
        frontend_inputs: init.inputs.clone(),
        frontend_outputs: init.outputs.clone(),
        tap_inputs: Vec::new(),
        tap_outputs: Vec::new(),
    };
    for (client, (f_in, f_out)) in init.inputs.iter().zip(&init.outputs).enumerate() {
        let f_in = connect_address(f_in)?;
        let f_out = connect_address(f_out)?;
        let (inputs, tap_in) = data_listener(ctx, &f_in, client, "in").await?;
        let (outputs, tap_out) = data_listener(ctx, &f_out, client, "out").await?;
        plane.tap_inputs.push(tap_in);
        plane.tap_outputs.push(tap_out);

        let frontend = open_leg(
            ctx,
            &f_out,
            "PUSH",
            None,
            &["PULL"],
            "frontend's output socket",
        )
        .await?;
        let to_frontend = frontend.writer.clone();

        // The frontend never sends on its PULL; reading it answers PINGs and sees it go.
        let c = ctx.clone();
        let limit = ctx.max_frame;
        ctx.spawn(async move {
            let why = match pipe(frontend, None, limit, Oversize::Stream, |_| {}).await {
                PipeEnd::SourceClosed(why) => why,
                PipeEnd::WriteFailed(why) => Some(why),
            };
            c.event(Event::FrontendGone(match why {
                Some(why) => format!("output socket {client} ({why})"),
                None => format!("output socket {client}"),
            }));
        });

        // Every engine gone: say ENGINE_CORE_DEAD for them, between two messages (every
        // write to this stream is of whole messages).
        let c = ctx.clone();
        let to = to_frontend.clone();
        ctx.spawn(async move {
            let mut gone = c.engines_gone.subscribe();
            if gone.wait_for(|g| *g).await.is_ok() {
                tracing::warn!(
                    client,
                    "telling the frontend the engine is dead (ENGINE_CORE_DEAD)"
                );
                let mut frame = Vec::new();
                zmtp::put_frame(&mut frame, 0, ENGINE_CORE_DEAD);
                let mut w = to.lock().await;
                let _ = w.write_all(&frame).await;
                let _ = w.flush().await;
            }
        });

        let c = ctx.clone();
        ctx.spawn(async move {
            accept_outputs(&c, client, outputs, to_frontend).await;
        });
        let c = ctx.clone();
        ctx.spawn(async move {
            accept_inputs(&c, client, inputs, f_in).await;
        });
    }
    Ok(plane)
}
