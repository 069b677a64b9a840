//! The codec against real frames captured between the Python vLLM frontend (0.33.0 and
//! 0.32.0) and a minimal engine (`tests/fixtures/`).

mod common;

use common::{Captured, capture, to_hex};
use sim_protocol::decode::{DecodedOutputs, decode_input, decode_outputs, decode_outputs_for};
use sim_protocol::encode::encode_outputs;
use sim_protocol::ready::{
    HandshakeInit, ReadyResponse, StatusMessage, encode_status, rewrite_init_addresses,
};
use sim_protocol::{CallId, InputMessage, VllmLine};

const CAPTURES: [(&str, VllmLine); 2] = [
    ("0.33.0", VllmLine::new(0, 33)),
    ("0.32.0", VllmLine::new(0, 32)),
];

fn inputs(msgs: &[Captured]) -> impl Iterator<Item = &Captured> {
    msgs.iter()
        .filter(|m| m.socket == "input" && m.direction == "f2e")
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("int") as u32)
        .collect()
}

#[test]
fn every_frontend_message_of_both_captures_decodes_with_the_right_fields() {
    for (version, _) in CAPTURES {
        let msgs = capture(version);
        let mut seen = (0, 0, 0);
        for m in inputs(&msgs) {
            let msg = decode_input(&m.frames)
                .unwrap_or_else(|e| panic!("{version} #{} {}: {e}", m.seq, m.label));
            let d = &m.decoded;
            match msg {
                InputMessage::Add(req) => {
                    seen.0 += 1;
                    assert_eq!(m.label, "ADD");
                    assert_eq!(req.request_id, d[0].as_str().unwrap());
                    assert_eq!(req.prompt_token_ids.as_deref(), Some(&u32s(&d[1])[..]));
                    assert_eq!(req.wire_len, 22);
                    assert!((req.arrival_time - d[5].as_f64().unwrap()).abs() < 1e-5);
                    assert_eq!(req.client_index, 0);
                    assert_eq!(req.external_req_id.as_deref(), d[16].as_str());
                    assert!(req.lora_request.is_none() && req.prompt_embeds.is_none());
                    let sp = req.sampling_params.as_ref().expect("sampling params");
                    let dsp = &d[3];
                    assert_eq!(
                        sp.max_tokens,
                        Some(dsp["max_tokens"].as_u64().unwrap() as u32)
                    );
                    assert_eq!(
                        u64::from(sp.output_kind),
                        dsp["output_kind"].as_u64().unwrap()
                    );
                    assert_eq!(sp.eos_token_id, Some(2));
                    assert_eq!(sp.stop_token_ids, vec![0]);
                    assert_eq!(sp.all_stop_token_ids, vec![0, 2]);
                    assert_eq!(sp.temperature, 1.0);
                    assert_eq!(sp.n, 1);
                    assert!(!sp.ignore_eos);
                }
                InputMessage::Utility(call) => {
                    seen.1 += 1;
                    assert!(m.label.starts_with("UTILITY-"));
                    assert_eq!(call.client_index, 0);
                    assert_eq!(call.call_id, CallId::Unsigned(d[1].as_u64().unwrap()));
                    // Python sends uuid1 >> 64: always past 32 bits, so msgpack `cf`.
                    assert_eq!(m.frames[1][2], 0xcf);
                    assert_eq!(call.method, m.label.trim_start_matches("UTILITY-"));
                    assert!(call.args.is_empty());
                }
                InputMessage::Abort(ids) => {
                    seen.2 += 1;
                    assert_eq!(m.label, "ABORT");
                    assert_eq!(ids, vec![d[0].as_str().unwrap().to_string()]);
                }
                InputMessage::StartDpWave { .. } => panic!("no START_DP_WAVE in the capture"),
            }
        }
        assert_eq!(seen, (9, 2, 1), "{version}: ADD, UTILITY, ABORT counts");
    }
}

#[test]
fn first_add_of_the_033_capture_is_the_documented_request() {
    let msgs = capture("0.33.0");
    let add = msgs.iter().find(|m| m.seq == 9).unwrap();
    let InputMessage::Add(req) = decode_input(&add.frames).unwrap() else {
        panic!("not an ADD")
    };
    assert_eq!(req.request_id, "cmpl-a2b7fd99e30de547-0-83c41afc");
    assert_eq!(req.prompt_token_ids, Some(vec![421, 511, 510]));
    assert_eq!(req.prompt_len(), 3);
    assert_eq!(
        req.external_req_id.as_deref(),
        Some("cmpl-a2b7fd99e30de547-0")
    );
    let sp = req.sampling_params.unwrap();
    assert_eq!(sp.max_tokens, Some(5));
    assert_eq!(sp.output_kind, 2);
    assert_eq!(sp.eos_token_id, Some(2));

    let util = msgs.iter().find(|m| m.seq == 5).unwrap();
    let InputMessage::Utility(call) = decode_input(&util.frames).unwrap() else {
        panic!("not a utility call")
    };
    assert_eq!(call.call_id, CallId::Unsigned(5471536464905376241));
    assert_eq!(call.method, "reset_mm_cache");

    let abort = msgs.iter().find(|m| m.seq == 52).unwrap();
    assert_eq!(
        decode_input(&abort.frames).unwrap(),
        InputMessage::Abort(vec!["cmpl-9d46348cd7c91a44-0-80dc66c3".into()])
    );
}

