//! Utility calls (`EngineCoreRequestType.UTILITY`): the engine methods a frontend invokes by
//! name, answered with the types and semantics of vLLM's `EngineCore` (protocol.md §4.6).

use std::collections::BTreeMap;
use std::time::Instant;

use rmpv::Value;
use sim_protocol::{CallId, EngineCoreOutputs, UtilityCall, UtilityOutput};

use super::engine_core::Outbox;
use super::sim::SimEngine;
use super::timer::now_monotonic;

/// Which pause API paused the engine: `pause_generation` (0.33) also rejects new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseKind {
    Scheduler,
    Generation,
}

#[derive(Debug, Default)]
pub enum PauseState {
    #[default]
    Running,
    /// `mode="wait"` (or sleep in wait mode): requests present at the call finish, new ones
    /// are held; the replies go out when the last one is done.
    Draining {
        kind: PauseKind,
        sleep_level: Option<i64>,
        replies: Vec<(u32, CallId)>,
    },
    /// Nothing is scheduled; running requests are frozen in place.
    Paused { kind: PauseKind, since: Instant },
}

#[derive(Debug, Clone)]
pub struct LoraEntry {
    pub name: String,
    pub path: String,
    pub pinned: bool,
}

/// Engine state that only utility calls change.
#[derive(Debug, Default)]
pub struct UtilityState {
    pub pause: PauseState,
    pub sleep_level: Option<i64>,
    pub loras: BTreeMap<i64, LoraEntry>,
    pub weight_version: Option<String>,
    pub profiling: bool,
}

impl UtilityState {
    pub fn scheduling_enabled(&self) -> bool {
        !matches!(self.pause, PauseState::Paused { .. })
    }

    pub fn holds_new_requests(&self) -> bool {
        !matches!(self.pause, PauseState::Running)
    }

    pub fn rejects_new_requests(&self) -> bool {
        matches!(
            self.pause,
            PauseState::Draining {
                kind: PauseKind::Generation,
                ..
            } | PauseState::Paused {
                kind: PauseKind::Generation,
                ..
            }
        )
    }

    pub fn register_lora(&mut self, id: i64, name: &str, path: &str) {
        self.loras.entry(id).or_insert_with(|| LoraEntry {
            name: name.to_string(),
            path: path.to_string(),
            pinned: false,
        });
    }
}

/// How a pause treats in-flight requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PauseMode {
    Abort,
    Wait,
    Keep,
}

type CallResult = Result<Option<Value>, String>;

fn arg(args: &[Value], i: usize) -> Option<&Value> {
    args.get(i).filter(|v| !v.is_nil())
}

fn arg_bool(args: &[Value], i: usize, default: bool, name: &str) -> Result<bool, String> {
    match arg(args, i) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| format!("argument `{name}` must be a bool, got {v}")),
    }
}

fn arg_int(args: &[Value], i: usize, name: &str) -> Result<Option<i64>, String> {
    match arg(args, i) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| format!("argument `{name}` must be an integer, got {v}")),
    }
}

fn max_args(method: &str, args: &[Value], n: usize) -> Result<(), String> {
    if args.len() > n {
        Err(format!(
            "{method}() takes at most {n} argument(s) but {} were given",
            args.len()
        ))
    } else {
        Ok(())
    }
}

/// `mode` as vLLM takes it: a string (`abort`, `wait`, `keep`); older callers passed a
/// `wait_for_inflight_requests` bool instead.
fn pause_mode(args: &[Value], i: usize) -> Result<PauseMode, String> {
    match arg(args, i) {
        None => Ok(PauseMode::Abort),
        Some(Value::Boolean(true)) => Ok(PauseMode::Wait),
        Some(Value::Boolean(false)) => Ok(PauseMode::Abort),
        Some(v) => match v.as_str() {
            Some("abort") => Ok(PauseMode::Abort),
            Some("wait") => Ok(PauseMode::Wait),
            Some("keep") => Ok(PauseMode::Keep),
            _ => Err(format!(
                "unknown pause mode {v}: expected \"abort\", \"wait\" or \"keep\""
            )),
        },
    }
}

/// `LoRARequest` positions 0–2 (name, id, path); the rest differs per line.
fn lora_arg(args: &[Value]) -> Result<(String, i64, String), String> {
    let Some(Value::Array(a)) = arg(args, 0) else {
        return Err("add_lora() expects a LoRARequest array".into());
    };
    let name = a.first().and_then(|v| v.as_str()).map(str::to_string);
    let id = a.get(1).and_then(|v| v.as_i64());
    let path = a
        .get(2)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    match (name, id) {
        (Some(n), Some(i)) if i > 0 => Ok((n, i, path)),
        _ => Err("LoRARequest needs a name and a positive lora_int_id".into()),
    }
}

impl SimEngine {
    /// Send a utility reply on its own (never mixed with request outputs).
    pub(super) fn reply(
        &self,
        out: &mut Outbox,
        client: u32,
        call_id: CallId,
        outcome: Result<Value, String>,
    ) {
        out.send(
            client,
            EngineCoreOutputs {
                engine_index: self.cfg.engine_index,
                timestamp: now_monotonic(),
                utility_output: Some(UtilityOutput { call_id, outcome }),
                ..Default::default()
            },
        );
    }

