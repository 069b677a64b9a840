//! The flags `serve` hands the frontend and the wire line it speaks: which flags after
//! `--` vllm-rs takes without acting on them (warned about, with the `serve` flag that
//! does it), and whether the frontend's own line or the one the user asked for wins.

use clap::Args;
use sim_protocol::VllmLine;

use super::ServeArgs;
use crate::play::PlayArgs;

/// The long flags a `--help` text lists (`--port`, `--served-model-name`, …).
fn listed_flags(help: &str) -> std::collections::BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| l.split([' ', ',', '=', '[', '<']))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

/// Flags vllm-rs recognises without listing them in `serve --help`.
const VLLM_RS_HIDDEN_FLAGS: &[&str] = &["--enable-auto-tool-choice"];

/// Warnings about the flags after `--` that vllm-rs takes without acting on them. vllm-rs
/// keeps the flags it recognises and hands every other one (and `--max-model-len`, which it
/// lists as "forwarded to the managed Python engine") to the Python engine it would manage;
/// under `serve` there is none, the engine is `play`, so they do nothing and vllm-rs says
/// nothing. An engine flag that `serve` has itself gets a pointer to it. A second
/// `--served-model-name` only adds an alias. `help` is the output of `vllm-rs serve
/// --help` (empty: unknown, then only the flags `serve` knows are checked); `name` is the
/// public model name `serve` gives.
pub(super) fn ignored_frontend_flags(help: &str, user: &[String], name: &str) -> Vec<String> {
    let listed = listed_flags(help);
    let serve_flags: std::collections::BTreeSet<String> =
        ServeArgs::augment_args(clap::Command::new("serve"))
            .get_arguments()
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .collect();
    let mut out = Vec::new();
    for a in user {
        let Some(flag) = a
            .split('=')
            .next()
            .filter(|f| f.starts_with("--") && f.len() > 2)
        else {
            continue;
        };
        let rust_side = (listed.contains(flag) || VLLM_RS_HIDDEN_FLAGS.contains(&flag))
            && flag != "--max-model-len";
        if flag == "--served-model-name" {
            out.push(format!(
                "serve -- {flag}: vllm-rs only adds it as an alias; answers still name the \
                 model `{name}` (give `vllm-vcr serve --served-model-name …` to rename it)"
            ));
        } else if serve_flags.contains(flag) && !rust_side {
            out.push(format!(
                "serve -- {flag}: an engine setting, which vllm-rs hands to a Python engine \
                 that serve does not run: it has no effect; `vllm-vcr serve {flag} …` (before \
                 `--`) sets it on the engine"
            ));
        } else if !help.is_empty() && !rust_side && flag != "--max-model-len" {
            out.push(format!(
                "serve -- {flag}: not a flag `vllm-rs serve --help` lists; vllm-rs hands flags \
                 it does not know to a Python engine, which serve does not run, so it most \
                 likely has no effect"
            ));
        }
    }
    out
}

/// Whether the user chose the line: a non-default value, or the flag on the command line.
pub(super) fn line_given_explicitly(requested: VllmLine) -> bool {
    requested != PlayArgs::defaults().vllm_version
        || std::env::args_os().any(|a| {
            let a = a.to_string_lossy();
            a == "--vllm-version" || a.starts_with("--vllm-version=")
        })
}

/// The line the engine speaks: the frontend's own unless the user picked one.
pub(super) fn pick_line(
    frontend: &str,
    detected: Option<VllmLine>,
    requested: VllmLine,
    explicit: bool,
) -> VllmLine {
    match detected {
        Some(found) if found == requested => requested,
        Some(found) if explicit => {
            tracing::warn!(
                "{frontend} looks like vLLM {found}, but --vllm-version {requested} was given: speaking {requested}"
            );
            requested
        }
        Some(found) => {
            tracing::info!(
                "{frontend} is vLLM {found}: speaking the {found} wire (pass --vllm-version to override)"
            );
            found
        }
        None if explicit => requested,
        None => {
            tracing::warn!(
                "cannot tell the vLLM line of {frontend}: speaking {requested}; pass --vllm-version if it differs"
            );
            requested
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L11: flags after `--` that vllm-rs takes and does nothing with are named.
    #[test]
    fn frontend_flags_vllm_rs_ignores_are_named() {
        let help = "Options:\n      --port <PORT>\n          HTTP port\n      \
                    --served-model-name [<SERVED_MODEL_NAME>...]\n      \
                    --max-model-len <MAX_MODEL_LEN>\n  -h, --help\n      \
                    --tool-call-parser <P>\n";
        let user: Vec<String> = [
            "--max-model-len",
            "10",
            "--served-model-name",
            "other",
            "--bogus-flag",
            "--max-num-seqs=4",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let w = ignored_frontend_flags(help, &user, "tiny");
        assert_eq!(w.len(), 4, "{w:#?}");
        assert!(
            w[0].contains("--max-model-len") && w[0].contains("`vllm-vcr serve --max-model-len")
        );
        assert!(w[1].contains("alias") && w[1].contains("`tiny`"));
        assert!(w[2].contains("--bogus-flag") && w[2].contains("no effect"));
        assert!(w[3].contains("--max-num-seqs") && w[3].contains("before"));
        // without vllm-rs's help only what serve knows is said
        assert_eq!(ignored_frontend_flags("", &user, "tiny").len(), 3);
    }

    #[test]
    fn the_frontend_line_wins_unless_one_was_given() {
        let l = |s: &str| VllmLine::parse(s).unwrap();
        assert_eq!(pick_line("f", Some(l("0.25")), l("0.33"), false), l("0.25"));
        assert_eq!(pick_line("f", Some(l("0.25")), l("0.33"), true), l("0.33"));
        assert_eq!(pick_line("f", Some(l("0.30")), l("0.30"), true), l("0.30"));
        assert_eq!(pick_line("f", None, l("0.31"), false), l("0.31"));
    }
}
