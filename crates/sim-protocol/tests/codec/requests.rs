//! Requests: lenient decoding of ADD arrays and their parts, framing errors, hostile
//! length headers, and request encoding per line.

use crate::helpers::{add_array, add_frames, arr, line, mp, parse, s};
use bytes::Bytes;
use rmpv::Value;
use sim_protocol::decode::{DecodeErrorKind, decode_input, decode_outputs};
use sim_protocol::encode::{encode_abort, encode_request};
use sim_protocol::*;

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
