//! The closed-loop agent: recorded against the real CPU engine, replayed by prefix.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, ensure};
use serde_json::{Value, json};

use super::client::{Seen, miss_is_visible};
use super::*;

// ------------------------------------------------------------------ 3. agent

pub(super) const AGENT_TURNS: usize = 5;
pub(super) const AGENT_MAX_TOKENS: u32 = 16;

/// The first prompt: longer than one 128-token block (the tokenizer is byte-level: one
/// token per ASCII byte).
pub(super) const AGENT_TASK: &str = "You are a build agent working in a Rust repository. You may call one tool per \
turn: `run <command>`. After each call the tool's output is appended below. Keep answers short.\n\
Task: make `cargo test` pass, then report what you changed.\nAgent: run cargo test\n";

/// The tool output appended after turn `turn`'s answer. At 150+ bytes it fills the block
/// in which a changed output first differs, so a change is a full-block mismatch.
pub(super) fn tool_output(turn: usize, changed: bool) -> String {
    let verdict = if changed {
        "FAILED: 3 passed, 1 failed (tests::replay_agent_turn)"
    } else {
        "ok: 4 passed, 0 failed, 0 ignored; finished in 0.42 s"
    };
    format!(
        "\n[tool output, turn {turn}] test result: {verdict}. Running unittests src/lib.rs \
         (target/debug/deps/agent-0a1b2c3d); doc-tests agent: 0 passed.\nAgent:"
    )
}

/// One turn of the agent as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Turn {
    prompt: String,
    status: u16,
    text: String,
    finish: String,
    usage: String,
    /// The body of an error response.
    error: String,
}

/// Run the agent: turn N+1's prompt is turn N's prompt, its answer and the tool output.
/// With `change_last`, the tool output before the last turn differs. Stops at an error.
pub(super) fn agent_run(http: &Client, change_last: bool) -> Result<Vec<Turn>> {
    let mut prompt = AGENT_TASK.to_string();
    let mut turns = Vec::new();
    for turn in 0..AGENT_TURNS {
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": AGENT_MAX_TOKENS,
                          "temperature": 0});
        let r = http.post("/v1/completions", &body)?;
        if r.status != 200 {
            turns.push(Turn {
                prompt: prompt.clone(),
                status: r.status,
                text: String::new(),
                finish: String::new(),
                usage: String::new(),
                error: r.text(),
            });
            break;
        }
        let v = r.json()?;
        let c = &v["choices"][0];
        let text = c["text"].as_str().unwrap_or_default().to_string();
        turns.push(Turn {
            prompt: prompt.clone(),
            status: r.status,
            text: text.clone(),
            finish: c["finish_reason"].as_str().unwrap_or_default().to_string(),
            usage: v["usage"].to_string(),
            error: String::new(),
        });
        let changed = change_last && turn + 2 == AGENT_TURNS;
        prompt = format!("{prompt}{text}{}", tool_output(turn, changed));
    }
    Ok(turns)
}

