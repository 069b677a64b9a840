//! Engine outputs per vLLM line: the array layouts, trimming, envelopes and scheduler
//! stats, decoding's layout detection and the errors that name a bad field.

use crate::helpers::{arr, boxed, line, mp, output_arrays, parse, s, step};
use rmpv::Value;
use sim_protocol::decode::{
    DecodeErrorKind, DecodedOutputs, decode_input, decode_outputs, decode_outputs_for,
};
use sim_protocol::encode::{EncodeError, EncodeOptions, encode_outputs, encode_request};
use sim_protocol::*;

fn with_prefill() -> EngineCoreOutput {
    EngineCoreOutput {
        request_id: "r".into(),
        new_token_ids: vec![5].into(),
        events: vec![
            EngineCoreEvent {
                kind: EventType::Queued,
                timestamp: 1.0,
            },
            EngineCoreEvent {
                kind: EventType::Scheduled,
                timestamp: 1.25,
            },
        ],
        prefill_stats: Some(Box::new(PrefillStats {
            num_prompt_tokens: 2,
            num_computed_tokens: 1,
            num_cached_tokens: 1,
            num_local_cached_tokens: 1,
            num_external_cached_tokens: 0,
            num_cache_creation_tokens: 1,
        })),
        ..Default::default()
    }
}

#[test]
fn prefill_stats_sit_at_index_10_on_025_and_11_from_026() {
    let out = step(vec![with_prefill()]);
    let o25 = &output_arrays(&encode_outputs(line(25), &out).unwrap())[0];
    assert_eq!(o25.len(), 11);
    assert!(o25[10].is_map());
    assert_eq!(
        o25[10].as_map().unwrap().len(),
        5,
        "0.25 has no num_cache_creation_tokens"
    );
    for m in 26..=33 {
        let o = &output_arrays(&encode_outputs(line(m), &out).unwrap())[0];
        assert_eq!(o.len(), 12, "0.{m}");
        assert!(o[11].is_map());
        assert_eq!(o[11].as_map().unwrap().len(), 6, "0.{m}");
        assert!(o[9].is_nil() && o[10].is_nil());
    }
    // both decode back to the same output, by line and by detection
    for m in 25..=33 {
        let frames = encode_outputs(line(m), &out).unwrap();
        let DecodedOutputs::Outputs(back) = decode_outputs(&frames).unwrap() else {
            panic!()
        };
        let mut expect = out.clone();
        if m == 25 {
            expect.outputs[0]
                .prefill_stats
                .as_mut()
                .unwrap()
                .num_cache_creation_tokens = 0;
        }
        assert_eq!(back, expect, "0.{m}");
        assert_eq!(
            decode_outputs_for(line(m), &frames).unwrap(),
            DecodedOutputs::Outputs(expect)
        );
    }
}

#[test]
fn events_are_maps_with_type_and_float_timestamp() {
    let o = &output_arrays(&encode_outputs(line(33), &step(vec![with_prefill()])).unwrap())[0];
    assert_eq!(
        o[7],
        arr(vec![
            Value::Map(vec![
                (s("type"), Value::from(1)),
                (s("timestamp"), Value::F64(1.0))
            ]),
            Value::Map(vec![
                (s("type"), Value::from(2)),
                (s("timestamp"), Value::F64(1.25))
            ]),
        ])
    );
}

#[test]
fn num_nans_on_025_is_an_int_at_index_12_never_nil() {
    let o = EngineCoreOutput {
        request_id: "r".into(),
        new_token_ids: vec![1].into(),
        num_nans_in_logits: 3,
        ..Default::default()
    };
    let a = &output_arrays(&encode_outputs(line(25), &step(vec![o.clone()])).unwrap())[0];
    assert_eq!(a.len(), 13);
    assert_eq!(a[12], Value::from(3));
    let a = &output_arrays(&encode_outputs(line(26), &step(vec![o])).unwrap())[0];
    assert_eq!(a.len(), 14);
    assert_eq!(a[13], Value::from(3));
    // every field set: 0.25 index 12 is still the int (0), never nil
    let full = EngineCoreOutput {
        routed_experts: boxed(arr(vec![s("<i4"), arr(vec![]), Value::Ext(3, vec![])])),
        error: Some(Box::new(RequestError {
            code: "c".into(),
            message: "m".into(),
            retryable: true,
        })),
        ..with_prefill()
    };
    let a = &output_arrays(&encode_outputs(line(25), &step(vec![full.clone()])).unwrap())[0];
    assert_eq!(a.len(), 12, "trimmed after routed_experts; error dropped");
    let with_nans = EngineCoreOutput {
        num_nans_in_logits: 1,
        ..full
    };
    let a = &output_arrays(&encode_outputs(line(25), &step(vec![with_nans])).unwrap())[0];
    assert_eq!(a.len(), 13);
    assert!(matches!(a[12], Value::Integer(_)));
}

