//! The router `serve --route` puts in front of a data-parallel frontend: it picks the
//! engine (data-parallel rank) of each generation request and tells the frontend with the
//! `X-data-parallel-rank` header, which vLLM's frontends (vllm-rs and the Python one) honor
//! in place of their own balancing, as an external router in front of a DP deployment
//! does. The policies are those `inspect simulate --engines N --route` models on the
//! virtual clock, as far as a router that sees only requests can apply them:
//!
//! * `round-robin`: each engine in turn;
//! * `least-loaded`: the fewest requests in flight through the router, ties to the lowest
//!   rank;
//! * `prefix-aware`: the engine that was sent the most leading blocks of this prompt's
//!   text before (blocks of [`BLOCK_CHARS`] characters, chained, as llm-d's approximate
//!   prefix scorer hashes a prompt's characters rather than its tokens), ties to the
//!   fewest in flight, then the lowest rank. Each engine's remembered blocks are bounded
//!   ([`BLOCKS_PER_ENGINE`]; the oldest stored are forgotten first).
//!
//! Other paths (`/health`, `/metrics`, `/v1/models`, …) go to the frontend unchanged.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use clap::ValueEnum;
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::http_proxy::{Limits, encode_request, read_request, refuse, relay, serve_connections};

/// Characters per prefix block of a prompt's text (about 16 tokens of English).
pub const BLOCK_CHARS: usize = 64;
/// Blocks remembered per engine (4 Mi characters of prompt text).
pub const BLOCKS_PER_ENGINE: usize = 1 << 16;

/// How the router picks an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LiveRoute {
    /// Each engine in turn.
    RoundRobin,
    /// The engine with the fewest requests in flight through the router.
    LeastLoaded,
    /// The engine that was sent the most leading blocks of the prompt's text.
    PrefixAware,
}

/// What the router knows of each engine.
struct Engine {
    in_flight: usize,
    /// Block hashes sent to it, and the order they were first stored (to forget the oldest).
    blocks: HashMap<u64, ()>,
    order: VecDeque<u64>,
}

/// The routing decisions, shared by the connections.
pub struct Router {
    route: LiveRoute,
    next: usize,
    engines: Vec<Engine>,
}

impl Router {
    pub fn new(route: LiveRoute, engines: usize) -> Router {
        Router {
            route,
            next: 0,
            engines: (0..engines.max(1))
                .map(|_| Engine {
                    in_flight: 0,
                    blocks: HashMap::new(),
                    order: VecDeque::new(),
                })
                .collect(),
        }
    }

    /// The engine for a request whose prompt text is `prompt`; it counts as in flight
    /// there until [`Router::done`].
    pub fn pick(&mut self, prompt: &str) -> usize {
        let blocks = prefix_blocks(prompt);
        let n = self.engines.len();
        let rank = match self.route {
            LiveRoute::RoundRobin => {
                let r = self.next % n;
                self.next = (r + 1) % n;
                r
            }
            LiveRoute::LeastLoaded => self.least_loaded(0..n),
            LiveRoute::PrefixAware => {
                let held: Vec<usize> = self
                    .engines
                    .iter()
                    .map(|e| {
                        blocks
                            .iter()
                            .take_while(|b| e.blocks.contains_key(b))
                            .count()
                    })
                    .collect();
                let most = held.iter().copied().max().unwrap_or(0);
                self.least_loaded((0..n).filter(|&r| held[r] == most))
            }
        };
        let e = &mut self.engines[rank];
        e.in_flight += 1;
        for b in blocks {
            if e.blocks.insert(b, ()).is_none() {
                e.order.push_back(b);
            }
        }
        while e.order.len() > BLOCKS_PER_ENGINE {
            if let Some(old) = e.order.pop_front() {
                e.blocks.remove(&old);
            }
        }
        rank
    }

    /// The request sent to `rank` has ended.
    pub fn done(&mut self, rank: usize) {
        if let Some(e) = self.engines.get_mut(rank) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
    }

    /// Among `ranks`, the fewest in flight, ties to the lowest rank.
    fn least_loaded(&self, ranks: impl Iterator<Item = usize>) -> usize {
        ranks
            .min_by_key(|&r| (self.engines[r].in_flight, r))
            .unwrap_or(0)
    }
}

/// The chained hashes of the whole [`BLOCK_CHARS`]-character blocks of `text` (a partial
/// last block is not a block, as a partial KV block is not cached).
fn prefix_blocks(text: &str) -> Vec<u64> {
    let chars: Vec<char> = text.chars().collect();
    let mut parent = 0u64;
    chars
        .chunks_exact(BLOCK_CHARS)
        .map(|block| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// The text a request's prompt starts with, as far as routing is concerned: the tools a
/// chat template renders first, then each message's role and text (chat), or the prompt
/// (completions: a string, the first of a batch, or token ids written out).
fn prompt_text(body: &Value) -> String {
    let mut out = String::new();
    if let Some(tools) = body.get("tools") {
        out.push_str(&tools.to_string());
    }
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                out.push_str(role);
                out.push('\n');
            }
            match m.get("content") {
                Some(Value::String(s)) => out.push_str(s),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            out.push_str(t);
                        }
                    }
                }
                _ => {}
            }
            out.push('\n');
        }
    }
    match body.get("prompt") {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Number(_)) => {
                for id in items {
                    out.push_str(&id.to_string());
                    out.push(' ');
                }
            }
            Some(Value::Array(ids)) => {
                for id in ids {
                    out.push_str(&id.to_string());
                    out.push(' ');
                }
            }
            _ => {}
        },
        _ => {}
    }
    out
}

