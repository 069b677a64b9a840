//! `vllm-vcr serve`: a real vLLM frontend with `play` behind it, in one command.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use tokio::sync::watch;
use vcr_host::child::{ChildGuard, free_ports};
use vcr_host::frontends;

use crate::play::content::pooling::Runner;
use crate::play::{PlayArgs, TokenMode};

mod flags;
pub mod frontend;
mod logs;
mod model;
mod parsers;
pub mod router;

pub use model::TinyVocabArg;

use flags::{ignored_frontend_flags, line_given_explicitly, pick_line};
pub use frontend::FrontendExited;
use frontend::{
    FrontendSpec, die_with_parent, health_ok, line_of_venv, line_of_vllm_rs, log_tail,
    model_max_len, output_of, python_command, url_host, vllm_rs_command_with,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Frontend {
    /// `vllm-rs`, the Rust OpenAI server inside every vLLM wheel.
    Rs,
    /// The Python API server (`vllm serve`), from a venv given with --python-venv.
    Python,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Which real frontend to start.
    #[arg(long, value_enum, default_value_t = Frontend::Rs)]
    pub frontend: Frontend,

    /// A `vllm-rs` binary to use. Default: `vllm-rs` on $PATH, else the cached one of the
    /// default line, else it is extracted from the PyPI `vllm` wheel (downloaded once into
    /// ~/.cache/vllm-vcr, or $VLLM_VCR_CACHE). The engine speaks the binary's vLLM line,
    /// read from its `--version` (0.29+) or from where it sits (the cache's `<tag>/`
    /// directory, a venv's site-packages); --vllm-version overrides that.
    #[arg(long)]
    pub frontend_bin: Option<PathBuf>,

    /// With --frontend python: the venv that has `vllm` installed (its `bin/vllm` is run
    /// with VLLM_TARGET_DEVICE=cpu).
    #[arg(long)]
    pub python_venv: Option<PathBuf>,

    /// A model directory (config, tokenizer, chat template; no weights needed). Default:
    /// the tiny model embedded in this binary (a 259-token byte-level tokenizer), written
    /// with a context of --max-model-len tokens so that the frontend allows it, and
    /// registered in the Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub) as `vllm-vcr/tiny`, so tools load its tokenizer with
    /// `--tokenizer vllm-vcr/tiny`, offline. The engine emits only token ids its
    /// tokenizer.json has, and caps --max-model-len at a given model's
    /// max_position_embeddings.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// The embedded model's vocabulary (not with --model). `bytes`: byte-level, one token
    /// per byte of UTF-8. `chars`: one token per character, so that any sequence of token
    /// ids decodes to text that encodes back to the same ids (random-id prompt generators:
    /// `vllm bench serve --dataset-name random`, inference-perf's `random`); ASCII keeps its
    /// ids, 127 more characters (Latin-1, typographic, Greek) have one each, and any other
    /// character encodes to `<unk>`. Registered as `vllm-vcr/tiny-chars`.
    #[arg(long, value_enum, default_value_t = TinyVocabArg::Bytes, conflicts_with = "model")]
    pub tiny_vocab: TinyVocabArg,

    /// The public model name. Default: `tiny` for the embedded model (which also answers
    /// to `vllm-vcr/tiny`, its tokenizer's id), else the model directory's name.
    #[arg(long)]
    pub served_model_name: Option<String>,

    /// HTTP address of the OpenAI server.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// HTTP port of the OpenAI server.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// The frontend's engine handshake port (0 picks a free one). `--handshake-address
    /// tcp://127.0.0.1:PORT` means the same.
    #[arg(long, default_value_t = 0)]
    pub handshake_port: u16,

    /// Route requests across the engines of `--engine-count N` yourself instead of
    /// leaving it to the frontend: a router on --port picks each generation request's
    /// engine and sends it to the frontend (on a free port of its own) with the
    /// `X-data-parallel-rank` header, as an external router in front of a data-parallel
    /// deployment does. `round-robin`: each engine in turn; `least-loaded`: the fewest
    /// requests in flight through the router; `prefix-aware`: the engine that was sent
    /// the most leading 64-character blocks of the prompt's text before, ties to the
    /// least loaded (what `inspect simulate --engines N --route` predicts offline). The
    /// frontend's /metrics show each engine's share (`engine="0"`, …).
    #[arg(long, value_enum, value_name = "POLICY")]
    pub route: Option<router::LiveRoute>,

    /// Where the frontend's log goes. Default: `~/.cache/vllm-vcr/logs/frontend-<port>.log`.
    #[arg(long)]
    pub log_file: Option<PathBuf>,

    /// Seconds to wait for the frontend to answer /health (at most a day).
    #[arg(long, default_value_t = 120.0, value_parser = crate::flag_ranges::seconds)]
    pub startup_timeout: f64,

    /// The engine's settings (the handshake address is the frontend's, on --handshake-port).
    #[command(flatten)]
    pub play: PlayArgs,

    /// Arguments after `--` go to the frontend as they are, after the ones `serve` sets
    /// (e.g. `serve -- --enable-auto-tool-choice --tool-call-parser hermes`, or
    /// `--lora-modules`).
    #[arg(last = true, value_name = "FRONTEND_ARGS")]
    pub frontend_args: Vec<String>,
}

/// The handshake port asked for: `--handshake-port`, or the port of a `--handshake-address`
/// (play's flag, also read from `VLLM_VCR_HANDSHAKE_ADDRESS`) on this machine's loopback,
/// where `serve` runs the frontend. 0: pick one.
fn handshake_port(args: &ServeArgs) -> Result<u16> {
    let port = asked_handshake_port(args)?;
    if port != 0 && port == args.port {
        bail!(
            "the handshake port {port} is also --port: the engines' handshake and the HTTP \
             server cannot share a port; give the handshake another (or leave it out to pick one)"
        );
    }
    Ok(port)
}

/// A free port that is none of `taken`: ports this run has chosen, free now but not yet
/// listened on, so a draw of free ports can meet them.
fn free_port_besides(taken: &[u16]) -> Result<u16> {
    free_ports(taken.len() + 1)?
        .into_iter()
        .find(|p| !taken.contains(p))
        .context("no free port")
}

/// The handshake port the flags name (0: none).
fn asked_handshake_port(args: &ServeArgs) -> Result<u16> {
    let address = args.play.handshake_address.trim();
    if address == crate::play::DEFAULT_HANDSHAKE_ADDRESS {
        return Ok(args.handshake_port);
    }
    let port = address
        .strip_prefix("tcp://")
        .and_then(|hp| hp.rsplit_once(':'))
        .filter(|(host, _)| matches!(*host, "127.0.0.1" | "localhost"))
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--handshake-address {address}: serve runs the frontend on this machine, so only \
                 tcp://127.0.0.1:PORT works here (or use --handshake-port PORT)"
            )
        })?;
    if args.handshake_port != 0 && args.handshake_port != port {
        bail!(
            "--handshake-address {address} and --handshake-port {} disagree: give one of them",
            args.handshake_port
        );
    }
    Ok(port)
}