pub(super) fn agent(
    env: &Env,
    rs: &Path,
    line: &str,
    cpu: &Path,
    dir: &Path,
    out: &mut Checks,
) -> Result<()> {
    let frontend = Frontend::Rs {
        bin: rs.to_path_buf(),
    };
    let t = Instant::now();
    let trace = dir.join("record").join("trace.jsonl.gz");
    let stack = start_stack(
        env.engine_bin,
        &frontend,
        &[],
        env.real_model,
        Some(&trace),
        Backend::Cpu {
            venv: cpu,
            args: Vec::new(),
        },
        &dir.join("record"),
    )?;
    let boot = t.elapsed().as_secs_f64();
    let recorded = agent_run(&stack.http, false);
    let tap = stack.stop();
    let recorded = recorded?;
    out.push(
        "record the agent against the real engine",
        t,
        (|| {
            ensure!(tap.contains("exit status: 0"), "the tap ended: {tap}");
            ensure!(
                recorded.len() == AGENT_TURNS && recorded.iter().all(|t| t.status == 200),
                "the agent did not complete: {recorded:?}"
            );
            let (meta, records) = read_by_arrival(&trace)?;
            ensure!(
                meta.block_size == Some(CPU_BLOCK_SIZE),
                "block size {:?}, want {CPU_BLOCK_SIZE}",
                meta.block_size
            );
            ensure!(
                records.len() == AGENT_TURNS,
                "{} records for {AGENT_TURNS} turns",
                records.len()
            );
            let prompts: Vec<u32> = records.iter().map(|r| r.prompt_tokens).collect();
            ensure!(
                prompts.iter().all(|&p| p > CPU_BLOCK_SIZE),
                "prompt lengths {prompts:?}: every one must exceed a {CPU_BLOCK_SIZE}-token block"
            );
            Ok(format!(
                "{AGENT_TURNS} turns, prompts of {prompts:?} tokens ({:?} blocks), finishes {:?}; engine boot {boot:.1} s",
                records.iter().map(|r| r.block_hashes.len()).collect::<Vec<_>>(),
                recorded.iter().map(|t| t.finish.as_str()).collect::<Vec<_>>()
            ))
        })(),
    );

    let replay = |name: &str, miss: &str, change_last: bool| -> Result<(Vec<Turn>, Value)> {
        let run = dir.join(name);
        let summary = run.join("summary.json");
        let stack = start_stack(
            env.engine_bin,
            &frontend,
            &[],
            env.real_model,
            None,
            Backend::Play {
                line,
                args: replay_flags(
                    &trace,
                    "prefix",
                    miss,
                    &summary,
                    &["--block-size", &CPU_BLOCK_SIZE.to_string()],
                ),
            },
            &run,
        )?;
        let turns = agent_run(&stack.http, change_last);
        stack.stop();
        Ok((turns?, read_summary(&summary)?))
    };

    let t = Instant::now();
    out.push(
        "replay by prefix: the same transcript",
        t,
        replay("replay-same", "fail", false).and_then(|(turns, s)| {
            ensure!(
                turns == recorded,
                "transcripts differ:\n  recorded {recorded:?}\n  replayed {turns:?}"
            );
            let Counts { served, missed, .. } = summary_counts(&s, "tokens")?;
            ensure!(
                served == AGENT_TURNS as u64 && missed.is_empty(),
                "summary: served {served}, missed {missed:?}"
            );
            Ok(format!(
                "{AGENT_TURNS} turns identical (prompt, text, finish, usage); served {served}, missed 0; prefix depths {}",
                s["tokens"]["prefix_depth"]
            ))
        }),
    );

    let t = Instant::now();
    out.push(
        "changed last tool output (--replay-miss random): only the last turn misses",
        t,
        replay("replay-changed", "random", true).and_then(|(turns, s)| {
            ensure!(turns.len() == AGENT_TURNS, "transcript: {turns:?}");
            let last = AGENT_TURNS - 1;
            ensure!(
                turns[..last] == recorded[..last],
                "the turns before the last differ:\n  recorded {:?}\n  replayed {:?}",
                &recorded[..last],
                &turns[..last]
            );
            ensure!(
                turns[last].status == 200 && turns[last].text != recorded[last].text,
                "last turn: {:?}, recorded {:?}: the answer should differ",
                turns[last],
                recorded[last]
            );
            let Counts { served, missed, .. } = summary_counts(&s, "tokens")?;
            ensure!(
                served == last as u64 && missed == vec![("partial_prefix".to_string(), 1)],
                "summary: served {served}, missed {missed:?}; want {last} and partial_prefix 1"
            );
            Ok(format!(
                "turns 1-{last} identical, turn {AGENT_TURNS} answered {:?} instead of {:?}; served {served}, missed partial_prefix 1",
                snippet(&turns[last].text),
                snippet(&recorded[last].text)
            ))
        }),
    );

    let t = Instant::now();
    let run = dir.join("replay-changed-fail");
    out.push(
        "changed last tool output (--replay-miss fail): that request errors, saying why",
        t,
        replay("replay-changed-fail", "fail", true).and_then(|(turns, s)| {
            let last = AGENT_TURNS - 1;
            ensure!(
                turns.len() == AGENT_TURNS && turns[..last] == recorded[..last],
                "the turns before the last differ or stopped early: {turns:?}"
            );
            let Counts { missed, .. } = summary_counts(&s, "tokens")?;
            ensure!(
                missed == vec![("partial_prefix".to_string(), 1)],
                "missed {missed:?}"
            );
            let p = Seen {
                label: "last turn".into(),
                id: String::new(),
                status: turns[last].status,
                view: if turns[last].status == 200 {
                    turns[last].text.clone()
                } else {
                    turns[last].error.clone()
                },
            };
            miss_is_visible(&p, &run.join("engine.log"), "partial_prefix")
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_tool_output_change_lands_in_a_full_block() {
        // the changed output differs with at least a block still to come, so the block
        // where it differs is full (prefix matching ignores the last, partial block)
        let (a, b) = (tool_output(3, false), tool_output(3, true));
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(
            a.len() - common >= CPU_BLOCK_SIZE as usize,
            "{}",
            a.len() - common
        );
        assert!(
            b.len() - common >= CPU_BLOCK_SIZE as usize,
            "{}",
            b.len() - common
        );
        assert!(AGENT_TASK.len() > CPU_BLOCK_SIZE as usize);
    }
}
