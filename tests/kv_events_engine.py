"""Checks the KV-cache events of a running `vllm-vcr play` with vLLM's own code.

Subscribes to the engine's publisher, decodes every batch with vLLM's msgspec
`KVEventBatch`, and recomputes the expected block hashes of the prompts the test sent with
vLLM's own `hash_block_tokens` (sha256, the default), reduced to 64 bits as vLLM's
publisher does. Prints one JSON object per line:

  {"kind": "ready"}
  {"kind": "result", "stored": {...}, "removed": [...], "cleared": n, "mismatches": [...],
   "cpu_stored": [...], "cpu_removed": [...]}
Only device events (medium GPU) are matched to the prompts; the offload tier's (medium CPU,
vLLM's placeholder form: the hash alone) are listed apart.

usage: kv_events_engine.py <endpoint> <block_size> <prompts as JSON list of lists>
Reads `quit` on stdin to finish.
"""

import json
import select
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash


def low64(h):
    return int.from_bytes(bytes(h), "big") & (2**64 - 1)


def main():
    endpoint, block_size, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    init_none_hash(sha256)
    expected = []  # per prompt: [(u64 hash, tokens)]
    for p in prompts:
        parent, chain = None, []
        for i in range(len(p) // block_size):
            block = p[i * block_size:(i + 1) * block_size]
            h = hash_block_tokens(sha256, parent, block, None)
            chain.append((low64(h), block))
            parent = h
        expected.append(chain)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    # give the subscription time to reach the publisher (PUB/SUB slow joiner)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.poll(500)
    print(json.dumps({"kind": "ready"}), flush=True)

    stored, removed, cleared, seqs = {}, [], 0, []
    cpu_stored, cpu_removed, cpu_bad = [], [], []
    while True:
        for sock, _ in poller.poll(100):
            topic, seq, payload = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            batch = decoder.decode(payload)
            for e in batch.events:
                if isinstance(e, BlockStored) and e.medium == "CPU":
                    if e.token_ids or e.block_size != 0 or e.parent_block_hash is not None:
                        cpu_bad.append(str(e))
                    cpu_stored.extend(str(h) for h in e.block_hashes)
                elif isinstance(e, BlockRemoved) and e.medium == "CPU":
                    cpu_removed.extend(str(h) for h in e.block_hashes)
                elif isinstance(e, BlockStored):
                    for i, h in enumerate(e.block_hashes):
                        toks = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                        stored[str(h)] = {"tokens": toks, "parent": e.parent_block_hash if i == 0 else e.block_hashes[i - 1]}
                elif isinstance(e, BlockRemoved):
                    removed.extend(e.block_hashes)
                elif isinstance(e, AllBlocksCleared):
                    cleared += 1
        r, _, _ = select.select([sys.stdin], [], [], 0)
        if r and sys.stdin.readline().strip() == "quit":
            break

    mismatches = [f"CPU store not in vLLM's placeholder form: {e}" for e in cpu_bad]
    for pi, chain in enumerate(expected):
        prev = None
        for bi, (h, toks) in enumerate(chain):
            got = stored.get(str(h))
            if got is None:
                mismatches.append(f"prompt {pi} block {bi}: hash {h} never stored")
            elif got["tokens"] != toks:
                mismatches.append(f"prompt {pi} block {bi}: tokens differ")
            elif bi > 0 and got["parent"] != prev:
                mismatches.append(f"prompt {pi} block {bi}: parent {got['parent']} != {prev}")
            prev = h
    ordered = seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False
    print(json.dumps({"kind": "result", "stored": len(stored), "removed": [str(h) for h in removed],
                      "cleared": cleared, "mismatches": mismatches, "seq_ordered": ordered,
                      "cpu_stored": cpu_stored, "cpu_removed": cpu_removed,
                      "expected": [[str(h) for h, _ in c] for c in expected]}), flush=True)


if __name__ == "__main__":
    main()
