"""The cache-policy options every command line takes, by their argparse names: each goes to the policies that
take it (`kvjax.policies.REGISTRY`), and a suite keyed by policy descriptions leaves them out of its identity."""

POLICY_OPTIONS = ("sinks", "anchor_slots", "shallow_layers", "group_agg", "positions", "prefill_mode", "ratio",
                  "observation_window", "kernel", "pool", "combine", "recent", "beta", "heads", "compression", "buffer",
                  "compensate", "fold", "bucket", "chunk", "duo_pattern", "head_compression", "adakv_alpha",
                  "kvzip_chunk", "kvzip_layerwise", "chunk_length", "epsilon", "first_stage_ratio",
                  "kvzap", "threshold", "dms_window", "kvzap_decoding")
