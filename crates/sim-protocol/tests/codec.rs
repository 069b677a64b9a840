//! Codec behaviour: per-line layouts, leniency, errors, and known byte sequences of the
//! handshake and messages (as msgspec encodes them for vLLM).

mod common;

use bytes::Bytes;
use common::{hex, to_hex};
use rmpv::Value;
use sim_protocol::decode::{
    DecodeErrorKind, DecodedOutputs, decode_input, decode_outputs, decode_outputs_for,
};
use sim_protocol::encode::{
    EncodeError, EncodeOptions, encode_abort, encode_outputs, encode_outputs_with, encode_request,
    encode_utility,
};
use sim_protocol::ready::{HandshakeInit, encode_status};
use sim_protocol::*;

fn mp(v: &Value) -> Bytes {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    Bytes::from(buf)
}

fn parse(b: &[u8]) -> Value {
    let mut cur = b;
    let v = rmpv::decode::read_value(&mut cur).unwrap();
    assert!(cur.is_empty(), "trailing bytes");
    v
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn arr(xs: Vec<Value>) -> Value {
    Value::Array(xs)
}

fn add_frames(payload: Value) -> Vec<Bytes> {
    vec![Bytes::from_static(&[0]), mp(&payload)]
}

/// A minimal valid 9-element ADD array.
fn add_array(id: &str) -> Vec<Value> {
    vec![
        s(id),
        arr(vec![Value::from(1), Value::from(2), Value::from(3)]),
        Value::Nil,
        Value::Map(vec![(s("max_tokens"), Value::from(7))]),
        Value::Nil,
        Value::F64(1.5),
        Value::Nil,
        Value::Nil,
        Value::Nil,
    ]
}

fn line(m: u16) -> VllmLine {
    VllmLine::new(0, m)
}

fn step(outputs: Vec<EngineCoreOutput>) -> EngineCoreOutputs {
    EngineCoreOutputs {
        outputs,
        timestamp: 12.5,
        ..Default::default()
    }
}

fn output_arrays(frames: &[Bytes]) -> Vec<Vec<Value>> {
    let v = parse(&frames[0]);
    let env = v.as_array().unwrap();
    env[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_array().unwrap().clone())
        .collect()
}

// ---------------------------------------------------------------------------------------
// known bytes

#[test]
fn handshake_status_maps_are_the_documented_bytes() {
    assert_eq!(
        to_hex(&encode_status("HELLO")),
        "83a6737461747573a548454c4c4fa56c6f63616cc2a8686561646c657373c3"
    );
    assert_eq!(
        to_hex(&encode_status("READY")),
        "83a6737461747573a55245414459a56c6f63616cc2a8686561646c657373c3"
    );
}

#[test]
fn a_captured_vllm_rs_init_round_trips_byte_for_byte() {
    let bytes = hex(
        "82a961646472657373657385a6696e7075747391b57463703a2f2f3132372e302e302e313a3433373639a76f75747075747391b57463703a2f2f3132372e302e302e313a3333333531b1636f6f7264696e61746f725f696e707574c0b2636f6f7264696e61746f725f6f7574707574c0be66726f6e74656e645f73746174735f7075626c6973685f61646472657373c0af706172616c6c656c5f636f6e66696780",
    );
    assert_eq!(bytes.len(), 161);
    let init = HandshakeInit::decode(&bytes).unwrap();
    assert_eq!(init.inputs, vec!["tcp://127.0.0.1:43769"]);
    assert_eq!(init.outputs, vec!["tcp://127.0.0.1:33351"]);
    assert_eq!(init.coordinator_input, None);
    assert_eq!(init.parallel_config, Value::Map(vec![]));
    assert_eq!(init.encode(), bytes);
}

#[test]
fn documented_vllm_rs_utility_and_abort_frames_decode() {
    let frames = vec![
        Bytes::from_static(&[3]),
        Bytes::from(hex("940001b272657365745f7072656669785f636163686592c2c2")),
    ];
    let InputMessage::Utility(call) = decode_input(&frames).unwrap() else {
        panic!("not a utility call")
    };
    assert_eq!(call.client_index, 0);
    assert_eq!(call.call_id, CallId::Unsigned(1));
    assert_eq!(call.method, "reset_prefix_cache");
    assert_eq!(
        call.args,
        vec![Value::Boolean(false), Value::Boolean(false)]
    );
    // and our frontend-side encoder produces exactly those bytes
    assert_eq!(encode_utility(&call), frames);
}

#[test]
fn utility_reply_matches_the_documented_python_form_after_decoding() {
    // Python's 9-element form of `[0, [], nil, 5.0, [7, nil, [nil, ["generate"]]], …]`.
    let python = hex("990090c0cb40140000000000009307c092c091a867656e6572617465c0c0c0c0");
    let reply = EngineCoreOutputs {
        timestamp: 5.0,
        utility_output: Some(UtilityOutput {
            call_id: CallId::Unsigned(7),
            outcome: Ok(arr(vec![s("generate")])),
        }),
        ..Default::default()
    };
    for m in 25..=33 {
        let ours = encode_outputs(line(m), &reply).unwrap();
        // Ours is trimmed after utility_output: the same bytes minus four trailing nils.
        assert_eq!(
            to_hex(&ours[0]),
            "950090c0cb40140000000000009307c092c091a867656e6572617465"
        );
        let a = decode_outputs(&ours).unwrap();
        let b = decode_outputs(&[Bytes::from(python.clone())]).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, DecodedOutputs::Outputs(reply.clone()));
    }
}

