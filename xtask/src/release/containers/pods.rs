//! Every `deploy/` directory as pods under `podman play kube`, each as a test variant of
//! its manifest (host network, free ports, no probes, no Services).

use super::image::{chat, complete, stream, wait_health};
use super::*;

/// The test variant of a manifest for podman: only Pods, Deployments and volume claims
/// (podman runs no Services), host networking, no `ports:` lists (podman refuses port
/// mappings on the host network), no probes (podman runs them through systemd timers), and
/// every port in `ports` renumbered (whole numbers only).
pub(super) fn test_variant(yaml: &str, ports: &[(u16, u16)]) -> String {
    let mut docs = Vec::new();
    for doc in yaml.split("\n---\n") {
        let kind = doc
            .lines()
            .find_map(|l| l.strip_prefix("kind:"))
            .map(str::trim)
            .unwrap_or_default();
        if !matches!(kind, "Deployment" | "Pod" | "PersistentVolumeClaim") {
            continue;
        }
        let mut out: Vec<String> = Vec::new();
        let mut skip_deeper_than: Option<usize> = None;
        for line in doc.lines() {
            let indent = line.len() - line.trim_start().len();
            if let Some(d) = skip_deeper_than {
                if line.trim().is_empty() || indent > d {
                    continue;
                }
                skip_deeper_than = None;
            }
            let key = line.trim();
            if matches!(
                key,
                "ports:" | "startupProbe:" | "readinessProbe:" | "livenessProbe:"
            ) {
                skip_deeper_than = Some(indent);
                continue;
            }
            out.push(renumber(line, ports));
            if key == "enableServiceLinks: false" {
                out.push(format!("{}hostNetwork: true", " ".repeat(indent)));
            }
        }
        docs.push(out.join("\n"));
    }
    docs.join("\n---\n") + "\n"
}

/// Replace whole numbers `from` by `to` in one line.
pub(super) fn renumber(line: &str, ports: &[(u16, u16)]) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        let replaced = ports
            .iter()
            .find(|(from, _)| from.to_string() == *digits)
            .map(|(_, to)| to.to_string());
        out.push_str(&replaced.unwrap_or_else(|| digits.clone()));
        digits.clear();
    };
    for c in line.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out
}

/// Write the test variant of `manifest` (relative to deploy/) to the cache; returns it.
pub(super) fn variant_file(
    root: &Path,
    dir: &Path,
    manifest: &str,
    ports: &[(u16, u16)],
) -> Result<PathBuf> {
    let src = root.join("deploy").join(manifest);
    let text =
        std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
    let out = dir.join(format!("{PREFIX}-{}", manifest.replace('/', "-")));
    std::fs::write(&out, test_variant(&text, ports))?;
    Ok(out)
}

/// `podman play kube` a test variant and wait until its frontend answers /health.
pub(super) fn play(
    podman: &Podman,
    file: &Path,
    pod: &str,
    frontend: &str,
    port: u16,
) -> Result<f64> {
    podman.ok(&["play", "kube", &file.to_string_lossy()])?;
    let container = format!("{pod}-{frontend}");
    wait_health(podman, &container, port, Duration::from_secs(120))
}

pub(super) fn check_mock_pod(root: &Path, podman: &Podman, dir: &Path) -> Result<()> {
    let port = vcr_host::child::free_ports(1)?[0];
    let file = variant_file(root, dir, "mock/deployment.yaml", &[(8000, port)])?;
    let _down = Cleanup::Kube(podman, file.clone());
    let secs = play(podman, &file, "vllm-vcr-mock-pod-0", "vllm", port)?;
    eprintln!("  /health 200 after {secs:.1} s");
    let client = Client::new(port, Duration::from_secs(30));
    let text = chat(&client, "tiny", "Hello from a pod", 8)?;
    eprintln!("  chat completion through the pod: 8 tokens, length: {text:?}");
    let (chunks, finish, done, _) = stream(&client, "tiny", 6)?;
    if chunks != 6 || finish.as_deref() != Some("length") || !done {
        bail!(
            "streaming through the pod: {chunks} events, finish_reason {finish:?}, [DONE] {done}"
        );
    }
    eprintln!("  streaming completion through the pod: 6 tokens, length, [DONE]");
    Ok(())
}

