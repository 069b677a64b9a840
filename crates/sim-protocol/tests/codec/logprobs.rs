//! Logprobs on the wire: small ones inline as ext-3 ndarrays, large ones in aux frames,
//! inconsistent ones refused.

use crate::common::to_hex;
use crate::helpers::{arr, boxed, line, output_arrays, s, step};
use rmpv::Value;
use sim_protocol::decode::{DecodeErrorKind, DecodedOutputs, decode_outputs};
use sim_protocol::encode::{EncodeError, EncodeOptions, encode_outputs, encode_outputs_with};
use sim_protocol::*;

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