#[test]
fn handshake_maps_match_the_captures_byte_for_byte() {
    for (version, _) in CAPTURES {
        let msgs = capture(version);
        let by_label = |l: &str| msgs.iter().find(|m| m.label == l).unwrap();
        assert_eq!(
            by_label("HELLO").frames[0].as_ref(),
            &encode_status("HELLO")[..]
        );
        assert_eq!(
            by_label("READY").frames[0].as_ref(),
            &encode_status("READY")[..]
        );
        assert_eq!(
            StatusMessage::decode(&by_label("HELLO").frames[0]).unwrap(),
            StatusMessage {
                status: "HELLO".into(),
                local: false,
                headless: true
            }
        );

        let init_bytes = &by_label("INIT").frames[0];
        let init = HandshakeInit::decode(init_bytes).unwrap();
        assert_eq!(init.inputs.len(), 1);
        assert!(init.inputs[0].starts_with("tcp://127.0.0.1:"));
        assert!(init.coordinator_input.is_none() && init.frontend_stats_publish_address.is_none());
        assert_eq!(to_hex(&init.encode()), to_hex(init_bytes), "{version} INIT");

        // The record tap's rewrite: same addresses → the same bytes; new addresses → only
        // those change.
        let (same, _) = rewrite_init_addresses(init_bytes, &init.inputs, &init.outputs).unwrap();
        assert_eq!(to_hex(&same), to_hex(init_bytes), "{version} INIT rewrite");
        let tap_in = vec!["tcp://127.0.0.1:1".to_string()];
        let tap_out = vec!["tcp://127.0.0.1:2".to_string()];
        let (new, original) = rewrite_init_addresses(init_bytes, &tap_in, &tap_out).unwrap();
        assert_eq!(original, init);
        let rewritten = HandshakeInit::decode(&new).unwrap();
        assert_eq!(
            rewritten,
            HandshakeInit {
                inputs: tap_in,
                outputs: tap_out,
                ..init.clone()
            }
        );
    }
}

#[test]
fn captured_ready_response_decodes_and_ours_carries_the_same_values() {
    for (version, _) in CAPTURES {
        let msgs = capture(version);
        let m = msgs.iter().find(|m| m.label == "READY_RESPONSE").unwrap();
        let r = ReadyResponse::decode(&m.frames[0]).unwrap();
        assert_eq!(r.max_model_len, 2048);
        assert_eq!(r.num_gpu_blocks, 1024);
        assert_eq!(r.block_size, 16);
        assert_eq!(r.dtype, "bfloat16");
        assert_eq!(r.kv_cache_size_tokens, Some(16384));
        assert_eq!(r.kv_cache_max_concurrency, Some(8.0));
        assert_eq!(r.effective_attention_block_size, Some(16));
        assert_eq!(r.instance_id, "fake-engine-0");
        assert!(!r.supports_lora);
        // Ours has the 0.33 superset (28 keys) and decodes to the same values.
        let ours = r.encode();
        assert_eq!(ours[0], 0xde);
        assert_eq!(u16::from_be_bytes([ours[1], ours[2]]), 28);
        assert_eq!(ReadyResponse::decode(&ours).unwrap(), r);
    }
}

#[test]
fn captured_outputs_decode_and_reencode_byte_for_byte() {
    for (version, line) in CAPTURES {
        let msgs = capture(version);
        let mut n = 0;
        for m in msgs
            .iter()
            .filter(|m| m.socket == "output" && m.direction == "e2f")
        {
            let auto =
                decode_outputs(&m.frames).unwrap_or_else(|e| panic!("{version} #{}: {e}", m.seq));
            let typed = decode_outputs_for(line, &m.frames).unwrap();
            assert_eq!(auto, typed);
            match typed {
                DecodedOutputs::Dead => assert_eq!(m.label, "ENGINE_CORE_DEAD"),
                DecodedOutputs::Outputs(out) => {
                    n += 1;
                    if m.label == "STEP-FINISH" {
                        assert!(out.outputs.iter().any(|o| o.finish_reason.is_some()));
                    }
                    let ours = encode_outputs(line, &out).unwrap();
                    assert_eq!(ours.len(), 1);
                    assert_eq!(
                        to_hex(&ours[0]),
                        to_hex(&m.frames[0]),
                        "{version} #{} {}",
                        m.seq,
                        m.label
                    );
                }
            }
        }
        assert_eq!(n, 48, "{version}: output messages");
    }
}

#[test]
fn captured_utility_replies_have_the_expected_values() {
    let msgs = capture("0.33.0");
    let m = msgs.iter().find(|m| m.seq == 8).unwrap();
    let DecodedOutputs::Outputs(out) = decode_outputs(&m.frames).unwrap() else {
        panic!("dead")
    };
    let u = out.utility_output.unwrap();
    assert_eq!(u.call_id, CallId::Unsigned(5471591998832513521));
    assert_eq!(
        u.outcome,
        Ok(rmpv::Value::Array(vec![rmpv::Value::from("generate")]))
    );
    assert!(out.outputs.is_empty());
}
