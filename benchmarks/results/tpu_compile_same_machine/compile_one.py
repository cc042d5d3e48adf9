"""One `benchmarks.tpu_aot` model program compiled for a TPU by the kvjax of a given checkout
(tpu_compile_same_machine.md): python compile_one.py TREE CHIP POLICY PROGRAM BATCH PROMPT, in a process started
with `kvjax.tpu.offline_env(CHIP)`. TREE goes first on sys.path, so two commits' code compile the same program on
one machine; the kvjax imported is printed, then the compile seconds."""
import sys
import time

sys.path.insert(0, sys.argv[1])
import kvjax  # noqa: E402  (TREE's, before jax starts: the platform guard)
from benchmarks import tpu_aot  # noqa: E402
from kvjax import tpu  # noqa: E402

chip, policy, program, batch, prompt = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
print(kvjax.__file__)
topo = tpu.topology(chip)
case = tpu_aot.model_case("llama-1b", policy, program, batch, prompt)
t = time.perf_counter()
row = tpu_aot.compile_case(case, topo.devices, chip)
print(sys.argv[1], policy, program, "compile_s", row.get("compile_s"), "wall", round(time.perf_counter() - t, 1),
      row.get("ok"), row.get("error", ""), flush=True)