/// Capture three completions through frontend > record > play, stop the pod (the tap
/// writes its trace to the volume), then serve the same prompts from the trace with the
/// offline-replay pod: the same text, token for token; a prompt the capture never saw is
/// refused (MOCK_REPLAY_MISS=fail).
pub(super) fn check_capture_replay(root: &Path, podman: &Podman, dir: &Path) -> Result<()> {
    let volume = "vllm-vcr-traces";
    let _ = podman.output(&["volume", "rm", "-f", volume]);
    let p = vcr_host::child::free_ports(5)?;
    let capture = variant_file(
        root,
        dir,
        "trace-capture/capture/capture.yaml",
        &[(8000, p[0]), (29550, p[1]), (29551, p[2])],
    )?;
    let storage = variant_file(root, dir, "trace-capture/storage/pvc.yaml", &[])?;
    podman.ok(&["play", "kube", &storage.to_string_lossy()])?;
    let prompts = [
        "The first prompt of the capture",
        "A second, different prompt",
        "And a third one, longer than the others by a few words",
    ];
    let mut captured = Vec::new();
    {
        let _down = Cleanup::Kube(podman, capture.clone());
        let secs = play(podman, &capture, "vllm-vcr-capture-pod-0", "frontend", p[0])?;
        eprintln!("  capture pod: /health 200 after {secs:.1} s");
        let client = Client::new(p[0], Duration::from_secs(30));
        for prompt in prompts {
            let (status, text, finish) = complete(&client, "tiny", prompt, 16)?;
            if status != 200 || finish != "length" || text.is_empty() {
                bail!(
                    "capture: {prompt:?}: HTTP {status}, finish_reason {finish:?}, text {text:?}"
                );
            }
            captured.push(text);
        }
        eprintln!("  captured 3 completions through frontend > record > play");
        // SIGTERM, as a pod deletion sends it: the tap closes the trace with every record
        // (`play kube --down` alone does not leave the tap time to write the last one)
        podman.ok(&["pod", "stop", "-t", "20", "vllm-vcr-capture-pod-0"])?;
        let tap = podman.logs("vllm-vcr-capture-pod-0-tap");
        let wrote = "wrote /trace/trace.jsonl (3 request records, 0 incomplete";
        if !tap.contains(wrote) {
            bail!("the tap's log does not say {wrote:?}:\n{tap}");
        }
        eprintln!("  SIGTERM: the tap says \"{wrote} …\"");
        podman.ok(&["play", "kube", "--down", &capture.to_string_lossy()])?;
    }
    let replay = variant_file(
        root,
        dir,
        "trace-capture/replay/offline-replay.yaml",
        &[(8000, p[3]), (29550, p[4])],
    )?;
    let _down = Cleanup::Kube(podman, replay.clone());
    let secs = play(podman, &replay, "vllm-vcr-replay-pod-0", "frontend", p[3])?;
    eprintln!("  replay pod: /health 200 after {secs:.1} s");
    let client = Client::new(p[3], Duration::from_secs(30));
    for (prompt, want) in prompts.iter().zip(&captured) {
        let (status, text, finish) = complete(&client, "tiny", prompt, 16)?;
        if status != 200 || finish != "length" || &text != want {
            bail!(
                "replay of {prompt:?}: HTTP {status}, finish_reason {finish:?}, text {text:?}; captured {want:?}\nengine log:\n{}",
                podman.logs("vllm-vcr-replay-pod-0-engine")
            );
        }
    }
    eprintln!("  replayed the 3 prompts: the captured text, token for token");
    let (status, body, _) = complete(&client, "tiny", "zzz never captured qqq", 16)?;
    if status == 200 {
        bail!(
            "a prompt the capture never saw was answered (HTTP 200: {}) despite MOCK_REPLAY_MISS=fail",
            snippet(&body)
        );
    }
    eprintln!("  an uncaptured prompt: HTTP {status} ({})", snippet(&body));
    drop(_down);
    let _ = podman.output(&["play", "kube", "--down", &storage.to_string_lossy()]);
    let _ = podman.output(&["volume", "rm", "-f", volume]);
    Ok(())
}

