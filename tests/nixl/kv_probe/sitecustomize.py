"""A test probe for the real-peer legs of tests/nixl (loaded by Python at start-up when
this directory is on PYTHONPATH): it wraps vLLM's NIXL connector worker so that, when a
decode engine's READ of a request's KV completes, the bytes that landed are digested
before the model touches them, and, when a prefill engine's blocks have been read (the
reader's notification arrived), the bytes it served are digested (the blocks of each
request are followed through the model runner's scheduler outputs). Each digest is one JSON line in $VCR_KV_PROBE_LOG: SHA-256 of every
transferred block of every layer's region, region by region, block by block (what
`play`'s NIXL pool digests the same way).

It changes nothing vLLM does; without $VCR_KV_PROBE_LOG it does not patch at all.
"""

import ctypes
import hashlib
import importlib.abc
import json
import os
import sys

LOG = os.environ.get("VCR_KV_PROBE_LOG")
TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
RUNNER = "vllm.v1.worker.gpu_model_runner"

# this worker process's requests: request id -> its blocks (KV-cache group 0)
_BLOCKS = {}


def _write(line):
    with open(LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


def _digest(worker, blocks):
    """SHA-256 of `blocks` in every registered region, as NIXL sees the memory."""
    addrs = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    h = hashlib.sha256()
    for base, block_len in zip(addrs, worker.block_len_per_layer):
        for b in blocks:
            h.update(ctypes.string_at(base + b * block_len, block_len))
    return h.hexdigest()


def _patch_runner(module):
    cls = module.GPUModelRunner
    original = cls._update_states

    def _update_states(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            _BLOCKS[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks is not None and req_id in _BLOCKS:
                _BLOCKS[req_id].extend(blocks[0])
        return original(self, scheduler_output)

    cls._update_states = _update_states


def _patch(module):
    cls = module.NixlBaseConnectorWorker
    original = cls.get_transfer_results

    def get_transfer_results(self):
        recving = dict(self._recving_metadata)
        results = original(self)
        for req_id in results.finished_recving:
            meta = recving.get(req_id)
            if meta is None or meta.remote is None:
                continue
            remote = list(meta.remote.block_ids[0])
            # the READ fills the last len(remote) local blocks (the first ones may be a
            # local prefix-cache hit)
            local = list(meta.local_block_ids[0])[-len(remote):] if remote else []
            _write({
                "side": "decode",
                "request_id": req_id,
                "remote_request_id": meta.remote.request_id,
                "remote_engine_id": meta.remote.engine_id,
                "remote_block_ids": remote,
                "local_block_ids": local,
                "regions": len(self.block_len_per_layer),
                "block_len": self.block_len_per_layer[0] if self.block_len_per_layer else 0,
                "sha256": _digest(self, local),
            })
        for req_id in results.finished_sending:
            blocks = _BLOCKS.pop(req_id, None)
            if blocks is None:
                continue
            _write({
                "side": "prefill",
                "request_id": req_id,
                "block_ids": blocks,
                "regions": len(self.block_len_per_layer),
                "sha256": _digest(self, blocks),
            })
        return results

    cls.get_transfer_results = get_transfer_results


class _Finder(importlib.abc.MetaPathFinder):
    """Patch the connector worker as soon as its module has run."""

    def find_spec(self, name, path, target=None):
        patch = {TARGET: _patch, RUNNER: _patch_runner}.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if LOG:
    sys.meta_path.insert(0, _Finder())
