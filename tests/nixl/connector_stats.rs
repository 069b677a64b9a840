//! `--nixl-connector-stats`: a `play` decode engine behind vLLM's Python frontend, started
//! with a `--kv-transfer-config` naming the NixlConnector, reports its NIXL reads as that
//! connector does, and the frontend's `/metrics` show them as `vllm:nixl_*`: the bytes the
//! engine read, one transfer, no failure.

use super::pd_control::{log_field, metric, ports, post, proxy, serve, strings};
use crate::support::wait_until;
use std::time::Duration;

#[test]
fn the_python_frontend_shows_a_play_decode_engines_nixl_reads_as_vllm_nixl_metrics() {
    let cache = vllm_vcr::frontends::cache_root().expect("cache root");
    let venv = vllm_vcr::frontends::python_venv(&cache, "vllm", "0.33.0");
    assert!(
        venv.join(".installed").is_file(),
        "the vllm 0.33.0 venv is not in the cache: run `cargo xtask fetch --python`"
    );
    let p = ports(4);
    let (pf_port, dec_port, proxy_port, side) = (p[0], p[1], p[2], p[3]);
    let _prefill = serve(
        pf_port,
        &strings(&[
            "--pd-role",
            "prefill",
            "--engine-id",
            "stats-prefill",
            "--side-channel-port",
            &side.to_string(),
        ]),
        "stats-prefill",
    );
    let decode = serve(
        dec_port,
        &strings(&[
            "--pd-role",
            "decode",
            "--engine-id",
            "stats-decode",
            "--nixl-connector-stats",
            "--frontend",
            "python",
            "--python-venv",
            &venv.display().to_string(),
            "--",
            "--kv-transfer-config",
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#,
        ]),
        "stats-decode",
    );
    let _proxy = proxy(pf_port, dec_port, proxy_port, "stats-proxy");

    let prompt = "Thirty-two bytes of prompt here.";
    let (status, body) = post(
        proxy_port,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 6}),
    );
    assert_eq!(status, 200, "{body}\n{}", decode.log());
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    let read = |log: &str| log_field(log, "every byte verified", "bytes");
    assert!(
        wait_until(Duration::from_secs(5), || read(&decode.log()).is_some()),
        "{}",
        decode.log()
    );
    let bytes: f64 = read(&decode.log()).unwrap().parse().unwrap();
    assert!(bytes > 0.0);
    // the stats ride on the step after the read; the frontend logs them as it gets them
    let shown = || metric(dec_port, "vllm:nixl_bytes_transferred_sum");
    assert!(
        wait_until(Duration::from_secs(5), || shown() == bytes),
        "vllm:nixl_bytes_transferred_sum {} against {bytes} bytes read\n{}",
        shown(),
        decode.log()
    );
    assert_eq!(metric(dec_port, "vllm:nixl_xfer_time_seconds_count"), 1.0);
    assert_eq!(metric(dec_port, "vllm:nixl_num_descriptors_sum"), 2.0);
    assert_eq!(
        metric(dec_port, "vllm:nixl_num_failed_transfers_total"),
        0.0
    );
}