/// Serve the router on `listener` until `shutdown`, sending every request on to the
/// frontend at `frontend` (`host:port`).
pub(crate) async fn run(
    listener: TcpListener,
    frontend: String,
    router: Router,
    limits: Limits,
    timeout: Duration,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let router = Arc::new(Mutex::new(router));
    serve_connections(limits.who, listener, shutdown, |conn, peer| {
        let (router, frontend) = (router.clone(), frontend.clone());
        async move { handle(conn, peer, &frontend, &router, limits, timeout).await }
    })
    .await
}

async fn handle(
    mut conn: TcpStream,
    peer: SocketAddr,
    frontend: &str,
    router: &Mutex<Router>,
    limits: Limits,
    timeout: Duration,
) -> Result<()> {
    let mut req = match read_request(&mut conn, limits).await? {
        Ok(req) => req,
        Err(refusal) => return refuse(limits.who, conn, peer, refusal).await,
    };
    // a body that is not JSON goes on as it is: the frontend answers it
    let routed = req.method == "POST"
        && req.path.starts_with("/v1/")
        && !req.headers.iter().any(|(k, _)| k == "x-data-parallel-rank");
    let body = routed
        .then(|| serde_json::from_slice::<Value>(&req.body).ok())
        .flatten();
    let Some(body) = body else {
        let up = encode_request(&req, frontend, &req.body);
        return relay(limits.who, &mut conn, frontend, &up, timeout).await;
    };
    let rank = lock(router).pick(&prompt_text(&body));
    tracing::debug!(%peer, rank, path = %req.path, "router: routed");
    req.headers
        .push(("x-data-parallel-rank".to_string(), rank.to_string()));
    let up = encode_request(&req, frontend, &req.body);
    let result = relay(limits.who, &mut conn, frontend, &up, timeout).await;
    lock(router).done(rank);
    result
}

/// The router's state, whatever a panicking connection left it in (counts only).
fn lock(router: &Mutex<Router>) -> std::sync::MutexGuard<'_, Router> {
    router.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn text(c: char, blocks: usize) -> String {
        std::iter::repeat_n(c, blocks * BLOCK_CHARS).collect()
    }

    #[test]
    fn round_robin_takes_each_engine_in_turn() {
        let mut r = Router::new(LiveRoute::RoundRobin, 3);
        let picks: Vec<usize> = (0..7).map(|_| r.pick("x")).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn least_loaded_follows_the_requests_in_flight() {
        let mut r = Router::new(LiveRoute::LeastLoaded, 2);
        assert_eq!(r.pick("a"), 0);
        assert_eq!(r.pick("b"), 1);
        assert_eq!(r.pick("c"), 0);
        r.done(1);
        assert_eq!(r.pick("d"), 1);
    }

    #[test]
    fn prefix_aware_sends_a_shared_prefix_where_it_went_before() {
        let mut r = Router::new(LiveRoute::PrefixAware, 2);
        let a = format!("{}{}", text('a', 4), "question one");
        let b = format!("{}{}", text('b', 4), "question two");
        // a is in flight on 0, so b (no engine holds it) goes to the less loaded 1
        assert_eq!(r.pick(&a), 0);
        assert_eq!(r.pick(&b), 1);
        r.done(0);
        r.done(1);
        // then each prefix follows its engine, even when that engine is the busier one
        for _ in 0..3 {
            assert_eq!(r.pick(&format!("{}{}", text('b', 4), "another")), 1);
            assert_eq!(r.pick(&format!("{}{}", text('a', 4), "another")), 0);
        }
    }

    #[test]
    fn blocks_chain_so_a_shared_block_after_a_different_one_is_no_match() {
        let x = prefix_blocks(&format!("{}{}", text('a', 1), text('c', 1)));
        let y = prefix_blocks(&format!("{}{}", text('b', 1), text('c', 1)));
        assert_eq!(x.len(), 2);
        assert_ne!(x[1], y[1]);
        assert_eq!(prefix_blocks(&text('a', 1))[0], x[0]);
        // a partial block is not a block
        assert_eq!(prefix_blocks("short").len(), 0);
    }

    #[test]
    fn an_engine_forgets_its_oldest_blocks_past_the_bound() {
        let mut r = Router::new(LiveRoute::PrefixAware, 1);
        let long: String = (0..BLOCKS_PER_ENGINE + 10)
            .flat_map(|i| format!("{i:0>64}").chars().collect::<Vec<_>>())
            .collect();
        r.pick(&long);
        assert_eq!(r.engines[0].blocks.len(), BLOCKS_PER_ENGINE);
        assert_eq!(r.engines[0].order.len(), BLOCKS_PER_ENGINE);
    }

    #[test]
    fn the_prompt_text_covers_chat_completions_and_token_ids() {
        let chat = json!({"tools": [{"type": "function"}], "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        let t = prompt_text(&chat);
        assert!(
            t.starts_with("[{\"type\":\"function\"}]system\nbe brief"),
            "{t}"
        );
        assert!(t.ends_with("user\nhi\n"), "{t}");
        assert_eq!(prompt_text(&json!({"prompt": "abc"})), "abc");
        assert_eq!(prompt_text(&json!({"prompt": ["abc", "d"]})), "abc");
        assert_eq!(prompt_text(&json!({"prompt": [1, 2]})), "1 2 ");
        assert_eq!(prompt_text(&json!({"prompt": [[3]]})), "3 ");
    }
}
