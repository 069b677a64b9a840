//! The engine thread's outlet: each step's outputs are encoded for the line and written to
//! the client's output socket right there, on the engine thread, with our own ZMTP framing
//! ([`sim_protocol::push`]). Before, a step's message crossed the engine thread, an output
//! task and the zeromq crate's writer task, a wake-up per hop; that fixed cost per step was
//! most of the engine's CPU behind a frontend.
//!
//! Pulls and grammar compiles still go to the io runtime (they spawn work there).

use std::time::Duration;

use sim_protocol::encode::{EncodeOptions, OutputEncoder};
use sim_protocol::push::{PushWriter, ZmtpStream};
use sim_protocol::{ENGINE_CORE_DEAD, EngineCoreOutputs, VllmLine};
use tokio::sync::mpsc;

use crate::play::engine::engine_core::{EngineInput, Outbound, Outlet};

/// One client's output socket.
struct Client {
    writer: PushWriter,
    /// Outputs dropped since the socket failed (0: it has not).
    failed: u64,
}

pub(crate) struct EngineOutlet {
    encoder: OutputEncoder,
    clients: Vec<Client>,
    /// Pulls and grammar compiles, for the io runtime.
    jobs: mpsc::UnboundedSender<Outbound>,
    /// The engine's own input path (aborts for a client that is gone).
    side: mpsc::UnboundedSender<EngineInput>,
    /// Why the outlet gave up (an envelope the line cannot carry).
    failure: Option<String>,
}

impl EngineOutlet {
    /// Register the handshaken output streams with the current (the engine thread's)
    /// runtime.
    pub(crate) fn new(
        line: VllmLine,
        streams: Vec<ZmtpStream>,
        jobs: mpsc::UnboundedSender<Outbound>,
        side: mpsc::UnboundedSender<EngineInput>,
    ) -> std::io::Result<Self> {
        let clients = streams
            .into_iter()
            .map(|s| {
                Ok(Client {
                    writer: PushWriter::new(s)?,
                    failed: 0,
                })
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            encoder: OutputEncoder::new(line, EncodeOptions::default()),
            clients,
            jobs,
            side,
            failure: None,
        })
    }

    /// Why the outlet stopped the loop, if it did.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    fn send_outputs(&mut self, client: u32, env: EngineCoreOutputs) -> bool {
        let clients = self.clients.len();
        let Some(c) = self.clients.get_mut(client as usize) else {
            tracing::error!(
                client,
                clients,
                "dropping an output for an unknown client index"
            );
            return true;
        };
        if c.failed > 0 {
            c.failed += 1;
            abort_for_gone_client(&self.side, client, &env);
            return true;
        }
        let encoder = &mut self.encoder;
        match c.writer.send_encoded(|buf| encoder.encode_into(&env, buf)) {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                gone(c, client, &e);
                abort_for_gone_client(&self.side, client, &env);
                true
            }
            Err(e) => {
                // An engine that cannot speak its line is broken: fail loudly.
                let line = self.encoder.line();
                tracing::error!("cannot encode an output for vLLM {line}: {e}");
                self.failure = Some(format!("encoding failed: {e}"));
                self.queue_dead();
                false
            }
        }
    }

    /// Queue `ENGINE_CORE_DEAD` on every socket, after what is queued there.
    fn queue_dead(&mut self) {
        tracing::error!("sending ENGINE_CORE_DEAD to the frontend");
        let dead = [bytes::Bytes::from_static(ENGINE_CORE_DEAD)];
        for c in self.clients.iter_mut().filter(|c| c.failed == 0) {
            let _ = c.writer.send(&dead);
        }
    }

    /// Tell the frontend the engine died (after the outputs queued before), and give the
    /// frames up to a few seconds to leave.
    pub(crate) async fn send_dead(&mut self) {
        self.queue_dead();
        self.linger(Duration::from_secs(4)).await;
    }

    /// Write what is still queued, for up to `limit` (vLLM's output sockets linger 4 s),
    /// then report the outputs no client could take.
    pub(crate) async fn linger(&mut self, limit: Duration) {
        self.hold(false);
        let done = tokio::time::timeout(limit, async {
            while self.backlogged() {
                self.drain().await;
            }
        })
        .await;
        if done.is_err() {
            tracing::warn!("the frontend did not read the last outputs within {limit:?}");
        }
        for (client, c) in self
            .clients
            .iter()
            .enumerate()
            .filter(|(_, c)| c.failed > 1)
        {
            tracing::warn!(
                client,
                "{} outputs could not be sent to this client",
                c.failed
            );
        }
    }
}

/// A client whose output socket failed is gone (its API server died or closed the socket):
/// like vLLM when a client goes away, its requests are aborted rather than generated for
/// nobody, and nothing more is sent to it. The first failure is logged; the outputs
/// dropped after it are counted.
fn gone(c: &mut Client, client: u32, e: &std::io::Error) {
    tracing::warn!(
        client,
        "output socket send failed (frontend gone?): {e}; aborting this client's requests \
         and sending it nothing more"
    );
    c.failed = 1;
    c.writer.discard();
}

impl Outlet for EngineOutlet {
    fn deliver(&mut self, item: Outbound) -> bool {
        match item {
            Outbound::Outputs { client, outputs } => self.send_outputs(client, outputs),
            Outbound::Dead => {
                self.queue_dead();
                true
            }
            job @ (Outbound::Pull(_) | Outbound::Compile(_)) => self.jobs.send(job).is_ok(),
        }
    }

