//! The listener's tests: hostile peers drop only themselves, limits hold, PUB filters
//! by prefix.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::zmtp::{self};
use tokio::net::TcpStream;

use super::frames::{FrameReader, Incoming};
use super::{PeerLimits, ZmtpPub, ZmtpRouter, encode_message};

fn limits() -> PeerLimits {
    PeerLimits {
        handshake_timeout: Duration::from_millis(500),
        ..PeerLimits::control(4096)
    }
}

/// A raw peer: greeting and READY as `socket_type`, then whatever the test sends.
async fn raw_peer(endpoint: &str, socket_type: &str, identity: Option<&[u8]>) -> TcpStream {
    let mut s = TcpStream::connect(endpoint.trim_start_matches("tcp://"))
        .await
        .unwrap();
    let (peer, _) = zmtp::handshake(&mut s, socket_type, identity, &["ROUTER", "PUB"])
        .await
        .unwrap();
    assert!(!peer.socket_type.is_empty());
    s
}

async fn read_message(s: &mut TcpStream) -> Vec<Bytes> {
    let mut r = FrameReader::new(BytesMut::new(), PeerLimits::control(1 << 20));
    loop {
        match tokio::time::timeout(Duration::from_secs(5), r.next(s))
            .await
            .expect("an answer in time")
            .unwrap()
        {
            Some(Incoming::Message(m)) => return m,
            Some(Incoming::Command(..)) => continue,
            None => panic!("the socket closed the connection"),
        }
    }
}

#[tokio::test]
async fn a_frame_declaring_2_pow_62_bytes_drops_only_that_peer() {
    let mut router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
        .await
        .unwrap();
    let ep = router.endpoint().to_string();
    let mut good = raw_peer(&ep, "DEALER", Some(b"good")).await;
    let mut bad = raw_peer(&ep, "DEALER", Some(b"bad")).await;
    let mut header = vec![zmtp::FLAG_LONG];
    header.extend_from_slice(&(1u64 << 62).to_be_bytes());
    bad.write_all(&header).await.unwrap();
    // the bad peer's connection is closed
    let mut sink = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), bad.read(&mut sink))
        .await
        .expect("the bad peer is dropped")
        .unwrap_or(0);
    assert_eq!(n, 0, "the connection of the bad peer closes");
    // the good one still talks both ways
    good.write_all(&encode_message(&[Bytes::from_static(b"hi")]))
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), router.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        vec![Bytes::from_static(b"good"), Bytes::from_static(b"hi")]
    );
    assert!(router.send(vec![
        Bytes::from_static(b"good"),
        Bytes::from_static(b"there")
    ]));
    assert_eq!(
        read_message(&mut good).await,
        vec![Bytes::from_static(b"there")]
    );
}

#[tokio::test]
async fn a_message_over_the_limit_or_with_too_many_frames_is_refused() {
    let router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
        .await
        .unwrap();
    let ep = router.endpoint().to_string();
    let mut big = raw_peer(&ep, "DEALER", None).await;
    // two frames of 3,000 bytes: the second takes the message past 4,096
    let f = Bytes::from(vec![7u8; 3000]);
    let _ = big.write_all(&encode_message(&[f.clone(), f])).await;
    let mut many = raw_peer(&ep, "DEALER", None).await;
    let frames: Vec<Bytes> = (0..65).map(|_| Bytes::new()).collect();
    let _ = many.write_all(&encode_message(&frames)).await;
    for s in [&mut big, &mut many] {
        let mut sink = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut sink))
            .await
            .expect("dropped in time")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
    assert_eq!(router.peers(), 0);
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_handshake_timeout() {
    let _router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
        .await
        .unwrap();
    let mut s = TcpStream::connect(_router.endpoint().trim_start_matches("tcp://"))
        .await
        .unwrap();
    let mut buf = vec![0u8; 256];
    // our greeting and READY arrive, then the close
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection is closed after 500 ms");
}

