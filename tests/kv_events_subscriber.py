"""A real KV-events consumer for tests/kv_events_e2e/subscriber.rs.

Subscribes to a vllm-vcr KV-event publisher with pyzmq and decodes every batch with vLLM's
OWN msgspec classes (`vllm.distributed.kv_events.KVEventBatch`), so a byte the real
decoder would reject fails the test. Prints one JSON object per line on stdout:

  {"kind": "ready"}                                   sockets connected, subscribed
  {"kind": "batch", "topic", "seq", "ts", "dp_rank", "events": [...]}
  {"kind": "replay", "start", "items": [{"topic", "seq", "ts", "dp_rank", "events",
   "matches_live"}], "end_marker_ok": bool}
  {"kind": "bye", "other_topic_messages": n}
  {"kind": "error", "message": "..."}                 then exit 1

Commands on stdin (one per line): `replay <start_seq>`, `quit`.

usage: kv_events_subscriber.py <pub endpoint> <replay endpoint> <topic>
(replay frames as vLLM 0.26+ sends them; the 0.25 form is checked in Rust)
"""

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_MS = 30_000


def emit(obj):
    print(json.dumps(obj), flush=True)


def fail(message):
    emit({"kind": "error", "message": message})
    sys.exit(1)


def describe(batch):
    events = []
    for e in batch.events:
        if not isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)):
            fail(f"decoded an event of unexpected class {type(e)!r}")
        d = msgspec.to_builtins(e)
        if d.get("type") != type(e).__name__:
            fail(f"event tag {d.get('type')!r} does not match class {type(e).__name__}")
        events.append(d)
    return {"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": events}


def main():
    if len(sys.argv) < 4:
        fail("usage: kv_events_subscriber.py <pub endpoint> <replay endpoint> <topic>")
    endpoint, replay_endpoint, topic = sys.argv[1:4]
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    # A subscriber whose topic filter must never match: proves the PUB side filters.
    other = ctx.socket(zmq.SUB)
    other.setsockopt(zmq.LINGER, 0)
    other.setsockopt(zmq.SUBSCRIBE, b"no-such-topic")
    other.connect(endpoint)
    other_count = 0

    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(other, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    live = {}
    emit({"kind": "ready"})

    while True:
        ready = dict(poller.poll(TIMEOUT_MS))
        if not ready:
            fail(f"nothing happened for {TIMEOUT_MS} ms")
        if other in ready:
            other.recv_multipart()
            other_count += 1
        if sub in ready:
            frames = sub.recv_multipart()
            if len(frames) != 3:
                fail(f"published message has {len(frames)} frames, expected 3")
            t, seq_bytes, payload = frames
            if len(seq_bytes) != 8:
                fail(f"sequence frame has {len(seq_bytes)} bytes, expected 8")
            seq = int.from_bytes(seq_bytes, "big")
            live[seq] = payload
            batch = decoder.decode(payload)
            emit({"kind": "batch", "topic": t.decode(), "seq": seq, **describe(batch)})
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                emit({"kind": "bye", "other_topic_messages": other_count})
                return
            if cmd[0] == "replay":
                replay(ctx, replay_endpoint, int(cmd[1]), decoder, live)
            else:
                fail(f"unknown command {line!r}")


def replay(ctx, replay_endpoint, start, decoder, live):
    # A DEALER puts the same frames on the wire as vLLM's REQ-based clients
    # ([b"", start_seq]) but can read the many replies.
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    items = []
    end_ok = False
    while True:
        if not dealer.poll(TIMEOUT_MS):
            fail("the replay ROUTER did not answer")
        frames = dealer.recv_multipart()
        if frames[0] != b"":
            fail(f"replay reply does not start with an empty delimiter: {frames!r}")
        frames = frames[1:]
        # [topic, seq, payload]; end marker [b"", END_SEQ, b""].
        if len(frames) == 3 and frames[1] == END_SEQ:
            end_ok = frames == [b"", END_SEQ, b""]
            break
        if len(frames) != 3:
            fail(f"replay reply has {len(frames) + 1} frames, expected 4: {frames!r}")
        t, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        item = {"seq": seq, **describe(decoder.decode(payload))}
        item["topic"] = t.decode()
        item["matches_live"] = live.get(seq) == payload
        items.append(item)
    dealer.close()
    emit({"kind": "replay", "start": start, "items": items, "end_marker_ok": end_ok})


if __name__ == "__main__":
    main()