    fn hold(&mut self, on: bool) {
        for (i, c) in self.clients.iter_mut().enumerate() {
            if c.failed == 0
                && let Err(e) = c.writer.hold(on)
            {
                gone(c, i as u32, &e);
            }
        }
    }

    fn backlogged(&self) -> bool {
        self.clients
            .iter()
            .any(|c| c.failed == 0 && c.writer.backlogged())
    }

    fn over_bound(&self) -> bool {
        self.clients
            .iter()
            .any(|c| c.failed == 0 && c.writer.over_bound())
    }

    async fn drain(&mut self) {
        // the first client with a backlog (rarely more than one: each is a frontend API
        // server reading its own socket)
        let Some((i, c)) = self
            .clients
            .iter_mut()
            .enumerate()
            .find(|(_, c)| c.failed == 0 && c.writer.backlogged())
        else {
            return;
        };
        if let Err(e) = c.writer.flush().await {
            gone(c, i as u32, &e);
        }
    }
}

/// Abort the unfinished requests of an envelope meant for a client that is gone, through
/// the engine's own input path (as the frontend's abort would come). Every request of the
/// client is in such an envelope at its next step with output: running ones at once,
/// waiting ones when they are scheduled (they produce their first token, then stop).
fn abort_for_gone_client(
    side: &mpsc::UnboundedSender<EngineInput>,
    client: u32,
    env: &EngineCoreOutputs,
) {
    let ids: Vec<String> = env
        .outputs
        .iter()
        .filter(|o| o.finish_reason.is_none())
        .map(|o| o.request_id.to_string())
        .collect();
    if ids.is_empty() {
        return;
    }
    tracing::info!(
        client,
        aborted = ids.len(),
        "aborting the requests of a client that is gone"
    );
    let _ = side.send(EngineInput::Message {
        client,
        msg: sim_protocol::InputMessage::Abort(ids),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::{EngineCoreOutput, FinishReason, InputMessage};
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    fn out(id: &str, finish: Option<FinishReason>) -> EngineCoreOutput {
        EngineCoreOutput {
            request_id: id.into(),
            new_token_ids: vec![7].into(),
            finish_reason: finish,
            ..Default::default()
        }
    }

    fn envelope(outputs: Vec<EngineCoreOutput>) -> Outbound {
        Outbound::Outputs {
            client: 0,
            outputs: EngineCoreOutputs {
                timestamp: 1.0,
                outputs,
                ..Default::default()
            },
        }
    }

    fn outlet(stream: UnixStream) -> (EngineOutlet, mpsc::UnboundedReceiver<EngineInput>) {
        stream.set_nonblocking(true).unwrap();
        let (jobs, _) = mpsc::unbounded_channel();
        let (side, side_rx) = mpsc::unbounded_channel();
        let o = EngineOutlet::new(
            VllmLine::new(0, 33),
            vec![ZmtpStream::Unix(stream)],
            jobs,
            side,
        )
        .unwrap();
        (o, side_rx)
    }

    /// A client whose output socket fails is gone: the unfinished requests of that
    /// envelope, and of every later one for it, come back to the engine as the frontend's
    /// abort would, and nothing more is sent to it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_client_whose_send_fails_has_its_requests_aborted() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        let (mut o, mut side_rx) = outlet(ours);
        assert!(o.deliver(envelope(vec![
            out("a", None),
            out("b", Some(FinishReason::Length)),
        ])));
        assert!(o.deliver(envelope(vec![out("c", None)])));
        assert!(!o.backlogged());
        let mut aborted = Vec::new();
        while let Ok(input) = side_rx.try_recv() {
            match input {
                EngineInput::Message {
                    client: 0,
                    msg: InputMessage::Abort(ids),
                } => aborted.push(ids),
                other => panic!("unexpected {other:?}"),
            }
        }
        // the finished request is not aborted; the later one is
        assert_eq!(aborted, vec![vec!["a".to_string()], vec!["c".to_string()]]);
    }

    /// A fatal error reaches the frontend as the raw ENGINE_CORE_DEAD frame, after the
    /// outputs queued before it.
    #[tokio::test(flavor = "current_thread")]
    async fn dead_sentinel_follows_queued_outputs() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let (mut o, _side_rx) = outlet(ours);
        assert!(o.deliver(Outbound::Outputs {
            client: 0,
            outputs: EngineCoreOutputs {
                timestamp: 1.0,
                finished_requests: Some(vec!["x".into()]),
                ..Default::default()
            },
        }));
        o.send_dead().await;
        drop(o);
        let mut wire = Vec::new();
        theirs.read_to_end(&mut wire).unwrap();
        // two messages of one frame each: the envelope, then the sentinel
        let first = sim_protocol::zmtp::frame_header(&wire).unwrap().unwrap();
        assert!(!first.more());
        let rest = &wire[first.total() as usize..];
        let second = sim_protocol::zmtp::frame_header(rest).unwrap().unwrap();
        assert_eq!(&rest[second.header_len..], ENGINE_CORE_DEAD);
        let envelope = &wire[first.header_len..first.total() as usize];
        let decoded =
            sim_protocol::decode_outputs(&[bytes::Bytes::copy_from_slice(envelope)]).unwrap();
        let sim_protocol::DecodedOutputs::Outputs(env) = decoded else {
            panic!("the envelope before the sentinel decoded as {decoded:?}");
        };
        assert_eq!(env.finished_requests, Some(vec!["x".to_string()]));
    }
}