#[test]
fn arrays_never_exceed_the_line_layout() {
    let everything = EngineCoreOutput {
        request_id: "r".into(),
        new_token_ids: vec![1, 2].into(),
        finish_reason: Some(FinishReason::Error),
        stop_reason: Some(StopReason::Text("repetition_detected".into())),
        ec_transfer_params: boxed(Value::Map(vec![])),
        num_nans_in_logits: 1,
        mm_cache_miss_hashes: Some(vec!["h".into()]),
        new_sampling_mask: boxed(Value::Nil),
        spec_decode_metrics: boxed(RequestSpecDecodeMetrics {
            num_spec_tokens: 2,
            histogram: vec![1, 2, 3],
            ..Default::default()
        }),
        prompt_token_id_logprobs: boxed(Value::from(1)),
        error: Some(Box::new(RequestError {
            code: "engine_paused".into(),
            message: "paused".into(),
            retryable: true,
        })),
        ..with_prefill()
    };
    let env = EngineCoreOutputs {
        engine_index: 0,
        outputs: vec![everything],
        scheduler_stats: Some(Box::default()),
        timestamp: 1.0,
        finished_requests: Some(vec!["r".into()]),
        wave_complete: Some(1),
        start_wave: Some(2),
        weight_version: Some("v7".into()),
        ..Default::default()
    };
    for m in 25..=33 {
        let l = line(m);
        let frames = encode_outputs(l, &env).unwrap();
        let v = parse(&frames[0]);
        let outer = v.as_array().unwrap();
        assert_eq!(outer.len(), l.outputs_len(), "0.{m}");
        let inner = outer[1].as_array().unwrap()[0].as_array().unwrap();
        assert_eq!(inner.len(), l.output_layout().len(), "0.{m}");
        if m >= 32 {
            assert_eq!(outer[8], s("v7"));
        }
        if m == 33 {
            assert!(inner[18].is_map());
        }
        if m == 32 {
            // error dropped: the last field is prompt_token_id_logprobs
            assert_eq!(inner[17], Value::from(1));
        }
        // and it decodes with the line's layout
        let DecodedOutputs::Outputs(back) = decode_outputs_for(l, &frames).unwrap() else {
            panic!()
        };
        assert_eq!(back.outputs[0].finish_reason, Some(FinishReason::Error));
        assert_eq!(back.outputs[0].num_nans_in_logits, 1);
        assert_eq!(back.weight_version.is_some(), m >= 32);
        assert_eq!(back.outputs[0].error.is_some(), m >= 33);
    }
}

#[test]
fn minimal_outputs_are_trimmed_to_id_and_tokens() {
    let env = step(vec![EngineCoreOutput {
        request_id: "req".into(),
        new_token_ids: vec![5].into(),
        ..Default::default()
    }]);
    let frames = encode_outputs(line(33), &env).unwrap();
    assert_eq!(
        parse(&frames[0]),
        arr(vec![
            Value::from(0),
            arr(vec![arr(vec![s("req"), arr(vec![Value::from(5)])])]),
            Value::Nil,
            Value::F64(12.5)
        ])
    );
    let fin = step(vec![EngineCoreOutput {
        request_id: "req".into(),
        new_token_ids: vec![].into(),
        finish_reason: Some(FinishReason::Stop),
        stop_reason: Some(StopReason::Token(7)),
        ..Default::default()
    }]);
    let o = &output_arrays(&encode_outputs(line(25), &fin).unwrap())[0];
    assert_eq!(
        o,
        &vec![
            s("req"),
            arr(vec![]),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::from(0),
            Value::from(7)
        ]
    );
}

