#!/usr/bin/env python3
"""A Mooncake-shaped conversation trace for `inspect simulate` benchmarks.

usage: mooncake_shaped.py OUT.jsonl REQUESTS SPAN_SECONDS

Writes Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids of 512-token
blocks): requests spread evenly over the span with up to 300 ms of jitter; 60 % continue
one of the last 200 conversations (1-4 new blocks after its earlier ones), the rest start
a new one (log-normal, median 16 blocks); answers log-normal, median 300 tokens, at most
2,000. Deterministic (xorshift seeded by a constant), so a benchmark can be rerun on the
same file: docs/performance.md's simulate rows use `… 2000 600`, `… 20000 6000` and
`… 1000000 300000`; convert with `vllm-vcr inspect convert --from mooncake --block-size 512`.
"""
import json, math, sys
M=(1<<64)-1
def uniform(rng):
    def f():
        nonlocal rng
        rng ^= (rng << 13) & M; rng ^= rng >> 7; rng ^= (rng << 17) & M
        return (rng >> 11) / float(1 << 53)
    return f
def write(path, n, span_s):
    unit=uniform(0x9e3779b97f4a7c15)
    def lognormal(median, sigma):
        a,b=1.0-unit(),unit()
        return median*math.exp(sigma*math.sqrt(-2.0*math.log(a))*math.cos(2*math.pi*b))
    convs=[]; next_id=0
    with open(path,'w') as f:
        for i in range(n):
            ts=int(i*span_s*1000.0/n+unit()*300.0)
            if convs and unit()<0.6:
                c=int(unit()*len(convs)); more=1+int(unit()*4.0)
                for _ in range(more):
                    next_id+=1; convs[c].append(next_id)
                convs.append(convs.pop(c))
            else:
                ln=max(int(lognormal(16.0,0.8)),1)
                c=[next_id+1+k for k in range(ln)]; next_id+=ln; convs.append(c)
                if len(convs)>200: convs.pop(0)
            hashes=convs[-1][:60]
            inp=len(hashes)*512-int(unit()*511.0)
            out=min(max(int(lognormal(300.0,0.7)),1),2000)
            f.write(json.dumps({"timestamp":ts,"input_length":inp,"output_length":out,"hash_ids":hashes})+"\n")
write(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
