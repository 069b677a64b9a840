//! Utility calls (`EngineCoreRequestType.UTILITY`): the engine methods a frontend invokes by
//! name, answered with the types and semantics of vLLM's `EngineCore`.
//!
//! [`UtilityState`] owns what only utility calls change (pause and sleep state, the LoRA
//! registry, the weight version). [`UtilityState::dispatch`] parses a call, updates that
//! state and returns a [`UtilityEffect`]: what the engine must do to its requests (abort
//! them, reset the prefix cache, resume) and what to answer. It never touches the batch.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rmpv::Value;
use sim_protocol::{CallId, VllmLine};

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
pub enum PauseMode {
    Abort,
    Wait,
    Keep,
}

/// What the engine sees of itself when a utility call is made.
#[derive(Debug, Clone, Copy)]
pub struct EngineView {
    pub line: VllmLine,
    pub block_size: u64,
    pub num_gpu_blocks: u64,
    /// Requests in the running batch.
    pub running: usize,
    /// Requests in the engine (waiting and running).
    pub requests: usize,
    /// What `get_supported_tasks` answers (`--runner`).
    pub tasks: &'static [&'static str],
}

/// What a utility call asks of the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum UtilityEffect {
    /// Answer with this value; nothing else to do.
    Reply(Value),
    /// Reset the prefix cache, preempting the running requests first when asked; answer
    /// whether the cache was reset.
    ResetPrefixCache { preempt_running: bool },
    /// Abort every request (a pause in abort mode), then answer `None`.
    AbortAllThenReply,
    /// Scheduling resumes: push the step in flight back by `shift` (the time it was
    /// paused), release the requests held by the pause, answer the callers of a draining
    /// pause, then answer this call with `reply`.
    Resume {
        shift: Duration,
        drained: Vec<(u32, CallId)>,
        reply: Value,
    },
    /// The answer goes out later (a pause in wait mode answers once the batch drained).
    Deferred,
}

type CallResult = Result<UtilityEffect, String>;

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