/// The frontend flags of the engine's kind of model: an embedding model's
/// (`--runner pooling`), or the tool-call and reasoning parsers of a generating one
/// ([`parsers::choose`]; vllm-rs gets its `--reasoning-parser` from `vllm_rs_command_with`).
fn runner_args(play: &PlayArgs, parsing: &parsers::Parsing, python: bool) -> Vec<&'static str> {
    match play.runner {
        Runner::Pooling => vec!["--runner", "pooling"],
        Runner::Generate => {
            let mut v = parsing.tools.clone();
            match parsing.reasoning {
                Some(r) if python && r != "none" => v.extend(["--reasoning-parser", r]),
                _ => {}
            }
            v
        }
    }
}

/// Listen on --port and route to the frontend on `frontend_port` until the engine stops.
async fn start_router(
    args: &ServeArgs,
    route: router::LiveRoute,
    engines: u16,
    connect_host: &str,
    frontend_port: u16,
    stop: &watch::Receiver<bool>,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("router: cannot listen on {}:{}", args.host, args.port))?;
    let limits = crate::http_proxy::Limits {
        who: "router",
        max_body: 64 << 20,
        header_timeout: Duration::from_secs(30),
    };
    let name = route
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default();
    crate::errln!(
        "router on {}:{}: {name} over {engines} engines (the frontend on port {frontend_port})",
        args.host,
        args.port,
    );
    tokio::spawn(router::run(
        listener,
        format!("{}:{frontend_port}", url_host(connect_host)),
        router::Router::new(route, engines.into()),
        limits,
        Duration::from_secs(600),
        stop.clone(),
    ));
    Ok(())
}