#[test]
fn utility_envelope_shape_is_idx_empty_nil_ts_reply() {
    let ok = EngineCoreOutputs {
        engine_index: 1,
        timestamp: 2.0,
        utility_output: Some(UtilityOutput {
            call_id: CallId::Unsigned(u64::MAX - 5),
            outcome: Ok(Value::Boolean(true)),
        }),
        ..Default::default()
    };
    let v = parse(&encode_outputs(line(33), &ok).unwrap()[0]);
    assert_eq!(
        v,
        arr(vec![
            Value::from(1),
            arr(vec![]),
            Value::Nil,
            Value::F64(2.0),
            arr(vec![
                Value::from(u64::MAX - 5),
                Value::Nil,
                arr(vec![Value::Nil, Value::Boolean(true)])
            ]),
        ])
    );
    // nil success still carries [nil, nil] (Python asserts the result is not None)
    let nil_ok = EngineCoreOutputs {
        utility_output: Some(UtilityOutput {
            call_id: CallId::Negative(-2),
            outcome: Ok(Value::Nil),
        }),
        ..ok.clone()
    };
    let frames = encode_outputs(line(30), &nil_ok).unwrap();
    let v = parse(&frames[0]);
    assert_eq!(
        v[4],
        arr(vec![
            Value::from(-2),
            Value::Nil,
            arr(vec![Value::Nil, Value::Nil])
        ])
    );
    let failed = EngineCoreOutputs {
        utility_output: Some(UtilityOutput {
            call_id: CallId::Unsigned(3),
            outcome: Err("Call to x method failed: boom".into()),
        }),
        ..ok
    };
    let v = parse(&encode_outputs(line(25), &failed).unwrap()[0]);
    assert_eq!(
        v[4],
        arr(vec![
            Value::from(3),
            s("Call to x method failed: boom"),
            Value::Nil
        ])
    );
}

#[test]
fn call_ids_are_echoed_verbatim_across_the_u64_range() {
    let big = 0xF123_4567_89AB_CDEF_u64; // ≥ 2^63: msgpack `cf`
    let call = UtilityCall {
        client_index: 2,
        call_id: CallId::Unsigned(big),
        method: "is_sleeping".into(),
        args: vec![],
    };
    let frames = encode_utility(&call);
    assert_eq!(&frames[1][..3], &[0x94, 0x02, 0xcf]);
    assert_eq!(decode_input(&frames).unwrap(), InputMessage::Utility(call));
    let reply = EngineCoreOutputs {
        utility_output: Some(UtilityOutput {
            call_id: CallId::Unsigned(big),
            outcome: Ok(Value::Boolean(false)),
        }),
        ..Default::default()
    };
    let enc = encode_outputs(line(33), &reply).unwrap();
    assert_eq!(
        decode_outputs(&enc).unwrap(),
        DecodedOutputs::Outputs(reply)
    );
    // a negative (reserved) id survives too
    let neg = UtilityCall {
        call_id: CallId::Negative(-1),
        client_index: 0,
        method: "m".into(),
        args: vec![],
    };
    assert_eq!(
        decode_input(&encode_utility(&neg)).unwrap(),
        InputMessage::Utility(neg)
    );
}

// ---------------------------------------------------------------------------------------
// per-line output layouts

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

