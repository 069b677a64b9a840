"""Decode a Perfetto protobuf trace with Perfetto's own generated Python classes (the
`perfetto` package from PyPI), independently of vllm-vcr's encoder, and print what it
draws as JSON on stdout:

    {"processes": {pid: name}, "tracks": [...], "slices": [...], "counters": [...],
     "packets": n}

A slice is {"process", "track", "name", "category", "ts_ns", "dur_ns", "args"}; a counter
sample {"process", "track", "ts_ns", "value"}. Interned names are resolved per sequence as
the trace processor does (a packet flagged SEQ_INCREMENTAL_STATE_CLEARED empties the
tables); slice begins and ends are matched per track, in timestamp order (ties in file
order). Anything the decoder does not expect is an error (exit 1), never ignored.

Usage: python perfetto_decode.py TRACE(.gz)
"""

import gzip
import json
import sys

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


def fail(msg):
    print(f"perfetto_decode: {msg}", file=sys.stderr)
    sys.exit(1)


def check_known(msg, where):
    """Every field of `msg` and of its sub-messages is one the schema knows (a wrong field
    number would land in the unknown fields and silently vanish)."""
    unknown = UnknownFieldSet(msg)
    if len(unknown) > 0:
        fail(f"{where}: unknown field(s) {[f.field_number for f in unknown]} in {msg.DESCRIPTOR.name}")
    for field, value in msg.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        items = value if field.is_repeated else [value]
        for item in items:
            check_known(item, where)


def annotation_value(a):
    kind = a.WhichOneof("value")
    if kind is None and len(a.array_values) > 0:
        return [annotation_value(x) for x in a.array_values]
    if kind is None:
        fail(f"a debug annotation without a value: {a}")
    if kind in ("uint_value", "int_value", "double_value", "bool_value", "string_value"):
        return getattr(a, kind)
    fail(f"unexpected debug annotation value {kind}")


def main():
    path = sys.argv[1]
    data = open(path, "rb").read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    trace = pb.Trace()
    trace.ParseFromString(data)

    interned = {}  # sequence id -> {"names": {}, "categories": {}, "args": {}}
    cleared = set()
    processes = {}  # pid -> name
    tracks = {}  # uuid -> {"process": pid, "name": str, "counter": bool, "rank": int}
    process_of_track = {}  # process track uuid -> pid
    events = []  # (ts, order, uuid, kind, payload)

    for order, p in enumerate(trace.packet):
        check_known(p, f"packet {order}")
        seq = p.trusted_packet_sequence_id
        if seq == 0:
            fail(f"packet {order} has no trusted_packet_sequence_id")
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            interned[seq] = {"names": {}, "categories": {}, "args": {}}
            cleared.add(seq)
        if p.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE and seq not in cleared:
            fail(f"packet {order} needs incremental state its sequence never cleared")
        if p.HasField("interned_data"):
            if seq not in cleared:
                fail(f"packet {order} interns data before its sequence cleared its state")
            t = interned[seq]
            for e in p.interned_data.event_names:
                t["names"][e.iid] = e.name
            for e in p.interned_data.event_categories:
                t["categories"][e.iid] = e.name
            for e in p.interned_data.debug_annotation_names:
                t["args"][e.iid] = e.name
        data_kind = p.WhichOneof("data")
        if data_kind == "track_descriptor":
            d = p.track_descriptor
            if d.uuid in tracks or d.uuid in process_of_track:
                fail(f"track {d.uuid} described twice")
            if d.HasField("process"):
                processes[d.process.pid] = d.process.process_name
                process_of_track[d.uuid] = d.process.pid
            else:
                if d.parent_uuid not in process_of_track:
                    fail(f"track {d.uuid} ({d.name}) has no known parent process track")
                tracks[d.uuid] = {
                    "process": process_of_track[d.parent_uuid],
                    "name": d.name,
                    "counter": d.HasField("counter"),
                    "rank": d.sibling_order_rank,
                }
        elif data_kind == "track_event":
            e = p.track_event
            if not p.HasField("timestamp"):
                fail(f"track event packet {order} has no timestamp")
            events.append((p.timestamp, order, e.track_uuid, e, seq))
        else:
            fail(f"unexpected packet {order}: {data_kind}")

    slices, counters = [], []
    open_slices = {}
    for ts, order, uuid, e, seq in sorted(events, key=lambda x: (x[0], x[1])):
        if uuid not in tracks:
            fail(f"event at {ts} on undescribed track {uuid}")
        track = tracks[uuid]
        where = {"process": processes.get(track["process"]), "track": track["name"]}
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            t = interned[seq]
            if e.HasField("name_iid"):
                if e.name_iid not in t["names"]:
                    fail(f"unknown name iid {e.name_iid}")
                name = t["names"][e.name_iid]
            else:
                name = e.name
            if len(e.category_iids) != 1:
                fail(f"slice {name} at {ts}: {len(e.category_iids)} categories")
            args = {}
            for a in e.debug_annotations:
                key = t["args"][a.name_iid] if a.HasField("name_iid") else a.name
                args[key] = annotation_value(a)
            s = dict(where, name=name, category=t["categories"][e.category_iids[0]],
                     ts_ns=ts, dur_ns=None, args=args)
            open_slices.setdefault(uuid, []).append(s)
            slices.append(s)
        elif e.type == pb.TrackEvent.TYPE_SLICE_END:
            stack = open_slices.get(uuid)
            if not stack:
                fail(f"slice end at {ts} on {track['name']} without a begin")
            s = stack.pop()
            s["dur_ns"] = ts - s["ts_ns"]
        elif e.type == pb.TrackEvent.TYPE_COUNTER:
            if not track["counter"]:
                fail(f"counter value on the non-counter track {track['name']}")
            kind = e.WhichOneof("counter_value_field")
            if kind not in ("counter_value", "double_counter_value"):
                fail(f"counter event without a value at {ts}")
            counters.append(dict(where, ts_ns=ts, value=float(getattr(e, kind))))
        else:
            fail(f"unexpected track event type {e.type}")
    for uuid, stack in open_slices.items():
        if stack:
            fail(f"{len(stack)} slice(s) never ended on {tracks[uuid]['name']}")

    print(json.dumps({
        "processes": {str(k): v for k, v in processes.items()},
        "tracks": sorted(tracks.values(), key=lambda t: (t["process"], t["rank"], t["name"])),
        "slices": slices,
        "counters": counters,
        "packets": len(trace.packet),
    }))


main()
