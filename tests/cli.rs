//! The command line itself: completions for every shell, and `--help` that explains every
//! flag.

use std::process::Command;

use clap::CommandFactory;
use vllm_vcr::cli::Cli;

#[test]
fn completions_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let out = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8(out.stdout).unwrap();
        // fish lists long flags without their dashes
        for word in ["play", "serve", "handshake-address", "inter-token-latency"] {
            assert!(text.contains(word), "{shell} completion lacks {word}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

#[test]
fn every_flag_is_documented() {
    let cmd = Cli::command();
    for sub in cmd.get_subcommands() {
        for arg in sub.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(
                arg.get_help().is_some_and(|h| h.to_string().len() > 10),
                "`vllm-vcr {} --{id}` has no help text",
                sub.get_name()
            );
        }
    }
}

#[test]
fn bad_flag_values_get_clear_errors() {
    for (args, needle) in [
        (
            vec!["play", "--vllm-version", "0.24"],
            "outside the supported window",
        ),
        (
            vec!["play", "--vllm-version", "banana"],
            "not a vLLM version",
        ),
        (vec!["play", "--inter-token-latency=-3"], "≥ 0"),
        (vec!["play", "--dtype", "int8"], "bfloat16"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