    pub(super) fn handle_utility(&mut self, call: UtilityCall, now: Instant, out: &mut Outbox) {
        let UtilityCall {
            client_index,
            call_id,
            method,
            args,
        } = call;
        tracing::debug!(method, ?args, client_index, "utility call");
        let result = self.dispatch(&method, &args, client_index, call_id, now, out);
        match result {
            // deferred: the reply goes out when the operation completes
            Ok(None) => {}
            Ok(Some(v)) => self.reply(out, client_index, call_id, Ok(v)),
            Err(e) => {
                tracing::warn!(method, "utility call failed: {e}");
                self.reply(
                    out,
                    client_index,
                    call_id,
                    Err(format!("Call to {method} method failed: {e}")),
                );
            }
        }
    }

    fn dispatch(
        &mut self,
        method: &str,
        args: &[Value],
        client: u32,
        call_id: CallId,
        now: Instant,
        out: &mut Outbox,
    ) -> CallResult {
        let ok = |v: Value| Ok(Some(v));
        match method {
            "get_supported_tasks" => {
                max_args(method, args, 0)?;
                ok(Value::Array(vec![Value::from("generate")]))
            }
            "reset_mm_cache"
            | "reset_encoder_cache"
            | "execute_dummy_batch"
            | "release_kv_cache_memory" => {
                max_args(method, args, 0)?;
                ok(Value::Nil)
            }
            "reset_prefix_cache" => {
                max_args(method, args, 2)?;
                let reset_running = arg_bool(args, 0, false, "reset_running_requests")?;
                arg_bool(args, 1, false, "reset_connector")?;
                if !self.running.is_empty() && !reset_running {
                    tracing::warn!(
                        running = self.running.len(),
                        "reset_prefix_cache refused: requests are running (pass reset_running_requests=True)"
                    );
                    return ok(Value::Boolean(false));
                }
                if !self.running.is_empty() {
                    self.preempt_all_running(now);
                }
                // vLLM's `reset_prefix_cache`: every cached hash goes (AllBlocksCleared);
                // the frontend sees `prefix_cache_stats.reset`
                let done = self.pool.reset();
                if done {
                    self.prefix_delta.reset = true;
                    self.stats_dirty = true;
                }
                self.admit(now);
                ok(Value::Boolean(done))
            }
            "is_sleeping" => {
                max_args(method, args, 0)?;
                ok(Value::Boolean(self.util.sleep_level.is_some()))
            }
            "sleep" => {
                max_args(method, args, 2)?;
                let level = arg_int(args, 0, "level")?.unwrap_or(1);
                if !(0..=2).contains(&level) {
                    return Err(format!("sleep level must be 0, 1 or 2, got {level}"));
                }
                let mode = pause_mode(args, 1)?;
                self.pause(
                    PauseKind::Scheduler,
                    mode,
                    Some(level),
                    client,
                    call_id,
                    now,
                    out,
                )
            }
            "wake_up" => {
                max_args(method, args, 1)?;
                match arg(args, 0) {
                    None | Some(Value::Array(_)) => {}
                    Some(v) => return Err(format!("tags must be a list of str or None, got {v}")),
                }
                self.util.sleep_level = None;
                self.resume(now, out);
                if self.cfg.line.wake_up_returns_bool() {
                    ok(Value::Boolean(true))
                } else {
                    ok(Value::Nil)
                }
            }
            "pause_scheduler" | "pause_generation" => {
                max_args(method, args, 2)?;
                if method == "pause_generation" && !self.cfg.line.has_pause_generation() {
                    return Err(format!(
                        "pause_generation does not exist on vLLM {}",
                        self.cfg.line
                    ));
                }
                let mode = pause_mode(args, 0)?;
                arg_bool(args, 1, true, "clear_cache")?;
                let kind = if method == "pause_generation" {
                    PauseKind::Generation
                } else {
                    PauseKind::Scheduler
                };
                self.pause(kind, mode, None, client, call_id, now, out)
            }
            "resume_scheduler" | "resume_generation" => {
                max_args(method, args, 0)?;
                self.resume(now, out);
                ok(Value::Nil)
            }
            "is_scheduler_paused" => {
                max_args(method, args, 0)?;
                ok(Value::Boolean(!matches!(
                    self.util.pause,
                    PauseState::Running
                )))
            }
            "add_lora" => {
                max_args(method, args, 1)?;
                let (name, id, path) = lora_arg(args)?;
                self.util.register_lora(id, &name, &path);
                tracing::info!(lora = %name, id, path = %path, "LoRA adapter added");
                ok(Value::Boolean(true))
            }
            "remove_lora" => {
                max_args(method, args, 1)?;
                let id = arg_int(args, 0, "lora_id")?.ok_or("remove_lora() needs lora_id")?;
                ok(Value::Boolean(self.util.loras.remove(&id).is_some()))
            }
            "list_loras" => {
                max_args(method, args, 0)?;
                ok(Value::Array(
                    self.util.loras.keys().map(|k| Value::from(*k)).collect(),
                ))
            }
            "pin_lora" => {
                max_args(method, args, 1)?;
                let id = arg_int(args, 0, "lora_id")?.ok_or("pin_lora() needs lora_id")?;
                match self.util.loras.get_mut(&id) {
                    Some(e) => {
                        e.pinned = true;
                        ok(Value::Boolean(true))
                    }
                    None => Err(format!("LoRA {id} is not registered")),
                }
            }
            "profile" => {
                max_args(method, args, 5)?;
                let start = arg_bool(args, 0, true, "is_start")?;
                self.util.profiling = start;
                tracing::info!(start, "profile (nothing to profile in the simulator)");
                ok(Value::Nil)
            }
            "set_weight_version" => {
                max_args(method, args, 1)?;
                match arg(args, 0) {
                    Some(v) => {
                        let s = v.as_str().ok_or("weight version must be a str")?;
                        self.util.weight_version = Some(s.to_string());
                    }
                    None => self.util.weight_version = None,
                }
                ok(Value::Nil)
            }
            "get_weight_version" => {
                max_args(method, args, 0)?;
                ok(self
                    .util
                    .weight_version
                    .clone()
                    .map(Value::from)
                    .unwrap_or(Value::Nil))
            }
            "compute_weight_checksums" => {
                max_args(method, args, 0)?;
                // one (empty) map per worker: the simulator has no weights
                ok(Value::Array(vec![Value::Map(vec![])]))
            }
            "get_kv_cache_group_metadata" => {
                max_args(method, args, 0)?;
                ok(Value::Array(vec![Value::Map(vec![
                    (Value::from("block_size"), Value::from(self.cfg.block_size)),
                    (
                        Value::from("num_blocks"),
                        Value::from(self.cfg.num_gpu_blocks),
                    ),
                ])]))
            }
            "save_sharded_state" => Err("the simulator has no weights to save".into()),
            "collective_rpc" => Err(
                "collective_rpc is not supported: the simulator has no workers to run it on".into(),
            ),
            _ => Err(format!(
                "unknown method `{method}` (the simulator implements vLLM's EngineCore utility methods)"
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn pause(
        &mut self,
        kind: PauseKind,
        mode: PauseMode,
        sleep_level: Option<i64>,
        client: u32,
        call_id: CallId,
        now: Instant,
        out: &mut Outbox,
    ) -> CallResult {
        if let PauseState::Paused { since, .. } = self.util.pause {
            // already paused: upgrade the kind, stay paused
            self.util.pause = PauseState::Paused { kind, since };
            if let Some(l) = sleep_level {
                self.util.sleep_level = Some(l);
            }
            return Ok(Some(Value::Nil));
        }
        match mode {
            PauseMode::Abort => {
                if self.num_requests() > 0 {
                    tracing::info!(
                        aborted = self.num_requests(),
                        "pause: aborting in-flight requests"
                    );
                    self.abort_everything(out);
                }
                self.util.pause = PauseState::Paused { kind, since: now };
                if sleep_level.is_some() {
                    self.util.sleep_level = sleep_level;
                }
                Ok(Some(Value::Nil))
            }
            PauseMode::Keep => {
                self.util.pause = PauseState::Paused { kind, since: now };
                if sleep_level.is_some() {
                    self.util.sleep_level = sleep_level;
                }
                Ok(Some(Value::Nil))
            }
            PauseMode::Wait => {
                let mut replies = match std::mem::take(&mut self.util.pause) {
                    PauseState::Draining { replies, .. } => replies,
                    _ => Vec::new(),
                };
                replies.push((client, call_id));
                self.util.pause = PauseState::Draining {
                    kind,
                    sleep_level,
                    replies,
                };
                self.after_step(out);
                Ok(None)
            }
        }
    }

    fn resume(&mut self, now: Instant, out: &mut Outbox) {
        match std::mem::take(&mut self.util.pause) {
            PauseState::Running => {}
            PauseState::Paused { since, .. } => {
                self.shift_deadlines(now.saturating_duration_since(since));
            }
            PauseState::Draining { replies, .. } => {
                for (client, call_id) in replies {
                    self.reply(out, client, call_id, Ok(Value::Nil));
                }
            }
        }
        self.unhold_all();
        self.admit(now);
    }

    /// Complete a draining pause once the requests it waits for are gone.
    pub(super) fn after_step(&mut self, out: &mut Outbox) {
        let PauseState::Draining { .. } = self.util.pause else {
            return;
        };
        let outstanding = self.requests.values().filter(|r| !r.held).count();
        if outstanding > 0 {
            return;
        }
        if let PauseState::Draining {
            kind,
            sleep_level,
            replies,
        } = std::mem::take(&mut self.util.pause)
        {
            self.util.pause = PauseState::Paused {
                kind,
                since: Instant::now(),
            };
            if sleep_level.is_some() {
                self.util.sleep_level = sleep_level;
            }
            for (client, call_id) in replies {
                self.reply(out, client, call_id, Ok(Value::Nil));
            }
        }
    }
}
