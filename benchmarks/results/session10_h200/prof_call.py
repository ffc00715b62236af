"""Where the eager decode call's host time goes on the H200 host: layer timings + cProfile."""
import cProfile, pstats, time, io, statistics, sys
import torch
import xpu_ops
from bench_op_call import decode_inputs
dev = torch.device("cuda")
w = decode_inputs(1, 1024, 16, torch.bfloat16, dev)
q, kc, vc = w["q"], w["k_cache"], w["v_cache"]
kw = dict(cache_seqlens=w["cache_seqlens"], page_table=w["page_table"], cu_seqlens_q=w["cu_seqlens_q"], max_seqlen_q=1, causal=True)
out = torch.empty_like(q)
def host_us(fn, n=400):
    for _ in range(50): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
        if len(ts) % 50 == 0: torch.cuda.synchronize()
    torch.cuda.synchronize(); return statistics.median(ts) / 1e3
rows = {}
rows["wrapper flash_attn_with_kvcache"] = host_us(lambda: xpu_ops.flash_attn_with_kvcache(q, kc, vc, **kw))
rows["wrapper, out= given"] = host_us(lambda: xpu_ops.flash_attn_with_kvcache(q, kc, vc, out=out, **kw))
from xpu_ops.triton import paged_attention as pa
import inspect
print(inspect.signature(pa.paged_attention))
lse = torch.empty(q.shape[1], q.shape[0], device=dev, dtype=torch.float32)
try:
    rows["pa.paged_attention direct"] = host_us(lambda: pa.paged_attention(q, kc, vc, out, kw["cache_seqlens"], kw["cu_seqlens_q"], page_table=kw["page_table"], cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=kw["page_table"].shape[1]*kc.shape[1], qv=None, q_descale=None, k_descale=None, v_descale=None, sinks=None, softmax_scale=q.shape[-1]**-0.5, window_left=-1, window_right=0, softcap=0.0))
except Exception as e:
    print("direct failed", type(e).__name__, e)
rows["torch.empty x3 + zeros(1)"] = host_us(lambda: (torch.empty(4, 32, 80, device=dev), torch.empty(32, 1, device=dev), torch.empty_like(q), torch.zeros(8, dtype=torch.int32, device=dev)))
rows["sdpa"] = host_us(lambda: torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), w["k_dense"], w["v_dense"], enable_gqa=True))
for k, v in rows.items(): print(f"{k:40s} {v:8.1f} us host")
pr = cProfile.Profile()
pr.enable()
for _ in range(300): xpu_ops.flash_attn_with_kvcache(q, kc, vc, **kw)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:9000])
