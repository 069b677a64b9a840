//! Tokenizers the tools find: the embedded model's in the Hugging Face cache as
//! `vllm-vcr/tiny` (the banner names it and the model directory; `transformers` and
//! `vllm-rs bench serve` load it offline by that id and count what the server counts), and
//! a user's own model directory (config and tokenizer, no weights) served end to end.

use std::path::Path;

use serde_json::{Value, json};
use vllm_vcr::play::content::vocab::Vocabulary;

use super::*;
use crate::support::http::{metric_sum, parse_metrics};
use crate::support::vllm_python;

/// The value of the ready block's line `label` (`tokenizer`, `model directory`, …).
fn banner_value(serve: &Serve, label: &str) -> String {
    serve
        .banner
        .iter()
        .find_map(|l| {
            let rest = l.trim_start().strip_prefix(label)?;
            rest.starts_with("  ").then(|| rest.trim().to_string())
        })
        .unwrap_or_else(|| {
            panic!(
                "no {label:?} line in the banner:\n{}",
                serve.banner.join("\n")
            )
        })
}

/// `POST path` of `body` answered 200: the answer.
fn ok(port: u16, path: &str, body: Value) -> Value {
    let (status, answer) = http_post_json(port, path, &body);
    assert_eq!(status, 200, "{path} {body}: {answer}");
    answer
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of token ids: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

#[test]
fn the_embedded_tokenizer_loads_offline_by_its_id() {
    let tmp = TestDir::new("serve-hf-cache");
    let hub = tmp.path("hub");
    let hub_s = hub.to_str().unwrap();
    let mut serve = Serve::start_with_env(&[], &[("HF_HUB_CACHE", hub_s)]);
    let (_, frontend_pid) = serve.wait_ready();

    // the banner names the id, the cache it is in and the model directory
    assert_eq!(
        banner_value(&serve, "tokenizer"),
        format!("vllm-vcr/tiny (Hugging Face cache {hub_s}; loads offline)")
    );
    let dir = banner_value(&serve, "model directory");
    let models = http_get(serve.port, "/v1/models").json().unwrap();
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    assert_eq!(models["data"][0]["root"], dir.as_str(), "{models}");
    assert_eq!(models["data"][1]["id"], "vllm-vcr/tiny", "{models}");

    // refs/main names a snapshot of exactly the served directory's files
    let repo = hub.join("models--vllm-vcr--tiny");
    let rev = std::fs::read_to_string(repo.join("refs/main")).unwrap();
    assert_eq!(rev.len(), 40, "{rev:?}");
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let snapshot = repo.join("snapshots").join(&rev).join(e.file_name());
        assert_eq!(
            std::fs::read(&snapshot).unwrap_or_default(),
            std::fs::read(e.path()).unwrap(),
            "{}",
            snapshot.display()
        );
    }

    // transformers, offline, by the id: the ids the frontend gives a chat and a text
    let script = r#"
import json
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("vllm-vcr/tiny")
chat = tok.apply_chat_template([{"role": "user", "content": "Hello, world"}],
                               add_generation_prompt=True, tokenize=False)
print(json.dumps({"chat": tok.encode(chat, add_special_tokens=False),
                  "text": tok.encode("Grüße, world", add_special_tokens=False),
                  "size": len(tok)}))
"#;
    let out = Command::new(vllm_python("transformers loads the tokenizer by its id"))
        .args(["-c", script])
        .env("HF_HUB_CACHE", hub_s)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "transformers could not load vllm-vcr/tiny offline:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    assert_eq!(local["size"], vllm_vcr::tiny_model::TOKENIZER_VOCAB);
    // the alias: a request may name the tokenizer's id as the model
    let chat = ok(
        serve.port,
        "/v1/chat/completions",
        json!({"model": "vllm-vcr/tiny", "messages": [{"role": "user", "content": "Hello, world"}],
               "max_tokens": 3, "return_token_ids": true}),
    );
    assert_eq!(chat["prompt_token_ids"], local["chat"], "{chat}");
    assert_eq!(chat["usage"]["completion_tokens"], 3, "{chat}");
    let text = ok(
        serve.port,
        "/tokenize",
        json!({"model": "tiny", "prompt": "Grüße, world"}),
    );
    assert_eq!(text["tokens"], local["text"], "{text}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// A user's model directory: the embedded model's files with a bigger vocabulary (BPE
/// merges for a few words, so `" the"` is one token past the embedded 259) and another
/// chat template (`role: content`). Returns the vocabulary's size.
fn write_user_model(dir: &Path) -> u32 {
    let mut tokenizer: Value =
        serde_json::from_str(&vllm_vcr::tiny_model::tokenizer_json_text()).unwrap();
    let mut next = vllm_vcr::tiny_model::TOKENIZER_VOCAB;
    let mut merges = Vec::new();
    let model = &mut tokenizer["model"];
    for word in ["Ġthe", "Ġand", "Ġworld", "ing"] {
        let chars: Vec<String> = word.chars().map(String::from).collect();
        let mut joined = chars[0].clone();
        for c in &chars[1..] {
            merges.push(json!(format!("{joined} {c}")));
            joined.push_str(c);
            if model["vocab"].get(&joined).is_none() {
                model["vocab"][&joined] = json!(next);
                next += 1;
            }
        }
    }
    model["merges"] = Value::Array(merges);
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}";
    std::fs::create_dir_all(dir).unwrap();
    for (name, contents) in vllm_vcr::tiny_model::files() {
        let mut v: Value = match name {
            "chat_template.jinja" => {
                std::fs::write(dir.join(name), template).unwrap();
                continue;
            }
            "tokenizer.json" => tokenizer.clone(),
            _ => serde_json::from_str(&contents).unwrap(),
        };
        match name {
            "config.json" => v["vocab_size"] = json!(next),
            "tokenizer_config.json" => v["chat_template"] = json!(template),
            _ => {}
        }
        std::fs::write(dir.join(name), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
    next
}

#[test]
fn serve_model_dir_serves_a_users_tokenizer_and_chat_template() {
    let tmp = TestDir::new("serve-user-model");
    let dir = tmp.path("my-model");
    let size = write_user_model(&dir);
    let vocab = Vocabulary::load(&dir).unwrap();
    assert_eq!(vocab.size(), size);
    let mut serve = Serve::start(&["--model", dir.to_str().unwrap()]);
    let (_, frontend_pid) = serve.wait_ready();
    let dir = dir.canonicalize().unwrap();
    assert_eq!(banner_value(&serve, "model"), "my-model");
    assert_eq!(banner_value(&serve, "tokenizer"), dir.display().to_string());

    // the frontend tokenizes with the user's tokenizer: " the" is one merged token
    let text = " the world and a thing";
    let tokens = ok(
        serve.port,
        "/tokenize",
        json!({"model": "my-model", "prompt": text}),
    );
    assert_eq!(ids(&tokens["tokens"]), vocab.encode(text), "{tokens}");
    assert!(
        ids(&tokens["tokens"]).iter().filter(|&&t| t >= 259).count() >= 4,
        "the merged words: {tokens}"
    );

    // a chat renders with the user's template, and the answer's ids are the user's
    let chat = ok(
        serve.port,
        "/v1/chat/completions",
        json!({"model": "my-model", "messages": [{"role": "user", "content": "Hello the world"}],
               "max_tokens": 24, "ignore_eos": true, "return_token_ids": true}),
    );
    let rendered = "<|im_start|>user: Hello the world<|im_end|>\n<|im_start|>assistant: ";
    assert_eq!(
        ids(&chat["prompt_token_ids"]),
        vocab.encode(rendered),
        "{chat}"
    );
    let answer = ids(&chat["choices"][0]["token_ids"]);
    assert_eq!(answer.len(), 24, "{chat}");
    assert!(
        answer.iter().all(|&t| t < size),
        "ids past the vocabulary: {chat}"
    );
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        vocab.decode(&answer).as_str(),
        "{chat}"
    );
    assert_eq!(chat["usage"]["completion_tokens"], 24, "{chat}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// A number of `vllm-rs bench serve`'s report (`Successful requests:` …).
fn report_number(report: &str, name: &str) -> u64 {
    report
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name:?} in the benchmark's report:\n{report}"))
}

/// `vllm-rs bench serve` (0.33) of `n` prompts against `base` with `flags`, offline, the
/// Hugging Face cache in `hf_home`: its report, its log, and both with the flags for a
/// failure message. Fails the test when the bench exits non-zero.
fn bench_serve(base: &str, hf_home: &str, n: u64, flags: &[&str]) -> (String, String, String) {
    let out = Command::new(vllm_rs("0.33.0"))
        .args(["bench", "serve", "--base-url", base])
        .args(["--num-prompts", &n.to_string()])
        .args(flags)
        .env("HF_HOME", hf_home)
        .env("HF_HUB_OFFLINE", "1")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let (report, log) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    let all = format!("{flags:?}:\n{report}\n{log}");
    assert!(out.status.success(), "{all}");
    (report, log, all)
}

/// The frontend's counters of prompt and generated tokens (every model name).
fn token_counters(port: u16) -> (u64, u64) {
    let samples = parse_metrics(&http_get(port, "/metrics").text());
    let sum = |name| metric_sum(&samples, name, &[]).unwrap_or(0.0) as u64;
    (
        sum("vllm:prompt_tokens_total"),
        sum("vllm:generation_tokens_total"),
    )
}

/// What a user runs from the banner: `vllm-rs bench serve` with the tokenizer's id, offline,
/// either as the model name alone or as `--tokenizer` beside `--model tiny`. Every request
/// succeeds, the bench loads the tokenizer itself (not the server-side fallback that used
/// to send empty prompts), and its token counts are the server's.
#[test]
fn vllm_rs_bench_serve_loads_the_tokenizer_by_its_id() {
    let tmp = TestDir::new("serve-bench-tokenizer");
    // HF_HOME, not HF_HUB_CACHE: vllm-rs 0.33's bench reads only the former
    let hf_home = tmp.path("hf");
    let hf_home = hf_home.to_str().unwrap();
    let mut serve = Serve::start_with_env(&[], &[("HF_HOME", hf_home)]);
    let (_, frontend_pid) = serve.wait_ready();
    let base = format!("http://127.0.0.1:{}", serve.port);
    const N: u64 = 12;
    for flags in [
        &["--model", "vllm-vcr/tiny"][..],
        &["--model", "tiny", "--tokenizer", "vllm-vcr/tiny"],
    ] {
        let (prompt_before, generated_before) = token_counters(serve.port);
        // random ids go out as ids: as text, the byte-level vocabulary's ids 131-258
        // (bytes 128-255) are not UTF-8 alone (docs/serve.md, round-trip vocabulary)
        let mut args = flags.to_vec();
        args.extend(["--prompt-token-ids", "--random-input-len", "40"]);
        args.extend(["--random-output-len", "10"]);
        let (report, log, all) = bench_serve(&base, hf_home, N, &args);
        assert!(
            log.contains("loaded tokenizer model=\"vllm-vcr/tiny\" kind=\"local\""),
            "the bench did not load the tokenizer itself: {all}"
        );
        assert_eq!(report_number(&report, "Successful requests:"), N, "{all}");
        assert_eq!(report_number(&report, "Failed requests:"), 0, "{all}");
        let input = report_number(&report, "Total input tokens:");
        let generated = report_number(&report, "Total generated tokens:");
        assert_eq!((input, generated), (N * 40, N * 10), "{all}");
        let (prompt_after, generated_after) = token_counters(serve.port);
        assert_eq!(
            (
                prompt_after - prompt_before,
                generated_after - generated_before
            ),
            (input, generated),
            "the server's usage differs from the bench's counts: {all}"
        );
    }
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// `serve --tiny-vocab chars`, for random-id prompt generators: `vllm-rs bench serve`'s
/// default `random` dataset sends its prompts as text (decoded random ids, checked against
/// the server's tokenization, which never converged with the byte-level vocabulary), and
/// every prompt arrives as exactly the tokens it was drawn as. Non-ASCII input and a JSON
/// schema still work.
#[test]
fn random_id_prompts_arrive_whole_with_the_chars_vocabulary() {
    let tmp = TestDir::new("serve-chars-vocab");
    let hf_home = tmp.path("hf");
    let hf_home = hf_home.to_str().unwrap();
    let mut serve = Serve::start_with_env(&["--tiny-vocab", "chars"], &[("HF_HOME", hf_home)]);
    let (_, frontend_pid) = serve.wait_ready();
    assert!(
        banner_value(&serve, "tokenizer").starts_with("vllm-vcr/tiny-chars ("),
        "{:?}",
        serve.banner
    );
    let base = format!("http://127.0.0.1:{}", serve.port);
    const N: u64 = 16;
    let (prompt_before, _) = token_counters(serve.port);
    let flags = [
        "--model",
        "vllm-vcr/tiny-chars",
        "--random-input-len",
        "200",
    ];
    let (report, log, all) = bench_serve(&base, hf_home, N, &flags);
    assert!(
        !log.contains("prompt_token_ids") && log.contains("kind=\"local\""),
        "the prompts should go out as text, tokenized locally: {all}"
    );
    assert_eq!(report_number(&report, "Successful requests:"), N, "{all}");
    assert_eq!(
        report_number(&report, "Total input tokens:"),
        N * 200,
        "{all}"
    );
    let (prompt_after, _) = token_counters(serve.port);
    assert_eq!(
        prompt_after - prompt_before,
        N * 200,
        "the server's count: {all}"
    );

    let chat = ok(
        serve.port,
        "/v1/chat/completions",
        json!({"model": "tiny", "max_tokens": 60, "return_token_ids": true,
               "messages": [{"role": "user", "content": "Grüße aus 東京 — “quoted”"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "city",
                   "schema": {"type": "object", "required": ["città"],
                              "properties": {"città": {"type": "string"}}}}}}),
    );
    let content = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {chat}"));
    assert!(parsed["città"].is_string(), "{chat}");
    let unk = vllm_vcr::tiny_model::CHARS_UNK_TOKEN_ID;
    let prompt = ids(&chat["prompt_token_ids"]);
    assert_eq!(
        prompt.iter().filter(|&&t| t == unk).count(),
        2,
        "東京: {chat}"
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

#[test]
fn tiny_vocab_is_for_the_embedded_model_only() {
    let err = vcr()
        .args(["serve", "--tiny-vocab", "chars", "--model", "/nonexistent"])
        .run_failing();
    assert!(
        err.contains("--tiny-vocab") && err.contains("--model"),
        "{err}"
    );
}