#[test]
fn envelopes_vllm_rs_would_die_on_are_refused() {
    assert_eq!(
        encode_outputs(line(33), &EngineCoreOutputs::default()),
        Err(EncodeError::EmptyEnvelope)
    );
    let only_ts = EngineCoreOutputs {
        timestamp: 3.0,
        weight_version: Some("x".into()),
        ..Default::default()
    };
    assert_eq!(
        encode_outputs(line(33), &only_ts),
        Err(EncodeError::EmptyEnvelope)
    );
    let mixed = EngineCoreOutputs {
        utility_output: Some(UtilityOutput {
            call_id: CallId::Unsigned(1),
            outcome: Ok(Value::Nil),
        }),
        ..step(vec![with_prefill()])
    };
    assert_eq!(
        encode_outputs(line(33), &mixed),
        Err(EncodeError::MixedEnvelope)
    );
    // stats alone are a valid request-batch message
    let stats = EngineCoreOutputs {
        scheduler_stats: Some(Box::default()),
        ..Default::default()
    };
    assert!(encode_outputs(line(33), &stats).is_ok());
}

#[test]
fn scheduler_stats_carry_every_033_key() {
    let stats = SchedulerStats {
        num_running_reqs: 3,
        num_waiting_reqs: 1,
        kv_cache_usage: 0.25,
        step_counter: 9,
        prefix_cache_stats: PrefixCacheStats {
            queries: 16,
            hits: 8,
            requests: 1,
            ..Default::default()
        },
        spec_decoding_stats: Some(SpecDecodingStats {
            num_spec_tokens: 2,
            num_drafts: 1,
            num_draft_tokens: 2,
            num_accepted_tokens: 1,
            num_accepted_tokens_per_pos: vec![1, 0],
            num_draft_tokens_per_pos: vec![1, 1],
        }),
        running_lora_adapters: vec![("l1".into(), 2)],
        waiting_lora_adapters: vec![],
        ..Default::default()
    };
    let env = EngineCoreOutputs {
        scheduler_stats: Some(Box::new(stats.clone())),
        timestamp: 1.0,
        ..Default::default()
    };
    let v = parse(&encode_outputs(line(25), &env).unwrap()[0]);
    let m = v[2].as_map().unwrap();
    let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    assert_eq!(
        keys,
        [
            "num_running_reqs",
            "num_waiting_reqs",
            "num_skipped_waiting_reqs",
            "num_kv_fetch_reqs_by_stage",
            "step_counter",
            "current_wave",
            "kv_cache_usage",
            "iteration_details",
            "prefix_cache_stats",
            "connector_prefix_cache_stats",
            "kv_cache_eviction_events",
            "spec_decoding_stats",
            "kv_connector_stats",
            "ec_connector_stats",
            "waiting_lora_adapters",
            "running_lora_adapters",
            "cudagraph_stats",
            "perf_stats"
        ]
    );
    let get = |k: &str| &m.iter().find(|(x, _)| x.as_str() == Some(k)).unwrap().1;
    assert_eq!(get("kv_cache_usage"), &Value::F64(0.25));
    assert_eq!(get("kv_cache_eviction_events"), &arr(vec![]));
    let p = get("prefix_cache_stats").as_map().unwrap();
    let pkeys: Vec<&str> = p.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    assert_eq!(
        pkeys,
        [
            "reset",
            "requests",
            "queries",
            "hits",
            "preempted_requests",
            "preempted_queries",
            "preempted_hits",
            "hits_by_source"
        ]
    );
    assert_eq!(
        get("running_lora_adapters"),
        &Value::Map(vec![(s("l1"), Value::from(2))])
    );
    let DecodedOutputs::Outputs(back) =
        decode_outputs(&encode_outputs(line(33), &env).unwrap()).unwrap()
    else {
        panic!()
    };
    assert_eq!(*back.scheduler_stats.unwrap(), stats);
}