fn logprobs(rows: usize, cols: usize) -> LogprobsLists {
    LogprobsLists {
        token_ids: (0..(rows * cols) as i32).collect(),
        logprobs: (0..rows * cols).map(|i| -(i as f32) / 4.0).collect(),
        ranks: (1..=rows as i64).collect(),
        rows,
        cols,
        cu_num_generated_tokens: None,
    }
}

#[test]
fn small_logprobs_are_inline_ext3_ndarrays() {
    let o = EngineCoreOutput {
        request_id: "r".into(),
        new_token_ids: vec![0].into(),
        new_logprobs: boxed(logprobs(1, 3)),
        ..Default::default()
    };
    let frames = encode_outputs(line(33), &step(vec![o.clone()])).unwrap();
    assert_eq!(frames.len(), 1);
    let a = &output_arrays(&frames)[0];
    let lp = a[2].as_array().unwrap();
    assert_eq!(lp[0][0], s("<i4"));
    assert_eq!(lp[0][1], arr(vec![Value::from(1), Value::from(3)]));
    assert!(matches!(&lp[0][2], Value::Ext(3, d) if d.len() == 12));
    assert_eq!(lp[1][0], s("<f4"));
    assert_eq!(lp[2][0], s("<i8"));
    assert_eq!(lp[2][1], arr(vec![Value::from(1)]));
    assert!(matches!(&lp[2][2], Value::Ext(3, d) if d.len() == 8));
    assert!(lp[3].is_nil());
    // the documented byte forms: 12 bytes → c7 0c 03, 8 bytes → d7 03
    let hexed = to_hex(&frames[0]);
    assert!(hexed.contains("c70c03") && hexed.contains("d703"));
    assert_eq!(
        decode_outputs(&frames).unwrap(),
        DecodedOutputs::Outputs(step(vec![o]))
    );
}

#[test]
fn large_logprobs_go_to_aux_frames_indexed_from_one() {
    let o = EngineCoreOutput {
        request_id: "r".into(),
        new_token_ids: vec![0, 1].into(),
        new_logprobs: boxed(LogprobsLists {
            cu_num_generated_tokens: Some(vec![0, 2]),
            ..logprobs(2, 3)
        }),
        ..Default::default()
    };
    let opts = EncodeOptions {
        inline_threshold: 1,
    };
    let frames = encode_outputs_with(line(33), &step(vec![o.clone()]), &opts).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(
        [frames[1].len(), frames[2].len(), frames[3].len()],
        [24, 24, 16]
    );
    let a = &output_arrays(&frames)[0];
    let lp = a[2].as_array().unwrap();
    assert_eq!(
        [&lp[0][2], &lp[1][2], &lp[2][2]],
        [&Value::from(1), &Value::from(2), &Value::from(3)]
    );
    assert_eq!(
        decode_outputs(&frames).unwrap(),
        DecodedOutputs::Outputs(step(vec![o.clone()]))
    );
    // default threshold 256: a 64×20 array (5120 B) goes out of band, ranks (512 B) too
    let big = EngineCoreOutput {
        new_logprobs: boxed(logprobs(64, 20)),
        ..o
    };
    let frames = encode_outputs(line(33), &step(vec![big.clone()])).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(
        decode_outputs(&frames).unwrap(),
        DecodedOutputs::Outputs(step(vec![big]))
    );
    // an index past the aux frames is an error, not a panic
    let truncated = &frames[..2];
    assert!(matches!(
        decode_outputs(truncated).unwrap_err().kind,
        DecodeErrorKind::BadFrameIndex {
            index: 2,
            aux: 1,
            ..
        }
    ));
}