/// The P/D pods: prefill, and decode behind the routing sidecar's slot. llm-d's sidecar
/// (a Go program no registry serves here) is replaced by `vllm-vcr pd-proxy`, which makes
/// the same two requests; the pod IP (`status.podIP`) is the loopback on the host network.
/// The pods run `image`; with `nixl` (the nixl image) the decode engine must have read the
/// prefill engine's KV over NIXL and checked every byte.
pub(super) fn check_pd_pods(
    root: &Path,
    podman: &Podman,
    dir: &Path,
    image: &str,
    nixl: bool,
) -> Result<()> {
    let p = vcr_host::child::free_ports(4)?;
    let (prefill_port, side_port, proxy_port, decode_port) = (p[0], p[1], p[2], p[3]);
    let prefill = variant_file(
        root,
        dir,
        "llm-d-pd/prefill.yaml",
        &[(8000, prefill_port), (5600, side_port)],
    )?;
    let text = std::fs::read_to_string(&prefill)?;
    let text = without_block(&text, "valueFrom:")
        .replace("$(POD_IP)", "127.0.0.1")
        .replace("image: vllm-vcr:vllm0.33", &format!("image: {image}"));
    std::fs::write(&prefill, text)?;
    let decode = variant_file(
        root,
        dir,
        "llm-d-pd/decode.yaml",
        &[(8000, proxy_port), (8200, decode_port)],
    )?;
    let text = std::fs::read_to_string(&decode)?;
    let sidecar = text
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with("image: ghcr.io/llm-d/llm-d-routing-sidecar")
        })
        .context("decode.yaml has no llm-d routing sidecar")?
        .to_string();
    let indent = " ".repeat(sidecar.len() - sidecar.trim_start().len());
    let proxy = format!(
        "{indent}image: vllm-vcr:vllm0.33\n{indent}args: [\"pd-proxy\", \"--prefill\", \"http://127.0.0.1:{prefill_port}\", \"--decode\", \"http://127.0.0.1:{decode_port}\", \"--port\", \"{proxy_port}\"]"
    );
    // the sidecar's own flags are the first block `args:` (the server's is inline)
    let text = without_block(&text, "args:")
        .replace(&sidecar, &proxy)
        .replace("image: vllm-vcr:vllm0.33", &format!("image: {image}"));
    std::fs::write(&decode, text)?;

    let _down_prefill = Cleanup::Kube(podman, prefill.clone());
    let _down_decode = Cleanup::Kube(podman, decode.clone());
    let secs = play(
        podman,
        &prefill,
        "vllm-vcr-prefill-pod-0",
        "vllm",
        prefill_port,
    )?;
    eprintln!("  prefill pod: /health 200 after {secs:.1} s");
    let secs = play(
        podman,
        &decode,
        "vllm-vcr-decode-pod-0",
        "vllm",
        decode_port,
    )?;
    eprintln!("  decode pod: /health 200 after {secs:.1} s");
    let count = |port: u16| -> Result<f64> {
        let m = Client::new(port, Duration::from_secs(10)).get("/metrics")?;
        let samples = crate::http::parse_metrics(&m.text());
        Ok(crate::http::metric_sum(&samples, "vllm:request_success_total", &[]).unwrap_or(0.0))
    };
    let (p0, d0) = (count(prefill_port)?, count(decode_port)?);
    let client = Client::new(proxy_port, Duration::from_secs(30));
    let t = Instant::now();
    let r = loop {
        // the proxy container may still be starting
        match client.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "Disaggregated hello", "max_tokens": 12}),
        ) {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e.context("the pd-proxy in the sidecar's slot never answered")),
        }
    };
    let v = r.json()?;
    let (finish, used) = finish_and_used(&v);
    if r.status != 200 || finish != Some("length") || used != Some(12) {
        bail!(
            "completion through the decode pod: HTTP {}, finish_reason {finish:?}, completion_tokens {used:?}: {}\ndecode engine log:\n{}",
            r.status,
            snippet(&r.text()),
            podman.logs("vllm-vcr-decode-pod-0-vllm")
        );
    }
    let (p1, d1) = (count(prefill_port)?, count(decode_port)?);
    if p1 - p0 != 1.0 || d1 - d0 != 1.0 {
        bail!(
            "vllm:request_success_total moved by {} on prefill and {} on decode, expected 1 and 1",
            p1 - p0,
            d1 - d0
        );
    }
    eprintln!(
        "  a completion through the decode pod: 12 tokens, length; one request finished on each of prefill and decode"
    );
    if nixl {
        let (plog, dlog) = (
            podman.logs("vllm-vcr-prefill-pod-0-vllm"),
            podman.logs("vllm-vcr-decode-pod-0-vllm"),
        );
        let registered = "NIXL data plane: KV pool registered";
        let read = dlog
            .lines()
            .find(|l| l.contains("NIXL READ done: every byte verified"));
        match (plog.contains(registered) && dlog.contains(registered), read) {
            (true, Some(line)) => eprintln!("  decode engine: {}", line.trim()),
            _ => bail!(
                "no NIXL transfer: both engines must say {registered:?} and the decode engine \
                 that it read and verified the KV\nprefill log:\n{plog}\ndecode log:\n{dlog}"
            ),
        }
    }
    Ok(())
}

