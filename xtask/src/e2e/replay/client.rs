//! What a client sends and sees in the round trip: requests, and the views compared across runs.

use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::*;

// ------------------------------------------------------------------ what a client sees

/// One request of a workload.
pub(super) struct Req {
    pub(super) label: String,
    pub(super) chat: bool,
    pub(super) stream: bool,
    pub(super) body: Value,
}

/// What the client got: the response id and everything compared across runs.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) label: String,
    pub(super) id: String,
    pub(super) status: u16,
    /// Non-streamed: `{"choices", "usage"}` as sent; streamed: the joined text, the
    /// finish and stop reasons and the usage chunk; an error: the body.
    pub(super) view: String,
}

pub(super) fn send(http: &Client, req: &Req, request_id: Option<&str>) -> Result<Seen> {
    let path = if req.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let headers: Vec<(&str, &str)> = request_id
        .map(|id| ("X-Request-Id", id))
        .into_iter()
        .collect();
    if !req.stream {
        let r = http.request_with("POST", path, Some(&req.body), &headers)?;
        if r.status != 200 {
            return Ok(Seen {
                label: req.label.clone(),
                id: String::new(),
                status: r.status,
                view: r.text(),
            });
        }
        let mut v = r.json()?;
        // tool-call ids are drawn by the frontend for each response
        for c in v["choices"].as_array_mut().into_iter().flatten() {
            for call in c["message"]["tool_calls"]
                .as_array_mut()
                .into_iter()
                .flatten()
            {
                call["id"] = Value::Null;
            }
        }
        return Ok(Seen {
            label: req.label.clone(),
            id: v["id"].as_str().unwrap_or_default().to_string(),
            status: r.status,
            view: json!({"choices": v["choices"], "usage": v["usage"]}).to_string(),
        });
    }
    let mut s = http.post_sse_with(path, &req.body, &headers)?;
    if s.status != 200 {
        let status = s.status;
        return Ok(Seen {
            label: req.label.clone(),
            id: String::new(),
            status,
            view: s.rest(),
        });
    }
    let (mut id, mut text, mut finish, mut stop, mut usage) = (
        String::new(),
        String::new(),
        Value::Null,
        Value::Null,
        Value::Null,
    );
    let mut errors = Vec::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    while let Some(data) = s.next_data()? {
        if data.trim() == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&data)
            .with_context(|| format!("{}: event is not JSON: {}", req.label, snippet(&data)))?;
        if v.get("error").is_some() {
            errors.push(v["error"].to_string());
            continue;
        }
        if id.is_empty() {
            id = v["id"].as_str().unwrap_or_default().to_string();
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let piece = if req.chat {
                c["delta"]["content"].as_str()
            } else {
                c["text"].as_str()
            };
            text.push_str(piece.unwrap_or(""));
            for tc in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().unwrap_or(0) as usize;
                if calls.len() <= i {
                    calls.resize(i + 1, (String::new(), String::new()));
                }
                calls[i]
                    .0
                    .push_str(tc["function"]["name"].as_str().unwrap_or(""));
                calls[i]
                    .1
                    .push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
            }
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
            if !c["stop_reason"].is_null() {
                stop = c["stop_reason"].clone();
            }
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            usage = v["usage"].clone();
        }
    }
    let mut view =
        json!({"text": text, "finish_reason": finish, "stop_reason": stop, "usage": usage});
    if !errors.is_empty() {
        view["errors"] = json!(errors);
    }
    if !calls.is_empty() {
        view["tool_calls"] = json!(calls);
    }
    Ok(Seen {
        label: req.label.clone(),
        id,
        status: 200,
        view: view.to_string(),
    })
}

/// `recorded` and `replayed` are the same, request by request (ids aside).
pub(super) fn same_views(recorded: &[Seen], replayed: &[Seen]) -> Result<String> {
    ensure!(
        recorded.len() == replayed.len(),
        "{} responses recorded, {} replayed",
        recorded.len(),
        replayed.len()
    );
    for (a, b) in recorded.iter().zip(replayed) {
        ensure!(
            a.status == b.status && a.view == b.view,
            "{}: recorded HTTP {} {}\n  replayed HTTP {} {}",
            a.label,
            a.status,
            a.view,
            b.status,
            b.view
        );
    }
    Ok(format!(
        "{} responses: statuses, text, finish and stop reasons and usage equal byte for byte",
        recorded.len()
    ))
}

/// A request that missed under `--replay-miss fail` failed visibly; the detail quotes
/// what the client got and where the reason can be read.
pub(super) fn miss_is_visible(p: &Seen, engine_log: &Path, kind: &str) -> Result<String> {
    let failed = p.status != 200 || p.view.contains("\"error\"");
    ensure!(
        failed,
        "the unrecorded request succeeded: HTTP {} {}",
        p.status,
        snippet(&p.view)
    );
    let log = read_log(engine_log);
    let line = log
        .lines()
        .find(|l| l.contains("replay miss") && l.contains(kind))
        .map(str::trim)
        .with_context(|| format!("the engine log has no `replay miss` line of kind {kind}"))?;
    let body_says_why = p.view.contains("record") || p.view.contains("replay");
    Ok(format!(
        "client got HTTP {} {}; the body {} the reason; engine log: {}",
        p.status,
        snippet(&p.view),
        if body_says_why {
            "gives"
        } else {
            "does NOT give"
        },
        snippet(line.split("replay miss:").nth(1).unwrap_or(line))
    ))
}