impl UtilityState {
    /// Parse and apply one call. `Err` is the failure message vLLM would send.
    pub fn dispatch(
        &mut self,
        method: &str,
        args: &[Value],
        view: &EngineView,
        client: u32,
        call_id: CallId,
        now: Instant,
    ) -> CallResult {
        let ok = |v: Value| Ok(UtilityEffect::Reply(v));
        match method {
            "get_supported_tasks" => {
                max_args(method, args, 0)?;
                ok(Value::Array(
                    view.tasks.iter().map(|t| Value::from(*t)).collect(),
                ))
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
                if view.running > 0 && !reset_running {
                    tracing::warn!(
                        running = view.running,
                        "reset_prefix_cache refused: requests are running (pass reset_running_requests=True)"
                    );
                    return ok(Value::Boolean(false));
                }
                Ok(UtilityEffect::ResetPrefixCache {
                    preempt_running: view.running > 0,
                })
            }
            "is_sleeping" => {
                max_args(method, args, 0)?;
                ok(Value::Boolean(self.sleep_level.is_some()))
            }
            "sleep" => {
                max_args(method, args, 2)?;
                let level = arg_int(args, 0, "level")?.unwrap_or(1);
                if !(0..=2).contains(&level) {
                    return Err(format!("sleep level must be 0, 1 or 2, got {level}"));
                }
                let mode = pause_mode(args, 1)?;
                Ok(self.pause(
                    PauseKind::Scheduler,
                    mode,
                    Some(level),
                    view,
                    client,
                    call_id,
                    now,
                ))
            }
            "wake_up" => {
                max_args(method, args, 1)?;
                match arg(args, 0) {
                    None | Some(Value::Array(_)) => {}
                    Some(v) => return Err(format!("tags must be a list of str or None, got {v}")),
                }
                self.sleep_level = None;
                let reply = if view.line.wake_up_returns_bool() {
                    Value::Boolean(true)
                } else {
                    Value::Nil
                };
                Ok(self.resume(now, reply))
            }
            "pause_scheduler" | "pause_generation" => {
                max_args(method, args, 2)?;
                if method == "pause_generation" && !view.line.has_pause_generation() {
                    return Err(format!(
                        "pause_generation does not exist on vLLM {}",
                        view.line
                    ));
                }
                let mode = pause_mode(args, 0)?;
                arg_bool(args, 1, true, "clear_cache")?;
                let kind = if method == "pause_generation" {
                    PauseKind::Generation
                } else {
                    PauseKind::Scheduler
                };
                Ok(self.pause(kind, mode, None, view, client, call_id, now))
            }
            "resume_scheduler" | "resume_generation" => {
                max_args(method, args, 0)?;
                Ok(self.resume(now, Value::Nil))
            }
            "is_scheduler_paused" => {
                max_args(method, args, 0)?;
                ok(Value::Boolean(!matches!(self.pause, PauseState::Running)))
            }
            "add_lora" => {
                max_args(method, args, 1)?;
                let (name, id, path) = lora_arg(args)?;
                self.register_lora(id, &name, &path);
                tracing::info!(lora = %name, id, path = %path, "LoRA adapter added");
                ok(Value::Boolean(true))
            }
            "remove_lora" => {
                max_args(method, args, 1)?;
                let id = arg_int(args, 0, "lora_id")?.ok_or("remove_lora() needs lora_id")?;
                ok(Value::Boolean(self.loras.remove(&id).is_some()))
            }
            "list_loras" => {
                max_args(method, args, 0)?;
                ok(Value::Array(
                    self.loras.keys().map(|k| Value::from(*k)).collect(),
                ))
            }
            "pin_lora" => {
                max_args(method, args, 1)?;
                let id = arg_int(args, 0, "lora_id")?.ok_or("pin_lora() needs lora_id")?;
                match self.loras.get_mut(&id) {
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
                self.profiling = start;
                tracing::info!(start, "profile (nothing to profile in the simulator)");
                ok(Value::Nil)
            }
            "set_weight_version" => {
                max_args(method, args, 1)?;
                match arg(args, 0) {
                    Some(v) => {
                        let s = v.as_str().ok_or("weight version must be a str")?;
                        self.weight_version = Some(s.to_string());
                    }
                    None => self.weight_version = None,
                }
                ok(Value::Nil)
            }
            "get_weight_version" => {
                max_args(method, args, 0)?;
                ok(self
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
                    (Value::from("block_size"), Value::from(view.block_size)),
                    (Value::from("num_blocks"), Value::from(view.num_gpu_blocks)),
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
        view: &EngineView,
        client: u32,
        call_id: CallId,
        now: Instant,
    ) -> UtilityEffect {
        if let PauseState::Paused { since, .. } = self.pause {
            // already paused: upgrade the kind, stay paused
            self.pause = PauseState::Paused { kind, since };
            if let Some(l) = sleep_level {
                self.sleep_level = Some(l);
            }
            return UtilityEffect::Reply(Value::Nil);
        }
        match mode {
            PauseMode::Abort | PauseMode::Keep => {
                self.pause = PauseState::Paused { kind, since: now };
                if sleep_level.is_some() {
                    self.sleep_level = sleep_level;
                }
                if mode == PauseMode::Abort && view.requests > 0 {
                    tracing::info!(
                        aborted = view.requests,
                        "pause: aborting in-flight requests"
                    );
                    UtilityEffect::AbortAllThenReply
                } else {
                    UtilityEffect::Reply(Value::Nil)
                }
            }
            PauseMode::Wait => {
                let mut replies = match std::mem::take(&mut self.pause) {
                    PauseState::Draining { replies, .. } => replies,
                    _ => Vec::new(),
                };
                replies.push((client, call_id));
                self.pause = PauseState::Draining {
                    kind,
                    sleep_level,
                    replies,
                };
                UtilityEffect::Deferred
            }
        }
    }

    fn resume(&mut self, now: Instant, reply: Value) -> UtilityEffect {
        let (shift, drained) = match std::mem::take(&mut self.pause) {
            PauseState::Running => (Duration::ZERO, Vec::new()),
            PauseState::Paused { since, .. } => (now.saturating_duration_since(since), Vec::new()),
            PauseState::Draining { replies, .. } => (Duration::ZERO, replies),
        };
        UtilityEffect::Resume {
            shift,
            drained,
            reply,
        }
    }

    /// A draining pause completes once no unheld request is left: the engine is paused
    /// from `now`, and these callers get their answer.
    pub fn complete_drain(&mut self, outstanding: usize, now: Instant) -> Vec<(u32, CallId)> {
        if outstanding > 0 || !matches!(self.pause, PauseState::Draining { .. }) {
            return Vec::new();
        }
        let PauseState::Draining {
            kind,
            sleep_level,
            replies,
        } = std::mem::take(&mut self.pause)
        else {
            return Vec::new();
        };
        self.pause = PauseState::Paused { kind, since: now };
        if sleep_level.is_some() {
            self.sleep_level = sleep_level;
        }
        replies
    }
}
