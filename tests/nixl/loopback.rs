//! The NIXL data plane, loopback (`--features nixl`): a prefill pool and a decode pool,
//! each with its own NIXL agent (UCX, DRAM), in this one process. The decode pool READs a
//! request's blocks from the prefill pool the way vLLM's decode engine does, every byte
//! is checked, and the prefill agent receives vLLM's `"<request id>:1"` notification.
//!
//! Needs the NIXL runtime: `cargo xtask fetch --nixl`. The pool loads it by absolute path
//! from the cache (or `$VLLM_VCR_NIXL_LIB_DIR`, or `LD_LIBRARY_PATH`), so no environment
//! is needed; without it every test fails with the command to run, never an abort.
#![cfg(feature = "nixl")]

use std::time::Duration;

use vllm_vcr::play::pd::nixl::{NixlPool, load_runtime};

const T: Duration = Duration::from_secs(10);

fn runtime() {
    match load_runtime() {
        Ok(from) => eprintln!("NIXL runtime: {from}"),
        Err(e) => panic!("{e:#}"),
    }
}

#[test]
fn decode_reads_a_requests_blocks_from_prefill_every_byte_checked() {
    runtime();
    let (blocks, block_bytes) = (64, 16 * 1024);
    let mut prefill = NixlPool::new("prefill-0", blocks, block_bytes).unwrap();
    let mut decode = NixlPool::new("decode-0", blocks, block_bytes).unwrap();
    let req = "cmpl-8d2c0a1e-0";
    // the prefill engine's physical blocks for the request, scattered and out of order
    let remote = [7usize, 3, 42, 11, 0, 63, 20];
    // where the decode engine allocated them
    let local = [1usize, 2, 3, 50, 51, 9, 10];
    prefill.fill(req, &remote).unwrap();
    prefill.fill("other-request", &[5, 6]).unwrap();
    prefill.verify(req, &remote).unwrap();
    assert!(
        decode.verify(req, &local).is_err(),
        "a zeroed pool must not verify"
    );

    // the handshake: decode loads the prefill agent's metadata (vLLM's side channel)
    let info = prefill.info().unwrap();
    assert!(!info.metadata.is_empty());
    assert_eq!(decode.load_remote(&info).unwrap(), "prefill-0");

    let stats = decode.read_blocks(&info, &remote, &local, req, T).unwrap();
    assert_eq!(stats.bytes, remote.len() * block_bytes);
    eprintln!(
        "read {} B in {:?} (first READ: includes UCX connection set-up)",
        stats.bytes, stats.elapsed
    );
    decode.verify(req, &local).unwrap();
    prefill
        .wait_notification("decode-0", &format!("{req}:1"), T)
        .unwrap();
    // blocks not read stay zero
    assert!(decode.block(0).iter().all(|&b| b == 0));
    assert!(decode.block(63).iter().all(|&b| b == 0));

    // a second request over the same connection, into other local blocks
    let req2 = "cmpl-second-0";
    prefill.fill(req2, &[30, 31]).unwrap();
    let s2 = decode
        .read_blocks(&info, &[30, 31], &[60, 61], req2, T)
        .unwrap();
    eprintln!("second read {} B in {:?}", s2.bytes, s2.elapsed);
    decode.verify(req2, &[60, 61]).unwrap();
    decode.verify(req, &local).unwrap();
    prefill
        .wait_notification("decode-0", &format!("{req2}:1"), T)
        .unwrap();

    // another request's pattern does not verify, and the error says where
    let err = decode.verify("not-this-request", &local).unwrap_err();
    assert!(format!("{err}").contains("byte 0"), "{err}");
}

#[test]
fn reading_outside_the_remote_pool_is_an_error_not_a_crash() {
    runtime();
    let block_bytes = 4096;
    let mut prefill = NixlPool::new("prefill-oob", 8, block_bytes).unwrap();
    let mut decode = NixlPool::new("decode-oob", 8, block_bytes).unwrap();
    prefill.fill("r", &[0, 1]).unwrap();
    let info = prefill.info().unwrap();
    decode.load_remote(&info).unwrap();

    // block 8 of an 8-block pool: just past the registered region
    let err = decode
        .read_blocks(&info, &[1, 8], &[0, 1], "r", T)
        .unwrap_err();
    eprintln!("out of range: {err:#}");
    assert!(format!("{err:#}").contains("refused"), "{err:#}");
    // far away too
    let err = decode
        .read_blocks(&info, &[1_000_000], &[0], "r", T)
        .unwrap_err();
    assert!(format!("{err:#}").contains("refused"), "{err:#}");
    // a local block outside the local pool is refused before NIXL
    let err = decode.read_blocks(&info, &[0], &[8], "r", T).unwrap_err();
    assert!(format!("{err}").contains("outside"), "{err}");
    // nothing was written, no notification was sent
    assert!(decode.block(0).iter().all(|&b| b == 0));
    assert!(
        prefill
            .wait_notification("decode-oob", "r:1", Duration::from_millis(200))
            .is_err()
    );
    // and the agents still work
    decode.read_blocks(&info, &[0, 1], &[0, 1], "r", T).unwrap();
    decode.verify("r", &[0, 1]).unwrap();
    prefill.wait_notification("decode-oob", "r:1", T).unwrap();
}

#[test]
fn an_unknown_peer_is_an_error() {
    runtime();
    let mut a = NixlPool::new("lonely-a", 2, 4096).unwrap();
    let b = NixlPool::new("lonely-b", 2, 4096).unwrap();
    // no load_remote: a does not know b
    let info = b.info().unwrap();
    assert!(a.read_blocks(&info, &[0], &[0], "x", T).is_err());
}