#[test]
fn decode_outputs_detects_the_025_layout() {
    // A 0.25 output with trace_headers at 9 and prefill stats at 10 (as Python 0.25 sends).
    let o25 = arr(vec![
        s("r"),
        arr(vec![Value::from(1)]),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Map(vec![(s("traceparent"), s("x"))]),
        Value::Map(vec![(s("num_prompt_tokens"), Value::from(4))]),
        Value::Nil,
        Value::from(0),
    ]);
    let env = arr(vec![
        Value::from(0),
        arr(vec![o25]),
        Value::Nil,
        Value::F64(1.0),
    ]);
    let DecodedOutputs::Outputs(out) = decode_outputs(&[mp(&env)]).unwrap() else {
        panic!()
    };
    let o = &out.outputs[0];
    assert_eq!(o.prefill_stats.as_ref().unwrap().num_prompt_tokens, 4);
    assert_eq!(
        o.trace_headers.as_deref(),
        Some(&Value::Map(vec![(s("traceparent"), s("x"))]))
    );
    assert!(o.ec_transfer_params.is_none());
}

/// Not a timed test: `cargo test --release -p sim-protocol --test codec -- --ignored --nocapture`.
#[test]
#[ignore]
fn encode_speed_of_a_256_output_step() {
    let env = EngineCoreOutputs {
        outputs: (0..256)
            .map(|i| EngineCoreOutput {
                request_id: format!("cmpl-{i:016x}-0-abcdef12").into(),
                new_token_ids: vec![1000 + i].into(),
                ..Default::default()
            })
            .collect(),
        scheduler_stats: Some(Box::default()),
        timestamp: 1234.5,
        ..Default::default()
    };
    let mut enc = sim_protocol::encode::OutputEncoder::new(line(33), EncodeOptions::default());
    let n = 20_000;
    let t = std::time::Instant::now();
    let mut bytes = 0;
    for _ in 0..n {
        bytes += enc.encode(&env).unwrap()[0].len();
    }
    let per = t.elapsed() / n;
    eprintln!(
        "encode: {per:?} per 256-output step ({} bytes)",
        bytes / n as usize
    );
    let frames = enc.encode(&env).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..2000 {
        decode_outputs(&frames).unwrap();
    }
    eprintln!("decode_outputs: {:?} per step", t.elapsed() / 2000);
    let add = encode_request(
        line(33),
        &EngineCoreRequest {
            request_id: "cmpl-1".into(),
            prompt_token_ids: Some((0..1000).collect()),
            sampling_params: Some(SamplingParams::default()),
            ..Default::default()
        },
    );
    let t = std::time::Instant::now();
    for _ in 0..20_000 {
        decode_input(&add).unwrap();
    }
    eprintln!(
        "decode_input: {:?} per 1000-token ADD",
        t.elapsed() / 20_000
    );
}

#[test]
fn a_bad_output_field_is_named_with_its_output_index() {
    // [engine_index, outputs, scheduler_stats, timestamp]: the second output's token list
    // holds a string
    let good = arr(vec![s("r0"), arr(vec![Value::from(7)])]);
    let bad = arr(vec![s("r1"), arr(vec![s("seven")])]);
    let env = arr(vec![
        Value::from(0),
        arr(vec![good, bad]),
        Value::Nil,
        Value::F64(1.0),
    ]);
    let e = decode_outputs_for(VllmLine::new(0, 33), &[mp(&env)]).unwrap_err();
    assert!(
        matches!(&e.kind, DecodeErrorKind::WrongType { field, .. } if field == "outputs[1].new_token_ids"),
        "{e}"
    );
    // the output itself not an array: named by its index alone
    let env = arr(vec![
        Value::from(0),
        arr(vec![s("oops")]),
        Value::Nil,
        Value::F64(1.0),
    ]);
    let e = decode_outputs_for(VllmLine::new(0, 33), &[mp(&env)]).unwrap_err();
    assert!(
        matches!(&e.kind, DecodeErrorKind::WrongType { field, expected: "array", .. } if field == "outputs[0]"),
        "{e}"
    );
}