#[test]
fn inconsistent_logprobs_are_an_encode_error() {
    let mut lp = logprobs(2, 2);
    lp.ranks.pop();
    let o = EngineCoreOutput {
        request_id: "r".into(),
        new_logprobs: boxed(lp),
        ..Default::default()
    };
    assert!(matches!(
        encode_outputs(line(33), &step(vec![o])),
        Err(EncodeError::Invalid { .. })
    ));
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

// ---------------------------------------------------------------------------------------
// lenient request decoding

#[test]
fn shorter_add_arrays_take_defaults_and_longer_ones_are_ignored() {
    let InputMessage::Add(r) = decode_input(&add_frames(arr(add_array("a")))).unwrap() else {
        panic!()
    };
    assert_eq!(r.wire_len, 9);
    assert_eq!(r.client_index, 0);
    assert_eq!(r.sampling_params.as_ref().unwrap().max_tokens, Some(7));
    assert_eq!(r.sampling_params.as_ref().unwrap().n, 1);
    assert_eq!(r.arrival_time, 1.5);

    let mut long = add_array("b");
    long.resize(22, Value::Nil);
    long[11] = Value::from(2);
    long.extend([s("future field"), Value::from(1), Value::Map(vec![])]);
    let InputMessage::Add(r) = decode_input(&add_frames(arr(long))).unwrap() else {
        panic!()
    };
    assert_eq!(r.wire_len, 25);
    assert_eq!(r.client_index, 2);
}

#[test]
fn a_missing_required_element_is_an_error_with_the_request_id() {
    let mut a = add_array("cmpl-x");
    a.truncate(8);
    a[1] = arr(vec![]);
    let mut frames = add_frames(arr(a));
    frames.push(Bytes::from_static(b"aux"));
    let e = decode_input(&frames).unwrap_err();
    assert_eq!(
        e.kind,
        DecodeErrorKind::MissingElement {
            what: "EngineCoreRequest",
            index: 8,
            field: "data_parallel_rank",
            len: 8
        }
    );
    assert_eq!(e.context.request_type, Some(RequestType::Add));
    assert_eq!(e.context.request_id.as_deref(), Some("cmpl-x"));
    let msg = e.to_string();
    assert!(
        msg.contains("ADD") && msg.contains("cmpl-x") && msg.contains("data_parallel_rank"),
        "{msg}"
    );
}

#[test]
fn wrong_element_types_are_errors_with_context() {
    let mut a = add_array("cmpl-y");
    a.resize(12, Value::Nil);
    a[5] = s("yesterday");
    a[11] = Value::from(3);
    let e = decode_input(&add_frames(arr(a))).unwrap_err();
    assert!(
        matches!(&e.kind, DecodeErrorKind::WrongType { field, expected: "float", found: "str" } if field == "arrival_time")
    );
    assert_eq!(e.context.request_id.as_deref(), Some("cmpl-y"));
    assert_eq!(e.context.client_index, Some(3));

    let bad_util = arr(vec![
        Value::from(1),
        Value::from(u64::MAX),
        s("add_lora"),
        s("not args"),
    ]);
    let e = decode_input(&[Bytes::from_static(&[3]), mp(&bad_util)]).unwrap_err();
    assert_eq!(e.context.call_id, Some(CallId::Unsigned(u64::MAX)));
    assert_eq!(e.context.method.as_deref(), Some("add_lora"));
    assert_eq!(e.context.client_index, Some(1));
    assert!(e.to_string().contains("utility `add_lora`"), "{e}");
}

#[test]
fn sampling_params_accept_float32_ints_and_nils() {
    let mut a = add_array("r");
    a[3] = Value::Map(vec![
        (s("temperature"), Value::F32(0.7)),
        (s("top_p"), Value::from(1)),
        (s("top_k"), Value::from(-1)),
        (s("max_tokens"), Value::Nil),
        (s("stop_token_ids"), Value::Nil),
        (s("seed"), Value::from(42)),
        (s("logprobs"), Value::from(5)),
        (s("min_tokens"), Value::from(2)),
        (s("ignore_eos"), Value::Boolean(true)),
        (
            s("extra_args"),
            Value::Map(vec![(s("kv_transfer_params"), Value::Map(vec![]))]),
        ),
        (s("unknown_future_key"), arr(vec![])),
        (Value::from(5), s("non-string key")),
    ]);
    let InputMessage::Add(r) = decode_input(&add_frames(arr(a))).unwrap() else {
        panic!()
    };
    let sp = r.sampling_params.unwrap();
    assert!((sp.temperature - 0.7).abs() < 1e-6);
    assert_eq!(sp.top_p, 1.0);
    assert_eq!(sp.top_k, -1);
    assert_eq!(sp.max_tokens, None);
    assert!(sp.stop_token_ids.is_empty());
    assert_eq!(sp.seed, Some(42));
    assert_eq!(sp.logprobs, Some(5));
    assert_eq!(sp.min_tokens, 2);
    assert!(sp.ignore_eos);
    assert_eq!(sp.eos_token_id, None);
    assert!(sp.extra_args.is_some());
}

#[test]
fn lora_requests_of_6_and_7_elements_read_name_id_path() {
    for lora in [
        arr(vec![
            s("l1"),
            Value::from(1),
            s("/tmp/l1"),
            Value::Nil,
            Value::Boolean(false),
            Value::Boolean(false),
        ]),
        arr(vec![
            s("l1"),
            Value::from(1),
            s("/tmp/l1"),
            Value::Nil,
            Value::Nil,
            Value::Boolean(false),
            Value::Boolean(false),
        ]),
    ] {
        let mut a = add_array("r");
        a[6] = lora;
        let InputMessage::Add(r) = decode_input(&add_frames(arr(a))).unwrap() else {
            panic!()
        };
        assert_eq!(
            r.lora_request,
            Some(LoRARequest {
                name: "l1".into(),
                int_id: 1,
                path: "/tmp/l1".into()
            })
        );
    }
}

#[test]
fn prompt_embeds_resolve_inline_and_aux_frames_and_reject_shm_handles() {
    let triple = |data: Value| {
        arr(vec![
            s("bfloat16"),
            arr(vec![Value::from(2), Value::from(2)]),
            data,
        ])
    };
    let mut a = add_array("r");
    a[1] = Value::Nil;
    a.resize(10, Value::Nil);

    a[9] = triple(Value::Ext(3, vec![1, 2, 3, 4, 5, 6, 7, 8]));
    let InputMessage::Add(r) = decode_input(&add_frames(arr(a.clone()))).unwrap() else {
        panic!()
    };
    let t = r.prompt_embeds.as_ref().unwrap();
    assert_eq!(
        (t.dtype.as_str(), t.shape.as_slice(), t.data.len()),
        ("bfloat16", &[2, 2][..], 8)
    );
    assert_eq!(r.prompt_len(), 2);

    // index 1 = the first aux frame, which is frames[2] here (frames[0] is the type byte)
    a[9] = triple(Value::from(1));
    let mut frames = add_frames(arr(a.clone()));
    frames.push(Bytes::from(vec![9u8; 8]));
    let InputMessage::Add(r) = decode_input(&frames).unwrap() else {
        panic!()
    };
    assert_eq!(r.prompt_embeds.unwrap().data, vec![9u8; 8]);

    a[9] = triple(Value::from(2));
    let e = decode_input(&add_frames(arr(a.clone()))).unwrap_err();
    assert!(matches!(
        e.kind,
        DecodeErrorKind::BadFrameIndex {
            index: 2,
            aux: 0,
            ..
        }
    ));

    a[9] = triple(Value::Map(vec![(s("handle"), Value::from(1))]));
    let e = decode_input(&add_frames(arr(a))).unwrap_err();
    assert!(matches!(e.kind, DecodeErrorKind::OutOfBandTensor { .. }));
    assert_eq!(e.context.request_id.as_deref(), Some("r"));
}

#[test]
fn framing_errors_are_reported() {
    let kind = |frames: &[Bytes]| decode_input(frames).unwrap_err().kind;
    assert_eq!(kind(&[]), DecodeErrorKind::EmptyMessage);
    assert_eq!(
        kind(&[Bytes::from_static(&[0, 0])]),
        DecodeErrorKind::BadTypeFrame(2)
    );
    assert_eq!(
        kind(&[Bytes::from_static(&[9]), Bytes::new()]),
        DecodeErrorKind::UnknownRequestType(9)
    );
    assert_eq!(
        kind(&[Bytes::from_static(&[1])]),
        DecodeErrorKind::MissingPayload
    );
    // truncated msgpack (a fixstr of 5 bytes with 1 present)
    assert!(matches!(
        kind(&[
            Bytes::from_static(&[1]),
            Bytes::from_static(&[0x91, 0xa5, b'a'])
        ]),
        DecodeErrorKind::NotMsgpack(_)
    ));
    assert!(matches!(
        kind(&[Bytes::from_static(&[1]), Bytes::new()]),
        DecodeErrorKind::NotMsgpack(_)
    ));
    assert_eq!(
        kind(&[Bytes::from_static(&[1]), Bytes::from_static(&[0x90, 0xc0])]),
        DecodeErrorKind::TrailingBytes(1)
    );
    assert!(matches!(
        kind(&[Bytes::from_static(&[0]), mp(&Value::Map(vec![]))]),
        DecodeErrorKind::Shape { .. }
    ));
    assert!(matches!(
        kind(&[Bytes::from_static(&[1]), mp(&arr(vec![Value::from(1)]))]),
        DecodeErrorKind::WrongType { .. }
    ));
}

#[test]
fn hostile_length_headers_fail_fast_without_allocating() {
    // array32 claiming 4 billion elements, in a 5-byte frame
    let huge = Bytes::from_static(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    let start = std::time::Instant::now();
    for t in 0..4u8 {
        assert!(decode_input(&[Bytes::from(vec![t]), huge.clone()]).is_err());
    }
    // str32 / bin32 / map32 claiming 4 GiB inside an array
    for marker in [0xdb, 0xc6, 0xdf] {
        let p = Bytes::from(vec![0x91, marker, 0xff, 0xff, 0xff, 0xff, 0x00]);
        assert!(decode_input(&[Bytes::from_static(&[0]), p.clone()]).is_err());
        assert!(decode_outputs(&[p]).is_err());
    }
    assert!(decode_outputs(&[huge]).is_err());
    // deeply nested arrays stop at the depth limit instead of overflowing the stack
    let deep = Bytes::from(vec![0x91; 100_000]);
    assert!(decode_input(&[Bytes::from_static(&[0]), deep.clone()]).is_err());
    assert!(decode_outputs(&[deep]).is_err());
    assert!(start.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn start_dp_wave_and_abort_decode() {
    assert_eq!(
        decode_input(&[
            Bytes::from_static(&[2]),
            mp(&arr(vec![Value::from(4), Value::Nil]))
        ])
        .unwrap(),
        InputMessage::StartDpWave {
            wave: 4,
            exclude_engine_index: None
        }
    );
    let ids = vec!["a".to_string(), "b".to_string()];
    assert_eq!(
        decode_input(&encode_abort(&ids)).unwrap(),
        InputMessage::Abort(ids)
    );
}

#[test]
fn encode_request_sends_the_line_length_and_round_trips() {
    let req = EngineCoreRequest {
        request_id: "cmpl-1-abcd".into(),
        prompt_token_ids: Some(vec![3, 4, 70000]),
        sampling_params: Some(SamplingParams {
            temperature: 0.5,
            max_tokens: Some(5),
            stop_token_ids: vec![0],
            eos_token_id: Some(2),
            all_stop_token_ids: vec![0, 2],
            seed: Some(-3),
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: 1795331310.0773728,
        lora_request: Some(LoRARequest {
            name: "l1".into(),
            int_id: 1,
            path: "/tmp/l1".into(),
        }),
        client_index: 1,
        priority: -2,
        external_req_id: Some("cmpl-1".into()),
        reasoning_parser_kwargs: Some(Value::Map(vec![(
            s("chat_template_kwargs"),
            Value::Map(vec![]),
        )])),
        session_id: Some("s".into()),
        kv_hints: Some(Value::Map(vec![])),
        prompt_embeds: Some(Tensor {
            dtype: "float16".into(),
            shape: vec![3, 64],
            data: vec![7; 384],
        }),
        ..Default::default()
    };
    for m in 25..=33 {
        let l = line(m);
        let frames = encode_request(l, &req);
        assert_eq!(frames[0].as_ref(), &[0]);
        assert_eq!(frames.len(), 3, "384-byte embeds go to an aux frame");
        let v = parse(&frames[1]);
        assert_eq!(v.as_array().unwrap().len(), l.request_len());
        let lora_len = v[6].as_array().unwrap().len();
        assert_eq!(lora_len, if m >= 33 { 6 } else { 7 });
        let sp = v[3].as_map().unwrap();
        assert!(matches!(
            sp.iter()
                .find(|(k, _)| k.as_str() == Some("temperature"))
                .unwrap()
                .1,
            Value::F32(_)
        ));
        assert_eq!(
            sp.iter().any(|(k, _)| k.as_str() == Some("watermarking")),
            m >= 30
        );
        let InputMessage::Add(back) = decode_input(&frames).unwrap() else {
            panic!()
        };
        let mut expect = req.clone();
        expect.wire_len = l.request_len();
        if m < 28 {
            expect.session_id = None;
        }
        if m < 31 {
            expect.kv_hints = None;
        }
        assert_eq!(*back, expect, "0.{m}");
    }
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

/// A rarely-set output field's value (they are boxed).
fn boxed<T>(t: T) -> Option<Box<T>> {
    Some(Box::new(t))
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