/// Fail before starting anything when the port is taken (the frontend would only notice
/// after the handshake, with a less obvious message).
fn ensure_free(host: &str, port: u16, flag: &str) -> Result<()> {
    match std::net::TcpListener::bind((host, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            bail!("{host}:{port} is already in use; pick another with {flag}")
        }
        Err(e) => Err(e).with_context(|| format!("cannot bind {host}:{port} ({flag})")),
    }
}

/// The address a client on this machine connects to for `host` (0.0.0.0 means "here").
fn client_host(host: &str) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host {
        "0.0.0.0" | "" => "127.0.0.1".into(),
        "::" => "::1".into(),
        h => h.into(),
    }
}

pub async fn run(args: ServeArgs, shutdown: watch::Receiver<bool>) -> Result<()> {
    let cache = frontends::cache_root()?;
    let mut play = args.play.clone();
    let line_explicit = line_given_explicitly(play.vllm_version);

    // the model the frontend serves, and the token ids the engine may emit for it
    let flags = model::ModelFlags {
        model: args.model.as_deref(),
        tiny_vocab: args.tiny_vocab,
        served_model_name: args.served_model_name.as_deref(),
    };
    let served = model::choose(&flags, &mut play, &cache)?;
    let (model, name) = (served.dir.clone(), served.name.clone());
    let aliases: Vec<&str> = served.aliases.iter().map(String::as_str).collect();
    // readable answers, and structured outputs and tool calls in the served model's tokens
    play.tokens.get_or_insert(TokenMode::Text);
    if play.tokenizer.is_none() {
        play.tokenizer = Some(model.clone());
    }
    if let Some(m) = model_max_len(&model) {
        play.max_model_len = play.max_model_len.min(m);
    }

    // the formats the engine writes tool calls and thinking in, and the frontend's parsers
    let parsing = parsers::choose(&mut play, &args.frontend_args, args.model.is_some())?;
    // one switch for both sides, as `vllm serve --disable-log-stats` turns off its engine's
    // stats too: given to either, the other gets it
    let frontend_stats_off = args
        .frontend_args
        .iter()
        .any(|a| a == "--disable-log-stats");
    play.disable_log_stats |= frontend_stats_off;
    let stats_flag: &[&str] = if play.disable_log_stats && !frontend_stats_off {
        &["--disable-log-stats"]
    } else {
        &[]
    };

    // the engine's flags are checked before anything starts; the files they name are kept
    // for the engine (read and logged once)
    crate::play::config::check_flags(&play)?;
    let artifacts = crate::play::artifacts::Artifacts::load(&play)?;
    crate::play::config::PlayConfig::new(&play, artifacts.clone())?;
    ensure_free(&args.host, args.port, "--port")?;
    if args.route.is_some() && play.engine_count < 2 {
        bail!("--route picks one of several engines: give --engine-count N (N ≥ 2) with it");
    }
    let hs_port = match handshake_port(&args)? {
        0 => free_port_besides(&[args.port])?,
        p => {
            ensure_free("127.0.0.1", p, "--handshake-port")?;
            p
        }
    };
    // with --route the router listens on --port and the frontend on a port of its own
    let frontend_port = match args.route {
        Some(_) => free_port_besides(&[args.port, hs_port])?,
        None => args.port,
    };
    play.handshake_address = format!("tcp://127.0.0.1:{hs_port}");
    let log = match &args.log_file {
        Some(p) => p.clone(),
        None => logs::default_log(&cache, args.port),
    };
    // the log is replaced below: never when it is one of the engine's inputs
    if let Some(p) = &args.log_file {
        let mut outputs = vec![crate::io_guard::named("--log-file", p)];
        outputs.extend(
            play.replay_summary
                .iter()
                .map(|s| crate::io_guard::named("--replay-summary", s)),
        );
        crate::io_guard::check_outputs(&crate::play::artifacts::engine_inputs(&play), &outputs)?;
    }
    // a fresh log per run; never unlink what is not a regular file (/dev/stderr)
    if std::fs::symlink_metadata(&log).is_ok_and(|m| m.is_file()) {
        let _ = std::fs::remove_file(&log);
    }
    let timeout = args.startup_timeout.max(1.0);

    let spec = FrontendSpec {
        model: &model,
        name: &name,
        aliases: &aliases,
        host: &args.host,
        port: frontend_port,
        handshake_port: hs_port,
        engines: play.engine_count,
        ready_timeout_s: timeout.ceil() as u64,
    };
    // SIGTERM drains at the frontend: it finishes the responses in flight for up to
    // --shutdown-timeout seconds while the engine keeps serving them. The engine stops
    // after the frontend, when nothing can receive its outputs any more, so it aborts
    // what is left at once instead of waiting a second time.
    let drain = play.shutdown_timeout.max(0.0);
    play.shutdown_timeout = 0.0;
    let grace = |base: u64| Duration::from_secs(base) + Duration::from_secs_f64(drain);
    let (cmd, grace) = match args.frontend {
        Frontend::Rs => {
            // `--vllm-version L` without `--frontend-bin` runs line L's own vllm-rs
            // (cached or fetched like the default one), never another line's
            let bin = if line_explicit && args.frontend_bin.is_none() {
                frontends::ensure_vllm_rs(&crate::compat::tag_for(play.vllm_version))?
            } else {
                frontends::find_vllm_rs(args.frontend_bin.as_deref(), env!("VLLM_VCR_DEFAULT_TAG"))?
            };
            play.vllm_version = pick_line(
                &bin.display().to_string(),
                line_of_vllm_rs(&bin),
                play.vllm_version,
                line_explicit,
            );
            if !args.frontend_args.is_empty() {
                let help = output_of(&bin, &["serve", "--help"]).unwrap_or_default();
                for w in ignored_frontend_flags(&help, &args.frontend_args, &name) {
                    tracing::warn!("{w}");
                }
            }
            parsing.check_vllm_rs(args.model.as_deref())?;
            let mut cmd = vllm_rs_command_with(&bin, &spec, parsing.reasoning);
            cmd.args(runner_args(&play, &parsing, false));
            cmd.args(stats_flag);
            let chosen = args
                .frontend_args
                .iter()
                .any(|a| a.starts_with("--shutdown-timeout"));
            if drain > 0.0 && !chosen {
                cmd.args(["--shutdown-timeout", &(drain.ceil() as u64).to_string()]);
            }
            cmd.args(&args.frontend_args);
            (cmd, grace(3))
        }
        Frontend::Python => {
            parsing.check_python()?;
            let venv = args.python_venv.clone().context(
                "--frontend python needs --python-venv DIR (a venv with vllm installed)",
            )?;
            let mut cmd = python_command(&venv, &spec)?;
            play.vllm_version = pick_line(
                &format!("the vllm in {}", venv.display()),
                line_of_venv(&venv),
                play.vllm_version,
                line_explicit,
            );
            cmd.args(runner_args(&play, &parsing, true));
            cmd.args(stats_flag);
            cmd.args(&args.frontend_args);
            (cmd, grace(5))
        }
    };

    let engine_cfg = crate::play::config::PlayConfig::new(&play, artifacts)?;
    crate::errln!("starting the frontend (log: {})", log.display());
    let line = play.vllm_version;
    let mut cmd = cmd;
    die_with_parent(&mut cmd);
    let mut frontend = ChildGuard::spawn("frontend", cmd, &log, grace)?;
    let frontend_pid = frontend.pid();
    let connect_host = client_host(&args.host);
    let (engine_stop, engine_stop_rx) = watch::channel(false);
    if let Some(route) = args.route {
        start_router(
            &args,
            route,
            play.engine_count,
            &connect_host,
            frontend_port,
            &engine_stop_rx,
        )
        .await?;
    }
    let mut engine =
        tokio::spawn(
            async move { crate::play::run_config(engine_cfg, &play, engine_stop_rx).await },
        );

    let stop_all = |mut frontend: ChildGuard| async move {
        let how = tokio::task::spawn_blocking(move || frontend.stop())
            .await
            .unwrap_or_else(|e| format!("stop task failed: {e}"));
        crate::errln!("frontend {how}");
    };

    // wait for /health, watching both processes and the user
    let started = Instant::now();
    let mut user = shutdown.clone();
    loop {
        if health_ok(&connect_host, args.port).await {
            break;
        }
        if let Some(status) = frontend.exited() {
            let _ = engine_stop.send(true);
            return Err(FrontendExited::new(
                frontend.exit_status(),
                format!(
                    "the frontend exited during start-up ({status}); last lines of {}:\n{}",
                    log.display(),
                    log_tail(&log)
                ),
            )
            .into());
        }
        if engine.is_finished() {
            stop_all(frontend).await;
            return match engine.await {
                Ok(Err(e)) => Err(e.context("the engine stopped during start-up")),
                _ => bail!("the engine stopped during start-up"),
            };
        }
        if started.elapsed().as_secs_f64() > timeout {
            stop_all(frontend).await;
            let _ = engine_stop.send(true);
            bail!(
                "the frontend did not answer /health within {timeout} s; last lines of {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = user.wait_for(|v| *v) => {
                stop_all(frontend).await;
                let _ = engine_stop.send(true);
                let _ = tokio::time::timeout(Duration::from_secs(10), engine).await;
                return Ok(());
            }
        }
    }

    let base = format!("http://{}:{}/v1", url_host(&connect_host), args.port);
    let kind = match args.frontend {
        Frontend::Rs => "vllm-rs",
        Frontend::Python => "vllm serve",
    };
    let frontend_line = format!("{kind} (vLLM {line}, pid {frontend_pid})");
    crate::outln!("{}", model::banner(&base, &served, &frontend_line, &log));

    // serve until the user stops us or a process dies
    let outcome: Result<()> = loop {
        tokio::select! {
            _ = user.wait_for(|v| *v) => break Ok(()),
            r = &mut engine => {
                let why = match r {
                    Ok(Ok(())) => anyhow::anyhow!("the engine stopped"),
                    Ok(Err(e)) => e.context("the engine stopped"),
                    Err(e) => anyhow::anyhow!("the engine task failed: {e}"),
                };
                // The engine stops when the frontend's input sockets close, which is what
                // a frontend that died does: then that death, and its status, is the
                // outcome (the supervisor reaps it within moments).
                for _ in 0..20 {
                    if let Some(status) = frontend.exited() {
                        let died = FrontendExited::of(&mut frontend, &status, &log);
                        stop_all(frontend).await;
                        return Err(died.into());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                stop_all(frontend).await;
                return Err(why);
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if let Some(status) = frontend.exited() {
                    break Err(FrontendExited::of(&mut frontend, &status, &log).into());
                }
            }
        }
    };
    crate::errln!("stopping");
    stop_all(frontend).await;
    let _ = engine_stop.send(true);
    match tokio::time::timeout(Duration::from_secs(10), engine).await {
        Ok(Ok(Err(e))) => tracing::warn!("engine: {e:#}"),
        Err(_) => tracing::warn!("the engine did not stop within 10 s"),
        _ => {}
    }
    outcome
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::frontend::vocab_size_of;
    use super::*;
    use sim_protocol::VllmLine;

    /// `serve` reads its own flags from its arguments' definition (not from the whole
    /// command line, which would make serve depend on cli): the same set either way.
    #[test]
    fn serve_flags_are_the_serve_subcommands() {
        use clap::CommandFactory;
        let longs = |c: &clap::Command| -> std::collections::BTreeSet<String> {
            c.get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .collect()
        };
        let cli = crate::cli::Cli::command();
        let sub = cli.find_subcommand("serve").expect("serve subcommand");
        let own = ServeArgs::augment_args(clap::Command::new("serve"));
        assert_eq!(longs(sub), longs(&own));
        assert!(longs(&own).contains("handshake-port"));
    }

    #[test]
    fn vocab_of_the_embedded_model() {
        let dir = std::env::temp_dir().join(format!("vllm-vcr-vocab-{}", std::process::id()));
        vcr_host::tiny_model::write_to(&dir).unwrap();
        assert_eq!(
            vocab_size_of(&dir).unwrap(),
            vcr_host::tiny_model::TOKENIZER_VOCAB
        );
        assert_eq!(model_max_len(&dir), Some(2048));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn handshake_address_means_the_handshake_port_on_loopback() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let port = |argv: &[&str]| {
            let cli = <Cli as clap::Parser>::try_parse_from(
                std::iter::once("serve").chain(argv.iter().copied()),
            )
            .unwrap();
            handshake_port(&cli.serve).map_err(|e| e.to_string())
        };
        assert_eq!(port(&[]), Ok(0));
        assert_eq!(port(&["--handshake-port", "4000"]), Ok(4000));
        let shared = port(&["--port", "4000", "--handshake-port", "4000"]);
        assert!(
            shared
                .as_ref()
                .is_err_and(|e| e.contains("cannot share a port")),
            "{shared:?}"
        );
        assert_eq!(
            port(&["--handshake-address", "tcp://127.0.0.1:4321"]),
            Ok(4321)
        );
        assert_eq!(
            port(&["--handshake-address", "tcp://localhost:4321"]),
            Ok(4321)
        );
        let both = [
            "--handshake-address",
            "tcp://127.0.0.1:4321",
            "--handshake-port",
            "4321",
        ];
        assert_eq!(port(&both), Ok(4321));
        let err = port(&["--handshake-address", "tcp://10.1.2.3:4321"]).unwrap_err();
        assert!(err.contains("only tcp://127.0.0.1:PORT"), "{err}");
        let err = port(&[
            "--handshake-address",
            "tcp://127.0.0.1:1",
            "--handshake-port",
            "2",
        ])
        .unwrap_err();
        assert!(err.contains("disagree"), "{err}");
    }

    #[test]
    fn line_from_version_output_or_layout() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vllm-vcr-line-{}", std::process::id()));
        let script = |name: &str, body: &str| {
            let path = dir.join(name).join("vllm-rs");
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        // A script just written can fail to exec with ETXTBSY while another test thread
        // forks (it briefly inherits the write descriptor): retry a few times.
        let line_of = |p: &std::path::Path| {
            (0..5).find_map(|_| {
                let l = line_of_vllm_rs(p);
                if l.is_none() {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                l
            })
        };
        let new = script("anywhere", "echo 'vllm-rs 0.29.0'");
        assert_eq!(line_of(&new), Some(VllmLine::new(0, 29)));
        // before 0.29: `--version` is a CLI error; the cache layout tells the release
        let old = script(
            "0.26.0",
            "echo \"error: unexpected argument '--version'\" >&2; exit 2",
        );
        assert_eq!(line_of(&old), Some(VllmLine::new(0, 26)));
        let unknown = script("tools", "exit 2");
        assert_eq!(line_of_vllm_rs(&unknown), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hosts_for_clients_and_urls() {
        assert_eq!(client_host("0.0.0.0"), "127.0.0.1");
        assert_eq!(client_host("::"), "::1");
        assert_eq!(client_host("[::1]"), "::1");
        assert_eq!(client_host("localhost"), "localhost");
        assert_eq!(url_host("::1"), "[::1]");
        assert_eq!(url_host("127.0.0.1"), "127.0.0.1");
    }

    #[tokio::test]
    async fn health_probe_reads_the_status() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            for reply in [
                "HTTP/1.1 200 OK\r\n\r\n",
                "HTTP/1.1 503 Service Unavailable\r\n\r\n",
            ] {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await;
                s.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        assert!(health_ok("127.0.0.1", port).await);
        assert!(!health_ok("127.0.0.1", port).await);
        assert!(
            !health_ok("127.0.0.1", port).await,
            "nothing listens any more"
        );
    }
}
