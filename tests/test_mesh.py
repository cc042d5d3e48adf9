"""Sharded generation over a 2x4 mesh of host devices equals one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.sharding import check_shardable
from kvjax.models.tiny import make_random_checkpoint, tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_sharded_generation_equals_one_device(tmp_path):
    # 8 query heads, 4 KV heads: whole heads split over a 4-way tensor-parallel axis.
    path = make_random_checkpoint(tmp_path / "m", tiny_config(num_heads=8, num_kv_heads=4, head_dim=8), init_std=0.15)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_script.py"), str(path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kernel_spec"].endswith("(None, 'model')")
    for name in ("full", "streaming"):
        r = report[name]
        assert r["same_tokens"], name
        assert r["logit_scale"] > 0.5 and r["max_logit_diff"] <= 1e-5, (name, r)
        assert r["generate_cache_devices"] == 8  # the cache is spread over the mesh, not on one device
    # kvjax's Pallas kernels on the mesh: per shard, the tokens one device gives
    for name in ("pallas-snapkv", "pallas-4bit"):
        assert report[name]["same_tokens"], name
        assert report[name]["generate_cache_devices"] == 8, name
    # 4 KV heads cannot be split 8 ways
    assert "num_attention_heads=8" not in report["error"]
    assert "num_key_value_heads=4 is not divisible by the mesh's tensor-parallel axis 'model' of size 8" in report["error"]


def test_head_counts_must_divide_the_model_axis():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by the mesh's tensor-parallel axis 'model' of size 3"):
        check_shardable(tiny_config(), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible .* of size 4"):
        check_shardable(tiny_config(), 4)
    check_shardable(tiny_config(), 2)
