"""Ask a prefill engine's side channel for its NIXL agent metadata the way vLLM's
NixlConnector does (a REQ socket, msgpack((b"get_meta_msg", pp_rank, tp_rank))), and
decode the answer with vLLM's own msgspec classes.

    nixl_handshake.py HOST PORT ENGINE_ID

Prints one line describing the pool; exits non-zero when vLLM would refuse the answer.
"""

import sys

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
)

host, port, engine_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sock = zmq.Context().socket(zmq.REQ)
sock.setsockopt(zmq.RCVTIMEO, 5000)  # vLLM's handshake timeout
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"tcp://{host}:{port}")
sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
parts = sock.recv_multipart()
if len(parts) != 2:
    sys.exit(f"expected [payload, clock], got {len(parts)} frames")
payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
clock = msgspec.msgpack.decode(parts[1])
meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
if meta.engine_id != engine_id:
    sys.exit(f"engine id {meta.engine_id!r}, expected {engine_id!r}")
print(
    f"handshake: compatibility_hash={payload.compatibility_hash} engine_id={meta.engine_id} "
    f"num_blocks={meta.num_blocks} block_lens={meta.block_lens} "
    f"agent_metadata_bytes={len(meta.agent_metadata)} clock={float(clock):.3f}"
)
