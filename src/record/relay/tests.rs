//! The byte relay's tests: whole messages only, in order, whatever the reads' sizes.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use sim_protocol::zmtp;

use super::legs::{Leg, writer};
use super::pipe::{Got, Oversize, PipeEnd, pipe};
use tokio::io::{DuplexStream, duplex};

fn leg(stream: DuplexStream) -> Leg {
    let (r, w) = tokio::io::split(stream);
    Leg {
        reader: Box::new(r),
        writer: writer(w),
        pending: BytesMut::new(),
        peer: zmtp::Peer {
            version: (3, 1),
            socket_type: "PUSH".into(),
            identity: Bytes::new(),
        },
    }
}

fn message(engine: u8, i: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let big = vec![engine; 100 + (i as usize % 7) * 100];
    zmtp::put_frame(
        &mut out,
        zmtp::FLAG_MORE,
        format!("{engine}:{i}").as_bytes(),
    );
    zmtp::put_frame(&mut out, 0, &big);
    out
}

/// Two engines write their messages in awkward pieces (3 bytes at a time, so every
/// message spans many reads) into pipes that share one destination: the destination
/// gets every message whole, each engine's in order, never two interleaved; the
/// observer sees the same frames; a PING is answered on its own connection and not
/// forwarded.
#[tokio::test]
async fn dp_merge_keeps_messages_whole() {
    const N: u32 = 200;
    let (dest_tap, mut dest) = duplex(1 << 20);
    let to = writer(dest_tap);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut pipes = Vec::new();
    let mut engines = Vec::new();
    for e in 0..2u8 {
        let (tap_side, engine_side) = duplex(1 << 20);
        let seen = seen.clone();
        let to = Some(to.clone());
        pipes.push(tokio::spawn(async move {
            pipe(leg(tap_side), to, 1 << 20, Oversize::DropSource, |got| {
                if let Got::Message { frames, .. } = got {
                    seen.lock().unwrap().push(frames);
                }
            })
            .await
        }));
        engines.push(tokio::spawn(async move {
            let mut s = engine_side;
            let mut bytes = zmtp::command_frame("PING", &[0, 0, b'h', b'i']);
            for i in 0..N {
                bytes.extend(message(e, i));
            }
            for piece in bytes.chunks(3) {
                s.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            let want = zmtp::command_frame("PONG", b"hi");
            let mut pong = vec![0u8; want.len()];
            s.read_exact(&mut pong).await.unwrap();
            assert_eq!(pong, want);
            s
        }));
    }
    let mut engine_ends = Vec::new();
    for e in engines {
        engine_ends.push(e.await.unwrap());
    }
    let expect_len: usize = (0..2u8)
        .flat_map(|e| (0..N).map(move |i| message(e, i).len()))
        .sum();
    let mut got = vec![0u8; expect_len];
    dest.read_exact(&mut got).await.unwrap();
    let mut scanner = zmtp::Scanner::new(1 << 30);
    let scan = scanner.scan(&got).unwrap();
    assert_eq!(scan.complete, got.len());
    let mut next = [0u32; 2];
    for item in scan.items {
        let zmtp::Item::Message { span, .. } = item else {
            panic!("a command was forwarded");
        };
        let e = usize::from(got[span.start + 2] - b'0');
        assert_eq!(&got[span], message(e as u8, next[e]).as_slice());
        next[e] += 1;
    }
    assert_eq!(next, [N, N]);
    drop(engine_ends);
    for p in pipes {
        assert!(matches!(p.await.unwrap(), PipeEnd::SourceClosed(None)));
    }
    assert_eq!(seen.lock().unwrap().len(), 2 * N as usize);
}

/// A message over the limit is streamed through whole, the messages around it are
/// buffered as usual, and only those are observed.
#[tokio::test]
async fn oversize_messages_stream_through() {
    let (dest_tap, mut dest) = duplex(1 << 20);
    let (tap_side, mut engine) = duplex(1 << 20);
    let observed = Arc::new(std::sync::Mutex::new((0, 0)));
    let o = observed.clone();
    let p = tokio::spawn(async move {
        pipe(
            leg(tap_side),
            Some(writer(dest_tap)),
            2048,
            Oversize::Stream,
            |got| {
                let mut o = o.lock().unwrap();
                match got {
                    Got::Message { .. } => o.0 += 1,
                    Got::Streamed => o.1 += 1,
                }
            },
        )
        .await
    });
    let mut bytes = message(1, 1);
    zmtp::put_frame(&mut bytes, zmtp::FLAG_MORE, b"head");
    zmtp::put_frame(&mut bytes, zmtp::FLAG_MORE, &[7u8; 50_000]);
    zmtp::put_frame(&mut bytes, 0, b"tail");
    bytes.extend(message(1, 2));
    for piece in bytes.chunks(1000) {
        engine.write_all(piece).await.unwrap();
    }
    let mut got = vec![0u8; bytes.len()];
    dest.read_exact(&mut got).await.unwrap();
    assert_eq!(got, bytes);
    drop(engine);
    assert!(matches!(p.await.unwrap(), PipeEnd::SourceClosed(None)));
    assert_eq!(*observed.lock().unwrap(), (2, 1));
}

/// A peer on a shared output stream that declares a 2^40-byte frame, or dies in the
/// middle of a message, is dropped without a byte of that message reaching the
/// destination; the other engine's messages before and after go through whole.
#[tokio::test]
async fn a_bad_peer_never_splices_a_partial_message_into_a_shared_stream() {
    let (dest_tap, mut dest) = duplex(1 << 20);
    let to = writer(dest_tap);
    // the good engine
    let (good_tap, mut good) = duplex(1 << 20);
    let good_pipe = tokio::spawn(pipe(
        leg(good_tap),
        Some(to.clone()),
        1 << 20,
        Oversize::DropSource,
        |_| {},
    ));
    // a peer that declares a huge frame after one good message
    let (huge_tap, mut huge) = duplex(1 << 20);
    let huge_pipe = tokio::spawn(pipe(
        leg(huge_tap),
        Some(to.clone()),
        1 << 20,
        Oversize::DropSource,
        |_| {},
    ));
    // a peer that sends half a message and goes
    let (cut_tap, mut cut) = duplex(1 << 20);
    let cut_pipe = tokio::spawn(pipe(
        leg(cut_tap),
        Some(to.clone()),
        1 << 20,
        Oversize::DropSource,
        |_| {},
    ));
    let first = message(1, 1);
    good.write_all(&first).await.unwrap();
    let mut bytes = message(2, 1);
    bytes.push(zmtp::FLAG_LONG);
    bytes.extend_from_slice(&(1u64 << 40).to_be_bytes());
    bytes.extend_from_slice(&[9u8; 1000]);
    huge.write_all(&bytes).await.unwrap();
    let whole = message(3, 1);
    cut.write_all(&whole[..whole.len() - 10]).await.unwrap();
    drop(cut);
    let end = huge_pipe.await.unwrap();
    assert!(
        matches!(&end, PipeEnd::SourceClosed(Some(why)) if why.contains("--max-frame-size")),
        "the huge peer is dropped with a reason"
    );
    assert!(matches!(
        cut_pipe.await.unwrap(),
        PipeEnd::SourceClosed(None)
    ));
    let second = message(1, 2);
    good.write_all(&second).await.unwrap();
    drop(good);
    assert!(matches!(
        good_pipe.await.unwrap(),
        PipeEnd::SourceClosed(None)
    ));
    drop(to);
    // exactly: good 1, the huge peer's one whole message, good 2 (in arrival order
    // between the two peers' whole messages); nothing of the cut or huge message
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), dest.read_to_end(&mut got)).await;
    let mut scanner = zmtp::Scanner::new(1 << 30);
    let scan = scanner.scan(&got).unwrap();
    assert_eq!(scan.complete, got.len(), "only whole messages were written");
    let mut names: Vec<String> = scan
        .items
        .iter()
        .map(|item| match item {
            zmtp::Item::Message { frames, .. } => {
                String::from_utf8_lossy(&got[frames[0].clone()]).into_owned()
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    names.sort();
    assert_eq!(names, vec!["1:1", "1:2", "2:1"]);
}

mod fuzz {
    //! Whatever bytes a peer of the tap's data listeners sends, the pipe ends without a
    //! panic and the shared destination holds only whole messages.
    use super::*;
    use proptest::prelude::*;

    fn relay(bytes: Vec<u8>, chunk: usize) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (dest_tap, mut dest) = duplex(1 << 22);
            let (tap_side, mut peer) = duplex(1 << 22);
            let to = writer(dest_tap);
            let p = tokio::spawn(pipe(
                leg(tap_side),
                Some(to.clone()),
                4096,
                Oversize::DropSource,
                |_| {},
            ));
            for piece in bytes.chunks(chunk.max(1)) {
                if peer.write_all(piece).await.is_err() {
                    break;
                }
            }
            drop(peer);
            let _ = p.await.unwrap();
            drop(to);
            let mut got = Vec::new();
            dest.read_to_end(&mut got).await.unwrap();
            let mut scanner = zmtp::Scanner::new(1 << 30);
            let scan = scanner.scan(&got).unwrap();
            assert_eq!(
                scan.complete,
                got.len(),
                "only whole messages reach the destination"
            );
        });
    }

    /// Whole messages with garbage spliced in at random places.
    fn stream() -> impl Strategy<Value = Vec<u8>> {
        let part = prop_oneof![
            (0u8..4, 0usize..600).prop_map(|(e, n)| message(e, n as u32)),
            proptest::collection::vec(any::<u8>(), 0..40),
        ];
        proptest::collection::vec(part, 0..12).prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
        #[test]
        fn any_bytes_leave_only_whole_messages(bytes in stream(), chunk in 1usize..700) {
            relay(bytes, chunk);
        }
    }
}