/// A KV-events subscriber for the test: binds a ZMQ SUB socket (the router's side of
/// llm-d's layout) and prints one JSON line per message: topic, and per event its tag,
/// block count and token count. Runs in the tools venv (pyzmq, msgspec).
pub(super) const KV_SUBSCRIBER: &str = r#"
import json, sys, msgspec, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.RCVTIMEO, int(float(sys.argv[2]) * 1000))
sock.bind(sys.argv[1])
print(json.dumps({"ready": True}), flush=True)
while True:
    try:
        frames = sock.recv_multipart()
    except zmq.Again:
        break
    ts, events, rank = msgspec.msgpack.decode(frames[-1])
    out = []
    for e in events:
        # vLLM's events are tagged maps: {"type": "BlockStored", "block_hashes": …}
        out.append([e.get("type"), len(e.get("block_hashes") or []), len(e.get("token_ids") or [])])
    print(json.dumps({"topic": frames[0].decode(), "events": out}), flush=True)
"#;

/// The KV-events pod publishes to a subscriber socket: a prompt of three full blocks is
/// announced as BlockStored events of those blocks, on the pod's topic.
pub(super) fn check_kv_events_pod(
    root: &Path,
    podman: &Podman,
    dir: &Path,
    venv: &Path,
) -> Result<()> {
    use std::io::BufRead;
    let p = vcr_host::child::free_ports(2)?;
    let (port, sub_port) = (p[0], p[1]);
    let file = variant_file(root, dir, "kv-events/deployment.yaml", &[(8000, port)])?;
    let text = std::fs::read_to_string(&file)?;
    let text = without_block(&text, "valueFrom:")
        .replace("$(POD_IP)", "127.0.0.1")
        .replace(
            "kv-events-subscriber:5557",
            &format!("127.0.0.1:{sub_port}"),
        )
        // one pod on the host network (two would share its ports)
        .replace("replicas: 2", "replicas: 1");
    std::fs::write(&file, text)?;

    let script = dir.join(format!("{PREFIX}-kv-subscriber.py"));
    std::fs::write(&script, KV_SUBSCRIBER)?;
    let mut sub = Command::new(venv.join("bin").join("python"))
        .arg(&script)
        .arg(format!("tcp://127.0.0.1:{sub_port}"))
        .arg("30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::io::stderr())
        .spawn()
        .context("starting the KV-events subscriber")?;
    let mut lines =
        std::io::BufReader::new(sub.stdout.take().context("subscriber stdout")?).lines();
    let result = (|| -> Result<()> {
        match lines.next() {
            Some(Ok(l)) if l.contains("ready") => {}
            other => bail!("the subscriber did not start: {other:?}"),
        }
        let _down = Cleanup::Kube(podman, file.clone());
        let secs = play(podman, &file, "vllm-vcr-kv-events-pod-0", "vllm", port)?;
        eprintln!("  /health 200 after {secs:.1} s");
        // 48 one-byte tokens (the tiny model's tokenizer) and a few of the chat template:
        // at least three full blocks of 16
        let prompt = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV";
        let (status, _, finish) = complete(
            &Client::new(port, Duration::from_secs(30)),
            "tiny",
            prompt,
            4,
        )?;
        if status != 200 || finish != "length" {
            bail!("completion: HTTP {status}, finish_reason {finish:?}");
        }
        let mut stored = 0;
        let mut topic = String::new();
        for line in lines.by_ref() {
            let v: Value = serde_json::from_str(&line?)?;
            topic = v["topic"].as_str().unwrap_or_default().to_string();
            for e in v["events"].as_array().into_iter().flatten() {
                if e[0] == "BlockStored" {
                    stored += e[1].as_u64().unwrap_or(0);
                }
            }
            if stored >= 3 {
                break;
            }
        }
        if stored < 3 || topic != "kv@127.0.0.1@tiny" {
            bail!(
                "the subscriber saw {stored} stored blocks on topic {topic:?}, expected >= 3 on kv@127.0.0.1@tiny; log:\n{}",
                podman.logs("vllm-vcr-kv-events-pod-0-vllm")
            );
        }
        eprintln!("  a 48-token prompt: BlockStored for {stored} blocks on topic {topic}");
        Ok(())
    })();
    let _ = sub.kill();
    let _ = sub.wait();
    result
}

/// `yaml` without the first mapping key `key` and the lines nested under it.
pub(super) fn without_block(yaml: &str, key: &str) -> String {
    let mut out = Vec::new();
    let mut skip: Option<usize> = None;
    let mut done = false;
    for line in yaml.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(d) = skip {
            if line.trim().is_empty() || indent > d {
                continue;
            }
            skip = None;
        }
        if !done && line.trim() == key {
            skip = Some(indent);
            done = true;
            continue;
        }
        out.push(line);
    }
    out.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_variant_runs_on_the_host_network_without_probes_or_services() {
        let yaml = "kind: Deployment\nspec:\n  template:\n    spec:\n      enableServiceLinks: false\n      containers:\n        - name: a\n          env:\n            - name: PORT\n              value: \"8000\"\n          ports:\n            - name: http\n              containerPort: 8000\n          readinessProbe:\n            httpGet:\n              port: http\n          volumeMounts: []\n---\nkind: Service\nspec:\n  ports:\n    - port: 8000\n";
        let v = test_variant(yaml, &[(8000, 18123)]);
        assert!(v.contains("      hostNetwork: true\n"), "{v}");
        assert!(v.contains("value: \"18123\""), "{v}");
        assert!(
            !v.contains("Probe") && !v.contains("ports:") && !v.contains("kind: Service"),
            "{v}"
        );
        assert!(v.contains("          volumeMounts: []"), "{v}");
    }

    #[test]
    fn renumber_replaces_whole_numbers_only() {
        assert_eq!(renumber("a 8000 18000 8000x", &[(8000, 9)]), "a 9 18000 9x");
    }
}
