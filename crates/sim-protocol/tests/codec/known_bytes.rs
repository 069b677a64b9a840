//! Known byte sequences of the handshake, utility calls and aborts, as msgspec encodes
//! them for vLLM.

use crate::common::{hex, to_hex};
use crate::helpers::{arr, line, parse, s};
use bytes::Bytes;
use rmpv::Value;
use sim_protocol::decode::{DecodedOutputs, decode_input, decode_outputs};
use sim_protocol::encode::{encode_outputs, encode_utility};
use sim_protocol::ready::{HandshakeInit, encode_status};
use sim_protocol::*;

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
