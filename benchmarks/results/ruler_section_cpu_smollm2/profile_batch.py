"""Where one RULER batch's time goes: each phase of generate_many timed (blocking), per policy, compile seconds
beside them (batch-profile.md). An ad hoc script kept with its output; run from the repository's root:
`python benchmarks/results/ruler_section_cpu_smollm2/profile_batch.py OUT [TASK]` (TASK: niah_single_1 by default)."""
import collections, functools, sys, time, json
import kvjax.backends  # noqa: F401  (before jax: libtpu kept off the network)
import jax
import importlib; G = importlib.import_module("kvjax.generate"); KZ = importlib.import_module("kvjax.kvzip")

T = collections.defaultdict(float)
COMP = collections.defaultdict(float)
import jax.monitoring
PH = {"cur": "other"}
def _lis(event, dur, **kw):
    if event in ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration"):
        COMP[(PH["cur"], event.split("/")[-1])] += dur
jax.monitoring.register_event_duration_secs_listener(_lis)
N = collections.Counter()
CUR = {"pol": None}

def timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        PH["cur"] = name
        out = fn(*a, **k)
        jax.block_until_ready(out)
        PH["cur"] = "other"
        dt = time.perf_counter() - t
        plan = k.get("plan") or (k.get("plans") or [None])[0]
        key = (name, type(plan.policy).__name__ if plan is not None else "?")
        T[key] += dt; N[key] += 1
        return out
    return w

class Wrap:
    def __init__(self, name, f): self.f, self.pure = f, timed(name, f.pure)
    def __getattr__(self, a): return getattr(self.f, a)

for n in ("prefill_many_fn", "prefill_fn", "question_fn", "decode_fn", "capture_fn", "recache_fn"):
    setattr(G, n, Wrap(n, getattr(G, n)))
_kz = KZ.compress
def kz(model, cache, plan, prompts, replays):
    PH["cur"] = "kvzip"; t = time.perf_counter(); out = _kz(model, cache, plan, prompts, replays); jax.block_until_ready(out)
    T[("kvzip.compress", type(plan.policy).__name__)] += time.perf_counter() - t; PH["cur"] = "other"; N[("kvzip.compress", "")] += 1
    return out
G.kvzip.compress = kz

from experiments import report
base = sys.argv[1]
task = sys.argv[2] if len(sys.argv) > 2 else "niah_single_1"
from kvjax import compile_cache; compile_cache.enable()
for rep in (0,):
    T.clear(); N.clear()
    t0 = time.perf_counter()
    try:
        report.main(["--model", "smollm2", "--budgets", "128,256,512", "--ruler-length", "4096",
                     "--ruler-tasks", task, "--ruler-samples", "5", "--ruler-ratios", "0.5,0.875",
                     "--ruler-batch", "5", "--chat-template", "auto", "--ruler-methods",
                     "streaming,h2o,snapkv,pyramidkv,slimkv,tova,knorm,adakv,expected-attention,keydiff,kvzip,duo",
                     "--skip", "perplexity,razor,longbench,zeroshot,passkey,efficiency,quantization",
                     "--out", f"{base}/rep{rep}"])
    except SystemExit as e:
        print("exit", e)
    wall = time.perf_counter() - t0
    rows = sorted(T.items(), key=lambda x: -x[1])
    by_phase = collections.defaultdict(float)
    for (ph, _), s in T.items(): by_phase[ph] += s
    print("compile", {k: round(v, 1) for k, v in COMP.items()})
    print(f"=== rep {rep}: wall {wall:.1f} s; phases", {k: round(v, 1) for k, v in by_phase.items()}, flush=True)
    for (ph, pol), s in rows: print(f"  {ph:18s} {pol:24s} {s:8.2f} s  x{N[(ph, pol)]}")
    json.dump({"wall": wall, "rows": [[ph, pol, s, N[(ph, pol)]] for (ph, pol), s in rows]}, open(f"{base}/prof{rep}.json", "w"))