#[tokio::test]
async fn pub_sends_to_subscribers_of_a_matching_prefix_only() {
    let publisher = ZmtpPub::bind("tcp://127.0.0.1:0", "test", limits())
        .await
        .unwrap();
    let ep = publisher.endpoint().to_string();
    let mut kv = raw_peer(&ep, "SUB", None).await;
    kv.write_all(&encode_message(&[Bytes::from_static(b"\x01kv")]))
        .await
        .unwrap();
    let mut other = raw_peer(&ep, "SUB", None).await;
    other
        .write_all(&zmtp::command_frame("SUBSCRIBE", b"zz"))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while publisher.publish(&[Bytes::from_static(b"kv-events"), Bytes::from_static(b"x")]) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no subscriber");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        read_message(&mut kv).await,
        vec![Bytes::from_static(b"kv-events"), Bytes::from_static(b"x")]
    );
    // `kv` is not subscribed to `zz`: only `other` (once its SUBSCRIBE is in) gets it
    while publisher.publish(&[Bytes::from_static(b"zz"), Bytes::from_static(b"y")]) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no zz subscriber");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        publisher.publish(&[Bytes::from_static(b"zz"), Bytes::from_static(b"y")]),
        1
    );
    assert_eq!(
        read_message(&mut other).await,
        vec![Bytes::from_static(b"zz"), Bytes::from_static(b"y")]
    );
}

mod fuzz {
    //! Arbitrary bytes after (or instead of) a valid handshake never take the socket
    //! down: after each hostile peer, a good peer still gets an answer.
    use super::*;
    use proptest::prelude::*;

    fn hostile_then_good(bytes: Vec<u8>, greet: bool) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut router = ZmtpRouter::bind("tcp://127.0.0.1:0", "fuzz", limits())
                .await
                .unwrap();
            let ep = router.endpoint().to_string();
            let mut bad = if greet {
                raw_peer(&ep, "DEALER", Some(b"bad")).await
            } else {
                TcpStream::connect(ep.trim_start_matches("tcp://"))
                    .await
                    .unwrap()
            };
            let _ = bad.write_all(&bytes).await;
            let mut good = raw_peer(&ep, "REQ", Some(b"good")).await;
            good.write_all(&encode_message(&[Bytes::new(), Bytes::from_static(b"q")]))
                .await
                .unwrap();
            loop {
                let m = tokio::time::timeout(Duration::from_secs(5), router.recv())
                    .await
                    .expect("the good peer is heard")
                    .expect("the socket is up");
                if m[0].as_ref() == b"good" {
                    assert_eq!(m[2].as_ref(), b"q");
                    break;
                }
            }
            assert!(router.send(vec![
                Bytes::from_static(b"good"),
                Bytes::new(),
                Bytes::from_static(b"a")
            ]));
            assert_eq!(read_message(&mut good).await[1].as_ref(), b"a");
        });
    }

    fn hostile_subscriber_then_good(bytes: Vec<u8>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let publisher = ZmtpPub::bind("tcp://127.0.0.1:0", "fuzz", limits())
                .await
                .unwrap();
            let ep = publisher.endpoint().to_string();
            let mut bad = raw_peer(&ep, "SUB", None).await;
            let _ = bad.write_all(&bytes).await;
            let mut good = raw_peer(&ep, "SUB", None).await;
            good.write_all(&encode_message(&[Bytes::from_static(b"\x01t")]))
                .await
                .unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            // the bad peer may have subscribed too: publishing reaches the good one
            // once its subscription is in
            loop {
                publisher.publish(&[Bytes::from_static(b"t"), Bytes::from_static(b"m")]);
                let got =
                    tokio::time::timeout(Duration::from_millis(50), read_message(&mut good)).await;
                if let Ok(m) = got {
                    assert_eq!(m[1].as_ref(), b"m");
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the good subscriber got nothing"
                );
            }
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn arbitrary_bytes_from_a_subscriber(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            hostile_subscriber_then_good(bytes);
        }
        #[test]
        fn arbitrary_bytes_after_the_handshake(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            hostile_then_good(bytes, true);
        }
        #[test]
        fn arbitrary_bytes_instead_of_a_greeting(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            hostile_then_good(bytes, false);
        }
    }
}
